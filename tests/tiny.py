"""Tiny K2-architecture configs and checkpoints for tests: same formats as the real Kimi K2.6 files."""

import torch

import checkpoint as C
import model as M


def text_config(**over) -> dict:
    """A flat DeepSeek-V3/Kimi-K2 text config, tiny: several heads, 8 experts top-2, 1 dense + 2 MoE
    layers, YaRN with beta_fast != beta_slow."""
    cfg = dict(model_type="deepseek_v3", vocab_size=96, hidden_size=64, intermediate_size=96,
               moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
               moe_layer_freq=1, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
               norm_topk_prob=True, routed_scaling_factor=2.827, rms_norm_eps=1e-5, rope_theta=50000.0,
               rope_scaling=dict(type="yarn", factor=8.0, original_max_position_embeddings=32, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
               max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
               num_nextn_predict_layers=0, hidden_act="silu", attention_bias=False)
    cfg.update(over)
    return cfg


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.15) -> None:
    """Random weights with enough spread that routing and attention are far from ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dtype.is_floating_point:
                p.copy_(std * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def random_model(cfg: dict, seed: int = 0) -> "M.Transformer":
    model = M.Transformer(M.ModelArgs.from_config(cfg))
    randomize_(model, seed)
    return model


def write_k26(path, cfg: dict | None = None, seed: int = 0, n_shards: int = 3, quant: bool = True):
    """A random tiny model written in the exact K2.6 layout (nested config, INT4 experts, shards).
    Returns the float reference model whose experts hold the dequantized INT4 weights."""
    cfg = cfg or text_config()
    ref = random_model(cfg, seed)
    state = C.hf_state_dict(ref)
    full = C.k26_config(cfg, 32 if quant else None)
    if quant:   # round the reference experts to the INT4 grid so both sides hold the same weights
        for k, v in list(state.items()):
            if ".experts." in k:
                q, s = C.quantize_int4(v)
                state[k] = (q, s)
                deq = (q.view(q.shape[0], -1, 32).float() * s.float().unsqueeze(-1)).view(q.shape)
                _set_expert(ref, k, deq)
    C.save_checkpoint(state, full, str(path), n_shards=n_shards)
    return ref


def _set_expert(model, key: str, w: torch.Tensor) -> None:
    parts = key.split(".")
    layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
    ex = model.layers[layer].mlp.experts
    n = ex.inter
    with torch.no_grad():
        if proj == "gate_proj":
            ex.w13[e, :n] = w
        elif proj == "up_proj":
            ex.w13[e, n:] = w
        else:
            ex.w2[e] = w


def count_launches(monkeypatch, names=None) -> dict:
    """Wrap the registered Triton launchers (all, or `names`) so that each call is counted: returns the live
    {name: calls} dict. A kernel that is never called had its fits() refuse the arguments."""
    import kernels
    calls = {}

    def counted(name, launch):
        def run(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return launch(*a, **kw)
        return run
    for name in names or list(kernels._KERNELS):
        fits, launch = kernels._KERNELS[name]
        monkeypatch.setitem(kernels._KERNELS, name, (fits, counted(name, launch)))
    return calls
