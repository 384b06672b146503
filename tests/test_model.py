"""model.py against transformers' DeepseekV3 and against itself (absorbed == naive, cache == no cache); its ops
with a fast path keep the names and signatures kernels.py registers under and all go through the one switch;
checkpoint.py's loader and config errors (a bad tensor, a NaN weight, a missing directory are named).
Run: python -m pytest -q tests/test_model.py"""
import dataclasses
import functools
import json
import types

import pytest
import torch

import checkpoint as C
import kernels
import model as M
import tiny

torch.set_default_dtype(torch.float32)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_model(cfg, seed=0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    hcfg = DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    hf = DeepseekV3ForCausalLM(hcfg).eval()
    tiny.randomize_(hf, seed)
    return hf


@pytest.mark.quick
@pytest.mark.parametrize("over", [{}, {"n_group": 4, "topk_group": 2, "n_routed_experts": 16, "num_experts_per_tok": 4},
                                  {"rope_scaling": None}])
def test_parity_with_transformers(tmp_path, over):
    cfg = tiny.text_config(**over)
    hf = hf_model(cfg, seed=1)
    hf.save_pretrained(tmp_path)
    saved = json.load(open(tmp_path / "config.json"))
    assert "rope_parameters" in saved          # transformers 5 spelling; our reader must accept it
    ours = M.Transformer(C.model_args(tmp_path))
    C.load_checkpoint(ours, str(tmp_path))
    tokens = torch.randint(0, cfg["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens).logits
    assert rel_err(got, ref) <= 1e-4


def test_yarn_softmax_scale_and_band():
    args = C.model_args(tiny.text_config(qk_rope_head_dim=64, qk_nope_head_dim=128, rope_scaling=dict(
        type="yarn", factor=64.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
        mscale_all_dim=1.0)))
    mla = M.MLA(args)
    assert abs(mla.softmax_scale - 0.144680) < 1e-5           # K2.6: 192-dim heads, YaRN factor 64
    inv, af = M.rope_inv_freq(args)
    base = 1.0 / (50000.0 ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.equal(inv[:8], base[:8]) and torch.allclose(inv[20:], base[20:] / 64) and af == 1.0
    assert not torch.allclose(inv[8:20], base[8:20]) and not torch.allclose(inv[8:20], base[8:20] / 64)


@pytest.mark.parametrize("dim, factor, L0, truncate", [
    (64, 64.0, 4096, True), (128, 64.0, 4096, True), (24, 3.0, 256, True), (16, 40.0, 32, False)])
@pytest.mark.parametrize("mscales", [(1.0, 1.0), (1.0, 0.707), (None, None)])
def test_rope_inv_freq_is_transformers_yarn_bit_for_bit(dim, factor, L0, truncate, mscales):
    """The one YaRN (the target's; over its head_dim, with truncate and legacy_amplitude, the
    drafter's) == transformers' own frequencies and amplitude, bit for bit. legacy_amplitude
    ignores mscale / mscale_all_dim: transformers' amplitude without them."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = dict(rope_type="yarn", factor=factor, original_max_position_embeddings=L0,
                beta_fast=32.0, beta_slow=1.0, truncate=truncate)
    ms = dict(mscale=mscales[0], mscale_all_dim=mscales[1])
    hf = lambda **extra: ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config(
        head_dim=dim, hidden_size=64, num_attention_heads=4, rope_theta=50000.0,
        max_position_embeddings=int(factor * L0), rope_scaling=dict(rope, **extra)), "cpu")
    args = dataclasses.replace(C.model_args(tiny.text_config()), rope_theta=50000.0,
                               rope_factor=factor, original_max_position_embeddings=L0, **ms)
    ref_inv, ref_af = hf(**ms) if mscales[0] else hf()
    inv, af = M.rope_inv_freq(args, dim, truncate)
    assert torch.equal(inv, ref_inv.float()) and af == ref_af
    inv, af = M.rope_inv_freq(args, dim, truncate, legacy_amplitude=True)
    assert torch.equal(inv, ref_inv.float()) and af == hf()[1]


def _prefill_then_decode(model, tokens, split, absorb_prefill=None):
    model.setup_cache(tokens.shape[0], 64)
    outs = [model(tokens[:, :split], start_pos=0, absorb=absorb_prefill).logits]
    for t in range(split, tokens.shape[1]):
        outs.append(model(tokens[:, t:t + 1], start_pos=t).logits)
    return torch.cat(outs, dim=1)


@pytest.mark.quick
@pytest.mark.parametrize("absorb_prefill", [False, True])
def test_cached_absorbed_equals_full_naive(absorb_prefill):
    model = tiny.random_model(tiny.text_config(), seed=2)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens).logits
        inc = _prefill_then_decode(model, tokens, 10, absorb_prefill)
    assert rel_err(inc, full) <= 1e-4


def test_tree_mask_and_positions_match_branches():
    """Two branches verified in one forward (ancestor mask, positions = start + depth) give each branch's
    logits as if it had been decoded alone."""
    model = tiny.random_model(tiny.text_config(), seed=3)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 96, (1, 7), generator=g)
    a, b = torch.randint(0, 96, (3,), generator=g), torch.randint(0, 96, (2,), generator=g)
    # tree: root r (node 0), branch a = nodes 1,2,3 (chain), branch b = nodes 4,5 (children of root)
    root = torch.tensor([5])
    ids = torch.cat([root, a, b]).view(1, -1)
    parents = [-1, 0, 1, 2, 0, 4]
    depth = torch.tensor([0, 1, 2, 3, 1, 2])
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    with torch.no_grad():
        model.setup_cache(1, 32)
        model(prefix, start_pos=7 - 7)
        tree = model(ids, start_pos=7, positions=7 + depth.view(1, -1), tree_mask=mask.view(1, 6, 6)).logits
        seq_a = model(torch.cat([prefix, root.view(1, 1), a.view(1, -1)], 1)).logits[:, 7:]
        seq_b = model(torch.cat([prefix, root.view(1, 1), b.view(1, -1)], 1)).logits[:, 7:]
    assert rel_err(tree[:, [0, 1, 2, 3]], seq_a) <= 1e-4
    assert rel_err(tree[:, [0, 4, 5]], seq_b) <= 1e-4


def test_cache_misuse_is_one_clear_error():
    """A cached forward before setup_cache, one past the cache's end, and a tensor start_pos on the naive path (which
    slices the cache by an int) each raise one error that says what was wrong."""
    model = tiny.random_model(tiny.text_config(), seed=5)
    tokens = torch.randint(0, 96, (1, 4))
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"cache overflow: 0 slots \(setup_cache\)"):
            model(tokens, start_pos=0)
        model.setup_cache(1, 8)
        with pytest.raises(ValueError, match="cache overflow: 8 slots"):
            model(tokens, start_pos=5)
        with pytest.raises(ValueError, match="naive MLA path needs an int start_pos"):
            model(tokens, start_pos=torch.tensor([0]), absorb=False)
        assert model(tokens, start_pos=4).logits.shape == (1, 4, 96)          # exactly full: fine


def test_hidden_layers_are_layer_outputs():
    model = tiny.random_model(tiny.text_config(), seed=4)
    tokens = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        logits, hid = model(tokens, hidden_layers=(0, 2))
        h = model.embed_tokens(tokens)
        cos, sin = M.rope_cos_sin(model.inv_freq, model.rope_attn_factor, torch.arange(9).view(1, -1), h.dtype)
        causal = torch.ones(1, 9, 9, dtype=torch.bool).tril()                     # [1, T, T]
        outs = []
        for layer in model.layers:
            h = layer(h, cos, sin, None, None, causal, False)
            outs.append(h)
    assert hid.shape == (1, 9, 2 * 64)
    assert torch.allclose(hid, torch.cat([outs[0], outs[2]], -1), atol=1e-6)
    assert torch.allclose(logits, model(tokens).logits, atol=1e-6)


# The ops and parts with a fast path, as the switch in kernels.py knows them: name -> the reference's parameters
CONTRACT = {
    "linear": "x weight", "rms_norm": "x weight eps", "rope": "x cos sin interleaved",
    "mla_latent_to_cache": "kv weight eps cos sin cache slots",
    "mla_attention": "q_lat q_pe cache prefix_len tree_mask softmax_scale",
    # the parts: a block stack, attention, MLP and MoE method with one launcher each
    "Transformer.blocks": "self h cos sin caches start_pos tree_mask absorb slots hidden_layers debug",
    "MLA.attend": "self x cos sin cache start_pos tree_mask absorb slots",
    "MLP.forward": "self x",
    "Gate.forward": "self x", "MoE.local": "self x", "Experts.forward": "self x weights ids",
}


def fast_op(name: str):
    """model.py's op (or block part's method, "MoE.local") registered under `name`."""
    return functools.reduce(getattr, name.split("."), M)


def test_fast_ops_keep_the_contract():
    """Each op with a Triton twin is a plain function here (or a block part's method), under its name, with the
    signature kernels.py registers the kernel under; op.ref is the PyTorch reference."""
    import inspect
    for name, params in CONTRACT.items():
        op = fast_op(name)
        assert op.__qualname__ == name and callable(op.ref), name
        assert " ".join(inspect.signature(op.ref).parameters) == params, name


def fake_kernels(monkeypatch, checks=None) -> list:
    """Register a stand-in "kernel" for every op of CONTRACT that always fits: it records its name, runs
    checks[name](*args) if given, then the reference. Returns the list of names as they are called."""
    calls = []
    monkeypatch.setattr(kernels, "_KERNELS", {})
    monkeypatch.setattr(kernels, "ENABLED", True)

    def stand_in(name):
        def run(*a, **k):
            calls.append(name)
            if checks and name in checks:
                checks[name](*a, **k)
            return fast_op(name).ref(*a, **k)
        return run
    for name in CONTRACT:
        kernels.register(name, fits=lambda *a, **k: True)(stand_in(name))
    return calls


def test_every_op_goes_through_the_switch(tmp_path, monkeypatch):
    """The layers call each op by its plain name, so one switch (kernels.ENABLED and the kernel's fits) decides
    for all of them: a cached INT4 forward reaches every op of the contract, and gives the same logits."""
    ref = tiny.write_k26(tmp_path, seed=9)
    model = M.Transformer(C.model_args(tmp_path))
    C.load_checkpoint(model, str(tmp_path))
    tokens = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(kernels, "_HOST", {})          # want: the references as written, on the whole cache
    with torch.no_grad():
        model.setup_cache(2, 16)
        want = model(tokens, start_pos=0).logits
        calls = fake_kernels(monkeypatch)
        got = model(tokens, start_pos=0).logits
    assert set(calls) == set(CONTRACT), set(CONTRACT) - set(calls)
    assert torch.equal(got, want) and rel_err(got, ref(tokens).logits) <= 1e-4
    monkeypatch.setattr(kernels, "ENABLED", False)     # --no-triton: the references only
    calls.clear()
    with torch.no_grad():
        assert torch.equal(model(tokens, start_pos=0).logits, want)
    assert calls == []


def test_cached_batch_hands_the_cache_kernel_its_contract(monkeypatch):
    """A batch of rows at an int start_pos (train.py's greedy rollouts) gives the cache-write kernel contiguous
    int64 slots and one dtype, as its launcher requires on a GPU."""
    def latent_to_cache(kv, weight, eps, cos, sin, cache, slots):
        assert slots.dtype == torch.int64 and slots.shape == kv.shape[:2] and slots.is_contiguous()
        assert kv.dtype == weight.dtype == cache.dtype == cos.dtype and cos.is_contiguous() and sin.is_contiguous()
    model = tiny.random_model(tiny.text_config(), seed=6)
    model.setup_cache(2, 16)
    tokens = torch.randint(0, 96, (2, 6))
    with torch.no_grad():
        want = [model(tokens, start_pos=0, last_only=True), model(tokens[:, :1], start_pos=6)]
        calls = fake_kernels(monkeypatch, dict(mla_latent_to_cache=latent_to_cache))
        got = [model(tokens, start_pos=0, last_only=True), model(tokens[:, :1], start_pos=6)]
    assert calls.count("mla_latent_to_cache") == 2 * model.args.num_hidden_layers     # each call, each layer
    for g, w in zip(got, want):
        assert torch.allclose(g.logits, w.logits, atol=1e-5)


def test_int4_experts_equal_float_experts_on_the_dequantized_weights():
    """The INT4 reference dequantizes only the used experts, one at a time, and gives the float experts' result on
    the dequantized weights."""
    g = torch.Generator().manual_seed(0)
    E, D, I, T, k = 6, 64, 32, 5, 2
    q13, q2 = torch.randint(-8, 8, (E, 2 * I, D), generator=g), torch.randint(-8, 8, (E, D, I), generator=g)
    s13, s2 = torch.rand(E, 2 * I, D // 32, generator=g) / 8, torch.rand(E, D, I // 32, generator=g) / 8
    w13p, w2p = C.pack_int4(q13.to(torch.int8)), C.pack_int4(q2.to(torch.int8))
    assert torch.equal(M.unpack_int4(w13p), q13.to(torch.int8))
    x = torch.randn(T, D, generator=g)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [3, 0], [5, 3]])                     # experts 1, 2, 4 unused
    w = torch.rand(T, k, generator=g)
    w13, w2 = M.dequant_int4(w13p, s13), M.dequant_int4(w2p, s2)
    floats = types.SimpleNamespace(expert=lambda e: (w13[e], w2[e]))          # what the loop reads of self
    want = M.Experts.forward.ref(floats, x, w, ids)
    dequantized = []
    experts = C.int4_experts(w13p, s13, w2p, s2)
    expert = experts.expert
    experts.expert = lambda e: dequantized.append(e) or expert(e)
    got = M.Experts.forward.ref(experts, x, w, ids)
    assert dequantized == [0, 3, 5] and torch.allclose(got, want, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# K2.6 checkpoint layout, INT4, loader errors


def test_k26_int4_roundtrip(tmp_path):
    ref = tiny.write_k26(tmp_path, seed=5)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) == 3
    args = C.model_args(tmp_path)
    assert args.nested and args.quant is not None and args.quant.group_size == 32
    model = M.Transformer(args)
    assert model.layers[1].mlp.experts.w13_packed.dtype == torch.int32     # packed in memory, never dequantized
    C.load_checkpoint(model, str(tmp_path))
    tokens = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        assert rel_err(model(tokens).logits, ref(tokens).logits) <= 1e-4


def test_router_weight_is_fp32_in_a_bf16_model(tmp_path):
    """The router scores are fp32 (as in the reference); its weight is stored in fp32 even in a bf16 model, so
    the bf16 checkpoint tensor is upcast once at load, not on every step (the K2.6 router is 384 x 7168)."""
    tiny.write_k26(tmp_path, seed=5)
    model = C.build(lambda: M.Transformer(C.model_args(tmp_path)), "cpu", torch.bfloat16)
    C.load_checkpoint(model, str(tmp_path))
    gate = model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32 and model.layers[1].self_attn.o_proj.weight.dtype == torch.bfloat16
    from safetensors import safe_open
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    name = next(k for k in index["weight_map"] if k.endswith("layers.1.mlp.gate.weight"))
    with safe_open(tmp_path / index["weight_map"][name], "pt") as f:
        stored = f.get_tensor(name)
    assert torch.equal(gate.weight, stored.float())          # the checkpoint's values, not rounded to bf16
    x = torch.randn(3, gate.weight.shape[1], dtype=torch.bfloat16)
    w, ids = gate(x)
    assert w.dtype == torch.float32 and ids.shape == (3, model.args.num_experts_per_tok)


def _corrupt(tmp_path, fn):
    """Rewrite the shard holding the tensor that fn selects."""
    from safetensors.torch import load_file, save_file
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    name = fn(index["weight_map"])
    fname = index["weight_map"][name]
    tensors = load_file(tmp_path / fname)
    return name, fname, tensors, lambda t: save_file(t, tmp_path / fname)


def test_loader_errors(tmp_path):
    tiny.write_k26(tmp_path, seed=6)

    def load():
        model = M.Transformer(C.model_args(tmp_path))
        C.load_checkpoint(model, str(tmp_path))

    pick = lambda k: lambda wm: next(n for n in wm if n.endswith(k))
    cases = [
        ("layers.0.self_attn.q_a_proj.weight", lambda t, n: t.pop(n), "does not hold"),
        ("layers.0.self_attn.kv_b_proj.weight", lambda t, n: t.__setitem__(n, t[n][:, :-1].contiguous()), "shape"),
        ("layers.0.input_layernorm.weight", lambda t, n: t.__setitem__(n, t[n].to(torch.int32)), "dtype"),
        ("experts.3.up_proj.weight_scale", lambda t, n: t.pop(n), "does not hold"),
        ("experts.2.down_proj.weight_packed", lambda t, n: t.__setitem__(n, t[n][:, :-1].contiguous()), "int32 words"),
        ("experts.2.gate_proj.weight_shape", lambda t, n: t.__setitem__(n, torch.tensor([5, 5], dtype=torch.int32)),
         "weight_shape"),
    ]
    for suffix, change, word in cases:
        name, fname, tensors, save = _corrupt(tmp_path, pick(suffix))
        backup = dict(tensors)
        change(tensors, name)
        save(tensors)
        with pytest.raises(C.CheckpointError) as e:
            load()
        msg = str(e.value)
        assert word in msg and suffix.split(".")[-2] in msg, msg
        save(backup)
    load()   # restored: loads again
    # a tensor absent from both the index and the shards is reported as missing
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    name = next(n for n in index["weight_map"] if n.endswith("layers.2.mlp.gate.weight"))
    _, _, tensors, save = _corrupt(tmp_path, lambda wm: name)
    tensors.pop(name)
    save(tensors)
    del index["weight_map"][name]
    json.dump(index, open(tmp_path / "model.safetensors.index.json", "w"))
    with pytest.raises(C.CheckpointError, match=r"missing tensors \['layers.2.mlp.gate.weight'\]"):
        load()


def test_config_errors(tmp_path):
    for over, word in [({"scoring_func": "softmax"}, "scoring_func"), ({"topk_method": "greedy"}, "topk_method"),
                       ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
                       ({"model_type": "llama"}, "model_type")]:
        with pytest.raises(ValueError, match=word):
            C.model_args(tiny.text_config(**over))
    cfg = tiny.text_config()
    del cfg["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        C.model_args(cfg)
    bad = C.k26_config(tiny.text_config())
    bad["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    bad["text_config"]["quantization_config"] = bad["quantization_config"]
    with pytest.raises(ValueError, match="symmetric"):
        C.model_args(bad)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        C.model_args(tmp_path)


def test_missing_shard_named(tmp_path):
    tiny.write_k26(tmp_path, seed=7)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    model = M.Transformer(C.model_args(tmp_path))
    with pytest.raises(C.CheckpointError, match=victim.name):
        C.load_checkpoint(model, str(tmp_path))


def test_nonfinite_weights_named_at_load(tmp_path):
    """A NaN or inf in any floating tensor (a float weight, an INT4 expert's scale) is an error naming the tensor
    and its shard, unless the check is turned off."""
    tiny.write_k26(tmp_path, seed=10)
    for suffix, value in [("layers.0.self_attn.kv_b_proj.weight", float("nan")),
                          ("layers.2.mlp.experts.5.down_proj.weight_scale", float("inf"))]:
        name, fname, tensors, save = _corrupt(tmp_path, lambda wm: next(n for n in wm if n.endswith(suffix)))
        backup = tensors[name].clone()
        tensors[name].view(-1)[3] = value
        save(tensors)
        model = M.Transformer(C.model_args(tmp_path))
        with pytest.raises(C.CheckpointError, match=f"tensor {name} in {fname} holds NaN or inf"):
            C.load_checkpoint(model, str(tmp_path))
        C.load_checkpoint(model, str(tmp_path), check_finite=False)      # loads as it is when asked
        tensors[name] = backup
        save(tensors)
    C.load_checkpoint(model, str(tmp_path))


def test_missing_checkpoint_directory_named(tmp_path):
    """A checkpoint path that does not exist is named as such before anything tries to read from it."""
    missing = str(tmp_path / "no" / "such" / "ckpt")
    for read in (lambda: C.model_args(missing), lambda: C.load_checkpoint(None, missing)):
        with pytest.raises(FileNotFoundError, match=f"^checkpoint directory not found: {missing}$"):
            read()


def test_debug_reports_first_nonfinite_layer():
    model = tiny.random_model(tiny.text_config(), seed=8)
    with torch.no_grad():
        model.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")
        with pytest.raises(FloatingPointError, match="layer 1 output"):
            model(torch.randint(0, 96, (1, 5)), debug=True)


def test_stacked_linears_hold_each_rank_slice_of_each_tensor(tmp_path):
    """q_a | kv_a and gate | up are one parameter each (one GEMM), filled at load from the checkpoint's own tensors:
    replicated ones stacked whole, column-parallel ones as this rank's slice of each in turn; checkpoint_tensors
    (hf_state_dict) splits them back under the checkpoint's names."""
    ref = tiny.write_k26(tmp_path, tiny.text_config(moe_intermediate_size=64), seed=3)   # TP2 splits the INT4 groups
    W = C.hf_state_dict(ref)
    p = "model.layers.1."
    assert p + "self_attn.q_a_proj.weight" in W and not any(k.endswith(("qkv_a_proj.weight", "gate_up_proj.weight"))
                                                            for k in W)
    try:
        M.set_tp(2, 1)                                   # rank 1 of 2, no process group: only the loader runs
        model = M.Transformer(C.model_args(str(tmp_path)))
        C.load_checkpoint(model, str(tmp_path))
    finally:
        M.set_tp(1, 0)
    layer = model.layers[1]
    assert torch.equal(layer.self_attn.qkv_a_proj.weight, torch.cat([W[p + "self_attn.q_a_proj.weight"],
                                                                     W[p + "self_attn.kv_a_proj_with_mqa.weight"]]))
    gate, up = W[p + "mlp.shared_experts.gate_proj.weight"], W[p + "mlp.shared_experts.up_proj.weight"]
    n = gate.shape[0] // 2
    assert torch.equal(layer.mlp.shared_experts.gate_up_proj.weight, torch.cat([gate[n:], up[n:]]))
    x = torch.randn(2, 3, ref.args.hidden_size)
    attn = ref.layers[1].self_attn
    with torch.no_grad():                                # the one GEMM == the two checkpoint tensors on their own
        q_a, kv = attn.qkv_a_proj(x).split([attn.q_lora_rank, attn.kv_lora_rank + attn.rope_dim], -1)
    torch.testing.assert_close(q_a, x @ W[p + "self_attn.q_a_proj.weight"].T)
    torch.testing.assert_close(kv, x @ W[p + "self_attn.kv_a_proj_with_mqa.weight"].T)
