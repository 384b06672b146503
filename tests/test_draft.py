"""draft.py against a plain implementation of the DFlash equations, written here from scratch (loops over
batch rows and heads, explicit softmax; only the weights dict is shared), plus config/checkpoint checks.
Run: python -m pytest -q tests/test_draft.py"""
import json
import math

import pytest
import torch

import checkpoint as C
import draft as Dr
import tiny
from checkpoint import CheckpointError

torch.set_default_dtype(torch.float32)
TOL = 1e-5


# ----------------------------------------------------------------------------------------------
# The reference: recompute everything from ALL context features (positions 0..C-1), block at C..C+bs-1.


def yarn_reference(cfg: dict) -> tuple[torch.Tensor, float]:
    """inv_freq from transformers' own YaRN code; amplitude = the legacy 1 + 0.1 ln(factor)."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hcfg = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    inv_freq, _hf_amp = ROPE_INIT_FUNCTIONS["yarn"](hcfg, "cpu")
    return inv_freq.float(), 1 + 0.1 * math.log(cfg["rope_scaling"]["factor"])


def ref_drafter(W: dict, cfg: dict, block_embeds, ctx_feats_all):
    """block_embeds [B, bs, D], ctx_feats_all [B, C, n_taps*D] -> hidden [B, bs, D], from the equations."""
    eps, H, KV, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inv_freq, amp = yarn_reference(cfg)
    B, bs, _ = block_embeds.shape
    C = ctx_feats_all.shape[1]

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def rope(x, pos):     # x [T, hd], pos [T]: pairs (i, i + hd/2)
        ang = pos[:, None].float() * inv_freq[None, :]
        cos, sin = torch.cos(ang) * amp, torch.sin(ang) * amp
        x1, x2 = x[:, :hd // 2], x[:, hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    pos_ctx, pos_blk = torch.arange(C), C + torch.arange(bs)
    f = rms(ctx_feats_all @ W["fc.weight"].T, W["hidden_norm.weight"])                   # [B, C, D]
    h = block_embeds.clone()
    for l in range(cfg["num_hidden_layers"]):
        p = f"layers.{l}."
        Wq, Wk, Wv = (W[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        bq, bk, bv, bo = (W.get(p + f"self_attn.{n}_proj.bias", torch.zeros(())) for n in "qkvo")  # attention_bias
        x = rms(h, W[p + "input_layernorm.weight"])
        attn = torch.zeros(B, bs, H * hd)
        for b in range(B):
            for head in range(H):
                g = head // (H // KV)                   # the kv head this query head shares
                rq, rk = slice(head * hd, (head + 1) * hd), slice(g * hd, (g + 1) * hd)
                bq_, bk_, bv_ = (t if t.dim() == 0 else t[r] for t, r in ((bq, rq), (bk, rk), (bv, rk)))
                q = rope(rms(x[b] @ Wq[rq].T + bq_, W[p + "self_attn.q_norm.weight"]), pos_blk)
                k_ctx = rope(rms(f[b] @ Wk[rk].T + bk_, W[p + "self_attn.k_norm.weight"]), pos_ctx)
                k_blk = rope(rms(x[b] @ Wk[rk].T + bk_, W[p + "self_attn.k_norm.weight"]), pos_blk)
                K = torch.cat([k_ctx, k_blk])
                V = torch.cat([f[b] @ Wv[rk].T + bv_, x[b] @ Wv[rk].T + bv_])
                s = q @ K.T / math.sqrt(hd)                                               # [bs, C+bs]: no mask
                attn[b, :, rq] = torch.softmax(s, dim=-1) @ V
        h = h + attn @ W[p + "self_attn.o_proj.weight"].T + bo
        x = rms(h, W[p + "post_attention_layernorm.weight"])
        gate, up = x @ W[p + "mlp.gate_proj.weight"].T, x @ W[p + "mlp.up_proj.weight"].T
        h = h + (gate * torch.sigmoid(gate) * up) @ W[p + "mlp.down_proj.weight"].T
    return rms(h, W["norm.weight"])


# ----------------------------------------------------------------------------------------------
# Fixtures




@pytest.fixture(scope="module")
def target():
    return tiny.random_model(tiny.text_config(), seed=0)


def make_ckpt(path, target_args, seed=1, n_shards=1, **over):
    cfg = C.tiny_draft_config(target_args, **over)
    d = Dr.DFlashDrafter(C.draft_args(cfg))
    tiny.randomize_(d, seed, std=0.2)
    C.write_drafter(str(path), d, cfg, n_shards=n_shards)
    W = {k: v.detach().clone() for k, v in C.checkpoint_tensors(d).items()}     # under the checkpoint's names
    return cfg, W


def loaded(path, target_args, Bmax=2, ctx=64):
    d = C.load_drafter(str(path), target_args)
    d.setup_cache(Bmax, ctx)
    return d


def lens(B, ctx_len, n):
    """The forward's ctx_len and n_valid ([B] each) for rows that all hold ctx_len context rows and get n
    new ones, none of them padding."""
    return torch.full((B,), ctx_len), torch.full((B,), n)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def err(a, b):
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------------------------
# Forward == equations, incremental cache == recompute


@pytest.mark.parametrize("n_shards", [1, 3])
def test_incremental_rounds_match_reference(tmp_path, target, n_shards):
    cfg, W = make_ckpt(tmp_path, target.args, n_shards=n_shards)
    inc = loaded(tmp_path, target.args)
    B, D, bs, n_taps = 2, cfg["hidden_size"], cfg["block_size"], len(cfg["dflash_config"]["target_layer_ids"])
    feats = randn(B, 20, n_taps * D, seed=2)          # context features of 20 committed tokens
    ctx_len = 0
    for r, n_new in enumerate([9, 3, 1, 4]):           # round 1 = prompt, then accepted-path lengths
        blk = randn(B, bs, D, seed=10 + r)
        got = inc.cached_forward(blk, feats[:, ctx_len:ctx_len + n_new], *lens(B, ctx_len, n_new))
        ref = ref_drafter(W, cfg, blk, feats[:, :ctx_len + n_new])
        fresh = loaded(tmp_path, target.args)          # fresh cache, all context features at once
        once = fresh.cached_forward(blk, feats[:, :ctx_len + n_new], *lens(B, 0, ctx_len + n_new))
        assert got.shape == (B, bs, D)
        assert err(got, ref) <= TOL, f"round {r}: drafter vs equations {err(got, ref):.2e}"
        assert err(got, once) <= TOL, f"round {r}: incremental vs recompute {err(got, once):.2e}"
        ctx_len += n_new


@pytest.mark.parametrize("bias", [False, True])
def test_plain_forward_matches_equations(tmp_path, target, bias):
    """plain_forward (no cache: context and block K/V concatenated, one attention) == the
    equations; its mask selects keys: a block that sees only the first 7 context rows == the plain
    forward over those 7."""
    cfg, W = make_ckpt(tmp_path, target.args, attention_bias=bias)
    d = C.load_drafter(str(tmp_path), target.args)
    B, D, bs = 2, cfg["hidden_size"], cfg["block_size"]
    n_taps = len(cfg["dflash_config"]["target_layer_ids"])
    feats, blk = randn(B, 12, n_taps * D, seed=2), randn(B, bs, D, seed=3)
    with torch.no_grad():
        got = d.plain_forward(blk, feats, 12 + torch.arange(bs).expand(B, bs))
        ref = ref_drafter(W, cfg, blk, feats)
        assert err(got, ref) <= TOL, f"plain forward vs equations {err(got, ref):.2e}"
        pos = 7 + torch.arange(bs).expand(B, bs)
        keys = torch.cat([torch.arange(12) < 7, torch.ones(bs, dtype=torch.bool)])     # [12 + bs]
        cut = d.plain_forward(blk, feats[:, :7], pos)
        assert err(d.plain_forward(blk, feats, pos, keys.expand(B, bs, -1)), cut) <= TOL
        assert err(cut, got) > 10 * TOL                        # the context matters at this size


def test_cached_logits_match_plain_forward(tmp_path, target):
    """What the decode step runs (draft_logits: the cached forward; rounds of new context rows, then
    a fixed-shape round with per-row cache lengths and padding rows) == the plain drafter over each
    row's whole context, to rounding in fp32."""
    cfg, _ = make_ckpt(tmp_path, target.args)
    d = loaded(tmp_path, target.args)
    B, D, bs, V = 2, cfg["hidden_size"], cfg["block_size"], cfg["vocab_size"]
    n_taps = len(cfg["dflash_config"]["target_layer_ids"])
    feats = randn(B, 24, n_taps * D, seed=2)
    last = torch.randint(0, V, (4, B), generator=torch.Generator().manual_seed(5))

    def plain(b: int, n: int, token) -> torch.Tensor:     # row b's logits from its first n rows
        block = torch.full((1, bs), cfg["dflash_config"]["mask_token_id"])
        block[0, 0] = token
        pos = n + torch.arange(bs)[None]                                                # [1, bs]
        h = d.plain_forward(target.embed_tokens(block), feats[b:b + 1, :n], pos)
        return target.head(h[:, 1:])[0]                                                 # [bs-1, V]

    def check(got, b, n, token, what):
        ref = plain(b, n, token)
        assert err(got[b], ref) <= 1e-5 * ref.abs().max(), f"{what}: {err(got[b], ref):.2e}"

    with torch.no_grad():
        ctx = 0
        for r, n_new in enumerate([9, 3, 1]):
            got = d.draft_logits(target, last[r], feats[:, ctx:ctx + n_new], *lens(B, ctx, n_new))
            ctx += n_new
            for b in range(B):
                check(got, b, ctx, last[r, b], f"round {r} row {b}")
        n_valid, start = torch.tensor([2, 4]), torch.tensor([ctx - 1, ctx])    # row 0 rolls back
        padded = randn(B, bs, n_taps * D, seed=7) * 100                        # padding: garbage
        for b in range(B):
            padded[b, :n_valid[b]] = feats[b, start[b]:start[b] + n_valid[b]]
        got = d.draft_logits(target, last[3], padded, start, n_valid)
        for b in range(B):
            check(got, b, int(start[b] + n_valid[b]), last[3, b], f"fixed-shape row {b}")


def test_attention_bias_matches_equations(tmp_path, target):
    """A drafter with attention_bias (Qwen-style q/k/v/o biases) against the equations with them: the q/k/v biases
    are stacked like their weights (one parameter each, filled from the checkpoint's q/k/v tensors at load) and
    added by the one GEMM."""
    cfg, W = make_ckpt(tmp_path, target.args, attention_bias=True)
    assert W["layers.0.self_attn.q_proj.bias"].abs().sum() > 0 and "layers.0.self_attn.o_proj.bias" in W
    B, D, bs, n_taps = 2, cfg["hidden_size"], cfg["block_size"], len(cfg["dflash_config"]["target_layer_ids"])
    feats, blk = randn(B, 12, n_taps * D, seed=2), randn(B, bs, D, seed=3)
    d = loaded(tmp_path, target.args)
    at = d.layers[0].self_attn
    assert torch.equal(at.qkv_proj.bias, torch.cat([W[f"layers.0.self_attn.{n}_proj.bias"] for n in "qkv"]))
    got = d.cached_forward(blk, feats, *lens(B, 0, 12))
    ref = ref_drafter(W, cfg, blk, feats)
    assert err(got, ref) <= TOL, f"drafter with biases vs equations {err(got, ref):.2e}"
    no_bias = {k: (torch.zeros_like(v) if k.endswith("_proj.bias") else v) for k, v in W.items()}
    assert err(got, ref_drafter(no_bias, cfg, blk, feats)) > 10 * TOL    # the biases matter at this size


def test_per_row_ctx_len_and_stale_slots(tmp_path, target):
    """Per-row ctx_len: row 0 rolls back to 5 (its slots 5, 6 held rejected rows), row 1 is at 7.
    The new rows overwrite stale slots, and no row sees anything past its own ctx_len + n_new."""
    cfg, W = make_ckpt(tmp_path, target.args)
    d = loaded(tmp_path, target.args)
    B, D, bs = 2, cfg["hidden_size"], cfg["block_size"]
    feats = randn(B, 7, 2 * D, seed=3)
    new = randn(B, 2, 2 * D, seed=4)
    d.cached_forward(randn(B, bs, D, seed=5), feats, *lens(B, 0, 7))
    blk = randn(B, bs, D, seed=6)
    got = d.cached_forward(blk, new, torch.tensor([5, 7]), torch.tensor([2, 2]))
    ref0 = ref_drafter(W, cfg, blk[:1], torch.cat([feats[:1, :5], new[:1]], 1))
    ref1 = ref_drafter(W, cfg, blk[1:], torch.cat([feats[1:], new[1:]], 1))
    assert err(got[0], ref0[0]) <= TOL and err(got[1], ref1[0]) <= TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the drafter's Triton path runs on a GPU; its kernels alone "
                    "run everywhere (tests/test_kernels.py, under the interpreter on a CPU)")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_gpu_kernel_path_matches_equations(tmp_path, target, dtype, tol, monkeypatch):
    """head_dim 32, so the forward takes the Triton qkv_norm_rope and block_attention (counted): a prompt, then
    rounds the way a fixed-shape step calls it (per-row cache lengths, bs context rows of which only n_valid are
    real, the padding rows garbage), each row against the equations."""
    calls = tiny.count_launches(monkeypatch, ("qkv_norm_rope", "block_attention"))
    cfg, W = make_ckpt(tmp_path, target.args, head_dim=32)
    B, D, bs, n_taps = 2, cfg["hidden_size"], cfg["block_size"], len(cfg["dflash_config"]["target_layer_ids"])
    d = C.load_drafter(str(tmp_path), target.args, device="cuda", dtype=dtype)
    d.setup_cache(B, 64)
    feats = randn(B, 20, n_taps * D, seed=2)
    d.cached_forward(randn(B, bs, D, seed=3).to("cuda", dtype), feats[:, :9].to("cuda", dtype),
      *(t.cuda() for t in lens(B, 0, 9)))
    ctx = [9, 9]
    for r, n_valid in enumerate([[3, 1], [4, 2], [1, 4]]):
        padded = randn(B, bs, n_taps * D, seed=20 + r) * 100                      # the padding rows: garbage
        for b in range(B):
            padded[b, :n_valid[b]] = feats[b, ctx[b]:ctx[b] + n_valid[b]]
        blk = randn(B, bs, D, seed=10 + r)
        got = d.cached_forward(blk.to("cuda", dtype), padded.to("cuda", dtype), torch.tensor(ctx, device="cuda"),
                n_valid=torch.tensor(n_valid, device="cuda")).float().cpu()
        for b in range(B):
            ref = ref_drafter(W, cfg, blk[b:b + 1], feats[b:b + 1, :ctx[b] + n_valid[b]])[0]
            assert err(got[b], ref) <= tol * ref.abs().max(), f"round {r} row {b}: {err(got[b], ref):.2e}"
            ctx[b] += n_valid[b]
    assert calls == {"qkv_norm_rope": 4 * cfg["num_hidden_layers"], "block_attention": 4 * cfg["num_hidden_layers"]}


def test_draft_logits_with_target_features(tmp_path, target):
    cfg, W = make_ckpt(tmp_path, target.args)
    d = loaded(tmp_path, target.args)
    ids = d.target_layer_ids
    tokens = torch.randint(0, cfg["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(7))
    _, feats = target(tokens[:, :-1], hidden_layers=ids)                       # [2, 7, n_taps*D]
    logits = d.draft_logits(target, tokens[:, -1], feats, *lens(2, 0, 7))
    assert logits.shape == (2, cfg["block_size"] - 1, cfg["vocab_size"]) and logits.dtype == torch.float32
    block = torch.full((2, cfg["block_size"]), cfg["dflash_config"]["mask_token_id"])
    block[:, 0] = tokens[:, -1]
    h = ref_drafter(W, cfg, target.embed_tokens.weight[block], feats)
    ref = h[:, 1:] @ target.lm_head.weight.T
    assert err(logits, ref) <= 1e-4 * ref.abs().max().item()
    assert d.block_size == cfg["block_size"] and d.mask_token_id == cfg["dflash_config"]["mask_token_id"]


def test_block_is_non_causal(tmp_path, target):
    cfg, _ = make_ckpt(tmp_path, target.args)
    d = loaded(tmp_path, target.args)
    D, bs = cfg["hidden_size"], cfg["block_size"]
    feats, blk = randn(1, 5, 2 * D, seed=8), randn(1, bs, D, seed=9)
    a = d.cached_forward(blk, feats, *lens(1, 0, 5))
    blk2 = blk.clone()
    blk2[:, -1] += 1.0                                   # change the LAST block token only
    b = d.cached_forward(blk2, feats[:, :0], *lens(1, 5, 0))            # same cached context, no new rows
    assert err(a[:, 0], b[:, 0]) > 1e-3                  # position 0 sees position bs-1


# ----------------------------------------------------------------------------------------------
# RoPE, layer ids


def test_build_target_layer_ids():
    assert Dr.build_target_layer_ids(61, 6) == [1, 12, 24, 35, 47, 58]      # Kimi K2.5/K2.6
    assert Dr.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]           # Qwen3-8B-DFlash-b16
    assert Dr.build_target_layer_ids(61, 1) == [30]


def d_amp(a: Dr.DraftArgs) -> float:
    """The drafter's cos/sin amplitude: cos at position 0."""
    cos, _ = Dr.DFlashDrafter(a).rope_cos_sin(torch.zeros(1, 1, dtype=torch.long), torch.float32)
    return cos[0, 0, 0].item()


def test_yarn_amplitude_and_frequencies(target):
    """The drafter's rope is model.py's YaRN over its whole head_dim, on Qwen3's halves, with the
    legacy amplitude 1 + 0.1 ln(factor) (what the Kimi DFlash checkpoints were trained with)."""
    cfg = C.tiny_draft_config(target.args)
    d = Dr.DFlashDrafter(C.draft_args(cfg))
    ref_inv, ref_amp = yarn_reference(cfg)
    pos = torch.arange(40).view(1, -1)
    cos, sin = d.rope_cos_sin(pos, torch.float32)                                   # [1, 40, hd]
    ang = pos[0, :, None].float() * ref_inv                                          # [40, hd/2]
    assert torch.equal(cos[0], torch.cat([ang.cos(), ang.cos()], -1) * ref_amp)
    assert torch.equal(sin[0], torch.cat([-ang.sin(), ang.sin()], -1) * ref_amp)
    amp = lambda c: d_amp(C.draft_args(c))
    assert amp(cfg) == pytest.approx(1 + 0.1 * math.log(8.0))
    kimi = dict(cfg, rope_scaling=dict(rope_type="yarn", factor=64.0, beta_fast=32.0, beta_slow=1.0,
                                       original_max_position_embeddings=4096, mscale=1.0,
                                       mscale_all_dim=1.0))
    assert amp(kimi) == pytest.approx(1.4158883)
    assert amp(dict(cfg, rope_scaling=dict(cfg["rope_scaling"], attention_factor=1.0))) == 1.0
    assert amp(dict(cfg, rope_scaling=None)) == 1.0


# ----------------------------------------------------------------------------------------------
# Rejections: incompatible drafters (before any tensor is read), malformed configs, bad tensors


@pytest.mark.parametrize("over, msg", [
    (dict(dflash_config=dict(mask_token_id=94, target_layer_ids=[0, 3])), "outside the target's layers [0, 3)"),
    (dict(dflash_config=dict(mask_token_id=94, target_layer_ids=[1, 0])), "strictly increasing"),
    (dict(hidden_size=32), "hidden_size = 32 but target hidden_size = 64"),
    (dict(vocab_size=100), "vocab_size = 100 but target vocab_size = 96"),
    (dict(dflash_config=dict(mask_token_id=96, target_layer_ids=[0, 1])), "mask_token_id = 96"),
    (dict(num_target_layers=61), "num_target_layers = 61 but target num_hidden_layers = 3"),
])
def test_incompatible_drafter_rejected_before_loading(tmp_path, target, over, msg):
    cfg = C.tiny_draft_config(target.args, **over)
    tmp_path.joinpath("config.json").write_text(json.dumps(cfg))     # no weights: must fail on config alone
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace(")", r"\)")):
        C.load_drafter(str(tmp_path), target.args)


@pytest.mark.parametrize("edit, msg", [
    (lambda c: c.pop("hidden_size"), "hidden_size is missing"),
    (lambda c: c.pop("block_size"), "block_size is missing"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id is missing"),
    (lambda c: c["dflash_config"].pop("target_layer_ids"), "target_layer_ids is missing"),
    (lambda c: c["rope_scaling"].update(rope_type="dynamic"), "'dynamic' is not supported"),
    (lambda c: c["rope_scaling"].pop("factor"), "rope_scaling.factor is missing"),
    (lambda c: c.update(layer_types=["full_attention", "sliding_attention"]), "sliding-window"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(architectures=["DFlash2DraftModel"]), "architectures"),
])
def test_malformed_config_names_file_and_field(tmp_path, target, edit, msg):
    cfg = C.tiny_draft_config(target.args)
    cfg["dflash_config"] = dict(cfg["dflash_config"])
    edit(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=msg) as e:
        C.draft_args(str(tmp_path))
    assert str(path) in str(e.value)


def test_rope_parameters_spelling_and_defaults(target):
    cfg = C.tiny_draft_config(target.args)
    rope = dict(cfg.pop("rope_scaling"), rope_theta=cfg.pop("rope_theta"))
    cfg.pop("head_dim")
    a = C.draft_args(dict(cfg, rope_parameters=rope))          # transformers 5 spelling
    assert a.rope_type == "yarn" and a.rope_theta == 50000.0 and a.head_dim == 64 // 4


def test_bad_tensors_named(tmp_path, target):
    cfg, W = make_ckpt(tmp_path / "ok", target.args)
    cases = {
        "missing": ({k: v for k, v in W.items() if k != "layers.1.self_attn.k_norm.weight"},
                    "missing drafter tensors \\['layers.1.self_attn.k_norm.weight'\\]"),
        "shape": (dict(W, **{"layers.0.self_attn.v_proj.weight": torch.zeros(40, 64)}),
                  r"layers.0.self_attn.v_proj.weight in model.safetensors has shape \[40, 64\], expected \[48, 64\]"),
        "fc": (dict(W, **{"fc.weight": torch.zeros(64, 192)}), "2 target_layer_ids x hidden_size 64"),
        "unexpected": (dict(W, **{"embed_tokens.weight": torch.zeros(96, 64)}), "unexpected tensor embed_tokens.weight"),
    }
    for name, (state, msg) in cases.items():
        C.write_drafter(str(tmp_path / name), state, cfg)
        with pytest.raises(C.CheckpointError, match=msg):
            C.load_drafter(str(tmp_path / name), target.args)
    # an optional `model.` prefix loads to the same weights
    C.write_drafter(str(tmp_path / "prefixed"), {"model." + k: v for k, v in W.items()}, cfg)
    d = C.load_drafter(str(tmp_path / "prefixed"), target.args)
    assert all(torch.equal(p, W[k]) for k, p in C.checkpoint_tensors(d).items())


@pytest.mark.parametrize("key,value", [("layers.0.input_layernorm.weight", float("nan")),
                                       ("fc.weight", float("inf")), ("norm.weight", float("-inf"))])
def test_nonfinite_weights_named_at_load(tmp_path, target, key, value):
    """A NaN or inf in any drafter tensor (one element of a norm is enough to make every draft NaN) is an error
    naming the tensor and its file, as for the target; a sharded drafter names the right shard."""
    cfg, W = make_ckpt(tmp_path / "ok", target.args)
    W[key].view(-1)[1] = value
    C.write_drafter(str(tmp_path / "bad"), W, cfg)
    with pytest.raises(C.CheckpointError, match=f"^tensor {key} in model.safetensors holds NaN or inf$"):
        C.load_drafter(str(tmp_path / "bad"), target.args)
    C.write_drafter(str(tmp_path / "sharded"), W, cfg, n_shards=3)
    shard = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"][key]
    with pytest.raises(C.CheckpointError, match=f"^tensor {key} in {shard} holds NaN or inf$"):
        C.load_drafter(str(tmp_path / "sharded"), target.args)


def test_cache_overflow_and_setup_required(tmp_path, target):
    cfg, _ = make_ckpt(tmp_path, target.args)
    d = C.load_drafter(str(tmp_path), target.args)
    blk, feats = torch.zeros(1, 4, 64), torch.zeros(1, 3, 128)
    with pytest.raises(RuntimeError, match="setup_cache"):
        d.cached_forward(blk, feats, *lens(1, 0, 3))
    with pytest.raises(RuntimeError, match="setup_cache"):
        d.append_context(feats, 0)
    d.setup_cache(1, 8)
    with pytest.raises(ValueError, match="overflow"):
        d.append_context(feats, 6)
