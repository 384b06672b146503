"""model.py against transformers' DeepseekV3 and against itself (absorbed == naive, cache == no cache).
Run: python -m pytest -q tests/test_model.py"""
import json

import pytest
import torch

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


@pytest.mark.parametrize("over", [{}, {"n_group": 4, "topk_group": 2, "n_routed_experts": 16, "num_experts_per_tok": 4},
                                  {"rope_scaling": None}])
def test_parity_with_transformers(tmp_path, over):
    cfg = tiny.text_config(**over)
    hf = hf_model(cfg, seed=1)
    hf.save_pretrained(tmp_path)
    saved = json.load(open(tmp_path / "config.json"))
    assert "rope_parameters" in saved          # transformers 5 spelling; our reader must accept it
    ours = M.Transformer(M.ModelArgs.from_config(tmp_path))
    M.load_checkpoint(ours, str(tmp_path))
    tokens = torch.randint(0, cfg["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    assert rel_err(got, ref) <= 1e-4


def test_yarn_softmax_scale_and_band():
    args = M.ModelArgs.from_config(tiny.text_config(qk_rope_head_dim=64, qk_nope_head_dim=128, rope_scaling=dict(
        type="yarn", factor=64.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
        mscale_all_dim=1.0)))
    mla = M.MLA(args)
    assert abs(mla.softmax_scale - 0.144680) < 1e-5           # kimi_k2.md §0, K2.6 numbers
    inv, af = M.rope_inv_freq(args)
    base = 1.0 / (50000.0 ** (torch.arange(0, 64, 2).float() / 64))
    assert torch.equal(inv[:8], base[:8]) and torch.allclose(inv[20:], base[20:] / 64) and af == 1.0
    assert not torch.allclose(inv[8:20], base[8:20]) and not torch.allclose(inv[8:20], base[8:20] / 64)


def _prefill_then_decode(model, tokens, split, absorb_prefill=None):
    model.setup_cache(tokens.shape[0], 64)
    outs = [model(tokens[:, :split], start_pos=0, absorb=absorb_prefill)]
    for t in range(split, tokens.shape[1]):
        outs.append(model(tokens[:, t:t + 1], start_pos=t))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("absorb_prefill", [False, True])
def test_cached_absorbed_equals_full_naive(absorb_prefill):
    model = tiny.random_model(tiny.text_config(), seed=2)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
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
        tree = model(ids, start_pos=7, positions=7 + depth.view(1, -1), tree_mask=mask.view(1, 6, 6))
        seq_a = model(torch.cat([prefix, root.view(1, 1), a.view(1, -1)], 1))[:, 7:]
        seq_b = model(torch.cat([prefix, root.view(1, 1), b.view(1, -1)], 1))[:, 7:]
    assert rel_err(tree[:, [0, 1, 2, 3]], seq_a) <= 1e-4
    assert rel_err(tree[:, [0, 4, 5]], seq_b) <= 1e-4
    # the mask's rows packed into int64 words (what the GPU tree search hands over) give the same logits, on the
    # absorbed path (taken as is) and on the naive one (unpacked)
    import kernels
    packed = kernels.tree_mask_bits(mask.view(1, 6, 6))                                          # [1, 6] int64
    assert torch.equal(kernels.tree_mask_unpack(packed), mask.view(1, 6, 6))
    with torch.no_grad():
        for absorb in (True, False):
            want = model(ids, start_pos=7, positions=7 + depth.view(1, -1), tree_mask=mask.view(1, 6, 6), absorb=absorb)
            got = model(ids, start_pos=7, positions=7 + depth.view(1, -1), tree_mask=packed, absorb=absorb)
            assert torch.equal(got, want), f"absorb={absorb}"


def test_hidden_layers_are_layer_outputs():
    model = tiny.random_model(tiny.text_config(), seed=4)
    tokens = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        logits, hid = model(tokens, hidden_layers=(0, 2))
        h = model.embed_tokens(tokens)
        cos, sin = M.rope_cos_sin(model.inv_freq, model.rope_attn_factor, torch.arange(9).view(1, -1), h.dtype)
        outs = []
        for layer in model.layers:
            h = layer(h, cos, sin, None, None, None, False)
            outs.append(h)
    assert hid.shape == (1, 9, 2 * 64)
    assert torch.allclose(hid, torch.cat([outs[0], outs[2]], -1), atol=1e-6)
    assert torch.allclose(logits, model(tokens), atol=1e-6)


GPU_KERNELS = ("rms_norm", "add_rms_norm", "rope", "silu_mul", "router_topk", "mla_latent_to_cache",
               "mla_tree_attention")


def fake_gpu_kernels(monkeypatch, checks=None) -> list:
    """Pretend the Triton kernels run here (kernels.use_triton -> True): each of GPU_KERNELS becomes its *_ref
    twin, after checks[name](*args) if given; returns the list of kernel names as they are called."""
    import kernels
    calls = []
    def fake(name):
        def run(*a, **k):
            calls.append(name)
            if checks and name in checks:
                checks[name](*a, **k)
            return getattr(kernels, name + "_ref")(*a, **k)
        return run
    monkeypatch.setattr(kernels, "use_triton", lambda device: True)
    for name in GPU_KERNELS:
        monkeypatch.setattr(kernels, name, fake(name))
    return calls


def test_glue_kernels_stay_out_of_autograd_and_autocast(monkeypatch):
    """The Triton glue kernels have no backward and want one dtype: with them "available" (faked), a forward under
    autograd (train.py) or autocast must use the PyTorch twins; they run under no_grad."""
    model = tiny.random_model(tiny.text_config(), seed=5)
    tokens = torch.randint(0, 96, (2, 7))
    model(tokens).float().pow(2).mean().backward()                                    # reference gradients
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    calls = fake_gpu_kernels(monkeypatch)
    model(tokens).float().pow(2).mean().backward()
    assert calls == []
    assert want.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if n in want:
            assert torch.equal(p.grad, want[n]), n
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    assert calls == []
    with torch.no_grad():
        model(tokens)
    assert {"rms_norm", "rope", "silu_mul", "router_topk"} <= set(calls)


def test_cached_batch_hands_the_cache_kernel_its_contract(monkeypatch):
    """A batch of rows at an int start_pos (train.py's greedy rollouts) gives the cache-write kernel contiguous
    int64 slots and one dtype, as its wrapper asserts on a GPU (slots were an expand()ed view, refused there)."""
    def latent_to_cache(kv, weight, eps, cos, sin, cache, slots):
        assert slots.dtype == torch.int64 and slots.shape == kv.shape[:2] and slots.is_contiguous()
        assert kv.dtype == weight.dtype == cache.dtype == cos.dtype and cos.is_contiguous() and sin.is_contiguous()
    model = tiny.random_model(tiny.text_config(), seed=6)
    model.setup_cache(2, 16)
    tokens = torch.randint(0, 96, (2, 6))
    with torch.no_grad():
        want = [model(tokens, start_pos=0, last_only=True), model(tokens[:, :1], start_pos=6)]
        calls = fake_gpu_kernels(monkeypatch, dict(mla_latent_to_cache=latent_to_cache))
        got = [model(tokens, start_pos=0, last_only=True), model(tokens[:, :1], start_pos=6)]
    assert calls.count("mla_latent_to_cache") == 2 * model.args.num_hidden_layers     # each call, each layer
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# K2.6 checkpoint layout, INT4, loader errors


def test_k26_int4_roundtrip(tmp_path):
    ref = tiny.write_k26(tmp_path, seed=5)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) == 3
    args = M.ModelArgs.from_config(tmp_path)
    assert args.nested and args.quant is not None and args.quant.group_size == 32
    model = M.Transformer(args)
    assert model.layers[1].mlp.experts.w13_packed.dtype == torch.int32     # packed in memory, never dequantized
    M.load_checkpoint(model, str(tmp_path))
    tokens = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        assert rel_err(model(tokens), ref(tokens)) <= 1e-4


def test_router_weight_is_fp32_in_a_bf16_model(tmp_path):
    """The router scores are fp32 (as in the reference); its weight is stored in fp32 even in a bf16 model, so
    the bf16 checkpoint tensor is upcast once at load, not on every step (the K2.6 router is 384 x 7168)."""
    tiny.write_k26(tmp_path, seed=5)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = M.Transformer(M.ModelArgs.from_config(tmp_path))
    finally:
        torch.set_default_dtype(torch.float32)
    M.load_checkpoint(model, str(tmp_path))
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
        model = M.Transformer(M.ModelArgs.from_config(tmp_path))
        M.load_checkpoint(model, str(tmp_path))

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
        with pytest.raises(M.CheckpointError) as e:
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
    with pytest.raises(M.CheckpointError, match=r"missing tensors \['layers.2.mlp.gate.weight'\]"):
        load()


def test_config_errors(tmp_path):
    for over, word in [({"scoring_func": "softmax"}, "scoring_func"), ({"topk_method": "greedy"}, "topk_method"),
                       ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type"),
                       ({"model_type": "llama"}, "model_type")]:
        with pytest.raises(ValueError, match=word):
            M.ModelArgs.from_config(tiny.text_config(**over))
    cfg = tiny.text_config()
    del cfg["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        M.ModelArgs.from_config(cfg)
    bad = M.k26_config(tiny.text_config())
    bad["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    bad["text_config"]["quantization_config"] = bad["quantization_config"]
    with pytest.raises(ValueError, match="symmetric"):
        M.ModelArgs.from_config(bad)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        M.ModelArgs.from_config(tmp_path)


def test_missing_shard_named(tmp_path):
    tiny.write_k26(tmp_path, seed=7)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    model = M.Transformer(M.ModelArgs.from_config(tmp_path))
    with pytest.raises(M.CheckpointError, match=victim.name):
        M.load_checkpoint(model, str(tmp_path))


def test_debug_reports_first_nonfinite_layer():
    model = tiny.random_model(tiny.text_config(), seed=8)
    with torch.no_grad():
        model.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")
        with pytest.raises(FloatingPointError, match="layer 1 output"):
            model(torch.randint(0, 96, (1, 5)), debug=True)


def test_share_rows_one_gemm_same_outputs():
    """q_a | kv_a and gate | up run as one GEMM over one weight tensor: the Linears' weights are views of it (names
    and in-place loading unchanged), the outputs match each Linear's own, training still reaches the parameters,
    and a parameter replaced behind its back is an error, not stale weights."""
    lin_a, lin_b = M.Linear(8, 5), M.Linear(8, 3, shard_dim=0)
    with torch.no_grad():
        lin_a.weight.normal_(), lin_b.weight.normal_()
    wa = lin_a.weight.detach().clone()
    w = M.share_rows(lin_a, lin_b)
    assert w.shape == (8, 8) and torch.equal(w[:5], wa) and lin_b.weight.shard_dim == 0
    with torch.no_grad():
        lin_b.weight.copy_(torch.randn(3, 8))            # as load_checkpoint writes: in place, so w sees it
    assert torch.equal(w[5:], lin_b.weight)
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        a, b = M.linear_rows(x, w, lin_a, lin_b)
        assert torch.allclose(a, lin_a(x), atol=1e-6) and torch.allclose(b, lin_b(x), atol=1e-6)
    a, b = M.linear_rows(x, w, lin_a, lin_b)            # autograd on: through each Linear
    (a.sum() + b.sum()).backward()
    assert lin_a.weight.grad is not None and lin_b.weight.grad is not None
    lin_b.weight = torch.nn.Parameter(torch.randn(3, 8))
    with torch.no_grad(), pytest.raises(RuntimeError, match="share_rows"):
        M.linear_rows(x, w, lin_a, lin_b)


def test_share_rows_survives_to():
    """A model moved or cast after it was built (`.to()`, as tests and users do with `.cuda()`) shares its rows
    again: the same outputs as before the move, through one GEMM over a tensor its weights live in."""
    model = M.Transformer(M.ModelArgs.from_config(tiny.text_config()))
    tiny.randomize_(model, seed=1)
    tokens = torch.tensor([[3, 5, 7, 11]])
    with torch.no_grad():
        before = model(tokens).double()
        model.to(torch.float64)
        after = model(tokens)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.q_kv_a_weight.dtype == torch.float64 and torch.allclose(after.double(), before, atol=1e-4)
    assert attn.q_a_proj.weight.data_ptr() == attn.q_kv_a_weight.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up_weight[mlp.gate_proj.weight.shape[0]].data_ptr()
