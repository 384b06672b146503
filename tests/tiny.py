"""Tiny K2-architecture configs and checkpoints for tests: same formats as the real Kimi K2.6 files; and a drafter
broken at random places (HostileDrafter), which may cost speed but never a token."""

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
    model = M.Transformer(C.model_args(cfg))
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


def write_cli_pair(d, cfg: dict, seed: int):
    """A tiny K2.6-layout target in d with a Kimi-layout tokenizer (256 byte tokens + the special
    tokens), the chat template, and its drafter in d/draft (random weights: the loader refuses
    torch.empty's NaN / inf bytes). Returns d."""
    import draft as dflash
    from tokenizer import KIMI_SPECIAL_TOKENS, write_chat_template, write_tiktoken_model, write_tokenizer_config
    ref = write_k26(d, cfg, seed=seed)
    write_tiktoken_model(d / "tiktoken.model", {bytes([i]): i for i in range(256)})
    write_tokenizer_config(d / "tokenizer_config.json", KIMI_SPECIAL_TOKENS(256))
    write_chat_template(d)
    dcfg = C.tiny_draft_config(ref.args)
    drafter = dflash.DFlashDrafter(C.draft_args(dcfg))
    randomize_(drafter, seed=4, std=0.2)
    C.write_drafter(str(d / "draft"), drafter, dcfg)
    return d


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


def corrupt_logits(logits: torch.Tensor, oracle: torch.Tensor | None = None) -> torch.Tensor:
    """What a broken drafter returns, [..., V]: each row (one depth of one batch row) on its own is the oracle's
    (tokens the target will commit, when given; else the drafter's own), the drafter's own, or broken: all NaN, a
    few NaN, +inf here and there, all -inf, +-3e38 (inf in fp16), all equal, or spots of NaN / +-inf / +-3e38 over
    the oracle's row. Tensor ops on the default generator, no host sync: a CUDA graph captures it, and each replay
    draws anew."""
    x = logits.float()
    good = x if oracle is None else oracle.float()
    kind = torch.randint(0, 12, (*x.shape[:-1], 1), device=x.device)        # [..., 1] one kind per row
    u = torch.rand(x.shape, device=x.device)                                 # [..., V]
    spot = torch.randint(0, 5, x.shape, device=x.device)                    # [..., V]
    nan, inf = float("nan"), float("inf")
    spots = torch.where(spot == 0, nan, torch.where(spot == 1, inf, torch.where(spot == 2, -inf, torch.where(
        spot == 3, 3e38, -3e38))))
    rows = [good, good, good, good, x,
            torch.full_like(x, nan), torch.where(u < 0.02, nan, good), torch.where(u < 0.05, inf, good),
            torch.full_like(x, -inf), torch.where(u < 0.5, 3e38, -3e38), torch.full_like(x, 7.0),
            torch.where(u < 0.1, spots, good)]
    out = x
    for k, row in enumerate(rows):
        out = torch.where(kind == k, row, out)
    return out.to(logits.dtype)


class HostileDrafter:
    """A drafter (the real DFlash module) whose logits corrupt_logits breaks at random places; everything else is
    the drafter's own. reference [B, S] int64 on the drafter's device (optional): each row's prompt and its
    autoregressive continuation, the oracle that lets steps accept drafts between the broken rows (the drafter
    places the block's last committed token at ctx_len + n_valid)."""

    def __init__(self, drafter, reference: torch.Tensor | None = None):
        self.drafter, self.reference = drafter, reference

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def draft_logits(self, target, last_token, ctx_feats, ctx_len, n_valid):
        x = self.drafter.draft_logits(target, last_token, ctx_feats, ctx_len, n_valid)          # [B, L, V]
        oracle = None
        if self.reference is not None:
            B, L, V = x.shape
            pos = (ctx_len + n_valid)[:, None] + torch.arange(1, L + 1, device=x.device)      # [B, L]
            tok = self.reference[:B].gather(1, pos.clamp(max=self.reference.shape[1] - 1))    # [B, L]
            oracle = torch.where(torch.arange(V, device=x.device) == tok[..., None], 10.0, 0.0)   # [B, L, V]
        return corrupt_logits(x, oracle)


def nan_logits_where(model, monkeypatch, bad) -> None:
    """The model's logits become NaN where bad(tokens, positions) [B, T] bool holds, positions as the model places
    the tokens; nothing else changes (no NaN reaches a cache). Tensor ops: a CUDA graph captures it."""
    forward = model.forward

    def patched(tokens, start_pos=None, positions=None, last_only=False, **kw):
        res = forward(tokens, start_pos=start_pos, positions=positions, last_only=last_only, **kw)
        if positions is None:
            start = torch.as_tensor(0 if start_pos is None else start_pos, device=tokens.device)
            positions = start.view(-1, 1) + torch.arange(tokens.shape[1], device=tokens.device)      # [B, T]
        where = bad(tokens, positions.expand_as(tokens))[..., None]                              # [B, T, 1]
        return res._replace(logits=res.logits.masked_fill(where[:, -1:] if last_only else where,
                                                           float("nan")))
    monkeypatch.setattr(model, "forward", patched)
