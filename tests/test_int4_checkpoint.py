"""INT4 pack-quantized checkpoints against compressed-tensors itself (the library that defines the format):
a checkpoint written by compressed-tensors loads in our engine and runs like transformers on the weights that
compressed-tensors decompresses; our writer and compressed-tensors produce the same words; loading a multi-shard
checkpoint keeps host memory near one rank's share; malformed checkpoints give errors that name the tensor or file.
Run: python -m pytest -q tests/test_int4_checkpoint.py"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import checkpoint as C
import model as M
import tiny

torch.set_default_dtype(torch.float32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The quantization_config as the K2.5 checkpoint ships it (status "initialized" until compressed-tensors compresses).
KIMI_QCFG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "initialized",
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "actorder": None,
                                              "block_structure": None, "observer": "minmax"},
                                  "input_activations": None, "output_activations": None}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None}



EXPERT_MODULE = re.compile(r"(.*\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def cfg_tiny(**over):
    # moe_intermediate_size 64: down_proj has two groups of 32 per row (the tiny default, 32, has one)
    return tiny.text_config(**{"moe_intermediate_size": 64, **over})


def hf_model(cfg, seed):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "model_type"})).eval()
    tiny.randomize_(hf, seed)
    return hf


def write_shards(tensors: dict, out_dir, n_shards: int) -> None:
    """HF sharded safetensors + model.safetensors.index.json (K2.6: 6-digit total)."""
    names = sorted(tensors)
    weight_map, total = {}, 0
    for k in range(n_shards):
        fname = f"model-{k + 1:05d}-of-{n_shards:06d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[k::n_shards]}
        save_file(part, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def read_all(ckpt_dir) -> dict:
    index = json.load(open(os.path.join(ckpt_dir, "model.safetensors.index.json")))
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        out.update(load_file(os.path.join(ckpt_dir, fname)))
    return out


def ct_checkpoint(hf, out_dir, nested: bool, dtype=torch.float32, weights: dict | None = None,
                  n_shards: int = 3) -> dict:
    """Quantize the routed experts of transformers model `hf` with compressed-tensors' own lifecycle and write
    the checkpoint the way a real one is laid out. Returns the config.json written.

    transformers 5 fuses the experts into 3D parameters, which compressed-tensors does not see as Linear
    modules; save_pretrained writes them per expert (`mlp.experts.E.gate_proj.weight`, the real checkpoint
    names), so we rebuild the module tree from those tensors with real nn.Linear modules wherever the checkpoint
    has a Linear (transformers' own Linear modules + the per-expert projections) and plain parameters elsewhere
    (norms, embedding, router). compressed-tensors then matches targets/ignore on that tree exactly as
    llm-compressor does on a Linear-per-expert model: apply_quantization_config -> scales from the weights
    (compute_dynamic_scales_and_zp: its min/max over each group of 32 + calculate_qparams) ->
    ModelCompressor.compress_model (PackedQuantizationCompressor) -> ModelCompressor.update_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp, is_module_quantized
    os.makedirs(out_dir, exist_ok=True)
    src = os.path.join(out_dir, "_hf")
    hf.save_pretrained(src)
    state = load_file(os.path.join(src, "model.safetensors"))
    hf_cfg = json.load(open(os.path.join(src, "config.json")))
    linear = {n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}

    root = torch.nn.Module()

    def module(path):
        m = root
        for part in filter(None, path.split(".")):
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        return m

    n_expert_linears = 0
    for name, t in state.items():
        t = t.to(dtype) if t.dtype.is_floating_point and "e_score_correction_bias" not in name else t
        mod, _, pname = name.rpartition(".")
        if pname == "weight" and (mod in linear or EXPERT_MODULE.fullmatch(mod)):
            n_expert_linears += bool(EXPERT_MODULE.fullmatch(mod))
            parent, _, leaf = mod.rpartition(".")
            lin = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=t.dtype)
            lin.weight.data = t.clone()
            module(parent).add_module(leaf, lin)
        else:
            module(mod).register_parameter(pname, torch.nn.Parameter(t.clone(), requires_grad=False))
    assert n_expert_linears > 0

    qdict = json.loads(json.dumps(KIMI_QCFG))
    qdict["config_groups"]["group_0"]["weights"].update(weights or {})
    apply_quantization_config(root, QuantizationConfig.model_validate(qdict), show_progress=False)
    quantized = [(n, m) for n, m in root.named_modules() if is_module_quantized(m)]
    # the Kimi ignore list leaves exactly the routed experts
    assert sorted(n for n, _ in quantized) == sorted(
        n for n, _ in root.named_modules() if EXPERT_MODULE.fullmatch(n)) and len(quantized) == n_expert_linears
    with torch.no_grad():
        for _, m in quantized:
            scale, zp = compute_dynamic_scales_and_zp(m.weight, m.quantization_scheme.weights, m)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            m.weight_zero_point.copy_(zp.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(root, "pack-quantized")
    compressor.compress_model(root)
    tensors = {k: v.detach() for k, v in root.state_dict().items()}

    cfg_path = os.path.join(out_dir, "config.json")
    json.dump(hf_cfg, open(cfg_path, "w"))
    compressor.update_config(out_dir)                     # compressed-tensors writes quantization_config
    config = json.load(open(cfg_path))
    if nested:   # K2.5/K2.6: kimi_k25 wrapper, text model under language_model., config repeated in text_config
        q = config.pop("quantization_config")
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                  "text_config": {**config, "model_type": "kimi_k2", "quantization_config": q},
                  "vision_config": {"patch_size": 14}, "quantization_config": q, "tie_word_embeddings": False}
        json.dump(config, open(cfg_path, "w"), indent=2)
        tensors = {"language_model." + k: v for k, v in tensors.items()}
        tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2).to(torch.bfloat16)
    write_shards(tensors, out_dir, n_shards)
    return config


def ct_decompressed_hf(ckpt_dir, work_dir):
    """A transformers model holding the weights compressed-tensors decompresses from `ckpt_dir`
    (its CompressedTensorsDequantizer: reads config.json, PackedQuantizationCompressor.decompress per module)."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from transformers import DeepseekV3ForCausalLM
    deq = CompressedTensorsDequantizer(str(ckpt_dir), dtype=torch.float32).process(read_all(ckpt_dir))
    assert not any(n.endswith(("weight_packed", "weight_scale", "weight_shape")) for n in deq)
    deq = {n.removeprefix("language_model."): t for n, t in deq.items() if not n.startswith("vision_tower.")}
    os.makedirs(work_dir, exist_ok=True)
    save_file({n: t.contiguous() for n, t in deq.items()}, os.path.join(work_dir, "model.safetensors"),
              metadata={"format": "pt"})
    json.dump(json.load(open(os.path.join(ckpt_dir, "_hf", "config.json"))),
              open(os.path.join(work_dir, "config.json"), "w"))
    return DeepseekV3ForCausalLM.from_pretrained(work_dir, dtype=torch.float32).eval(), deq


# ---------------------------------------------------------------------------------------------------------------
# 1. A checkpoint written by compressed-tensors loads in our engine


@pytest.mark.parametrize("nested", [False, True], ids=["k2-thinking-flat", "k26-nested"])
def test_compressed_tensors_checkpoint_loads(tmp_path, nested):
    cfg = cfg_tiny()
    hf = hf_model(cfg, seed=11)
    ckpt = tmp_path / "ct"
    written = ct_checkpoint(hf, ckpt, nested)
    q = written["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    assert q["quantization_status"] == "compressed"
    w = q["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["symmetric"], w["strategy"], w["group_size"]) == (4, True, "group", 32)
    tensors = read_all(ckpt)
    P = "language_model.model." if nested else "model."
    packed = tensors[P + "layers.1.mlp.experts.3.down_proj.weight_packed"]
    assert packed.dtype == torch.int32 and packed.shape == (64, 64 // 8)
    assert tensors[P + "layers.1.mlp.experts.3.down_proj.weight_scale"].shape == (64, 2)
    assert tensors[P + "layers.2.mlp.experts.0.gate_proj.weight_shape"].tolist() == [64, 64]
    assert not any(n.endswith("weight_packed") for n in tensors if ".experts." not in n)   # the rest stays float
    # compressed-tensors' minmax grid (scale = absmax / 7.5) uses -8, which Kimi's QAT grid (absmax / 7) never does
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    assert any((unpack_from_int32(t, 4, torch.Size(tensors[n[:-6] + "shape"].tolist())) == -8).any()
               for n, t in tensors.items() if n.endswith("weight_packed"))

    args = C.model_args(ckpt)                  # reads compressed-tensors' own quantization_config
    assert args.quant is not None and args.quant.group_size == 32 and args.nested == nested
    ours = M.Transformer(args)
    C.load_checkpoint(ours, str(ckpt))

    ref, deq = ct_decompressed_hf(ckpt, tmp_path / "deq")
    # the decompressed experts are on compressed-tensors' INT4 grid, not the original float weights
    orig = load_file(ckpt / "_hf" / "model.safetensors")
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    assert not torch.equal(deq[name], orig[name]) and rel_err(deq[name], orig[name]) < 0.2
    tokens = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(tokens).logits
        got = ours(tokens).logits
    assert rel_err(got, want) <= 1e-4, rel_err(got, want)


# ---------------------------------------------------------------------------------------------------------------
# 2. Our writer and compressed-tensors agree bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_our_writer_matches_compressed_tensors(tmp_path, dtype):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    cfg = cfg_tiny()
    hf = hf_model(cfg, seed=12)
    ct_dir, our_dir = tmp_path / "ct", tmp_path / "ours"
    ct_checkpoint(hf, ct_dir, nested=True, dtype=dtype)
    ct = read_all(ct_dir)
    state, n_experts = {}, 0
    for name, t in ct.items():
        if not name.startswith("language_model."):
            continue
        name = name.removeprefix("language_model.")
        if name.endswith(("weight_scale", "weight_shape")):
            continue
        if name.endswith("weight_packed"):
            base = name[:-len("weight_packed")]
            shape = ct["language_model." + base + "weight_shape"]
            q = unpack_from_int32(t, 4, torch.Size(shape.tolist()))       # compressed-tensors' own unpack
            state[base + "weight"] = (q, ct["language_model." + base + "weight_scale"])
            n_experts += 1
        else:
            state[name] = t
    assert n_experts == 2 * 8 * 3
    C.save_checkpoint(state, C.k26_config(cfg), str(our_dir), n_shards=4)

    ours = read_all(our_dir)
    for name, t in ct.items():
        if ".experts." in name:
            assert name in ours, name
            if name.endswith("weight_shape"):
                assert ours[name].tolist() == t.tolist(), name
            else:
                assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name   # same int32 words
    models = []
    for d in (ct_dir, our_dir):
        m = M.Transformer(C.model_args(d))
        C.load_checkpoint(m, str(d))
        models.append(m)
    a, b = (dict(m.named_parameters()) for m in models)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------------------------------------
# 3. Host memory and bytes read while loading a multi-shard checkpoint (whole model and one TP=2 rank)

# ~57 MB, written in a few seconds: the bulk is the fp32 embedding / lm_head (row-split under TP) and the dense
# MLP (down_proj column-split, so a rank touches every page of it), plus INT4 experts (gate/up row-split, down
# column-split on the packed words).
BIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=2048, moe_intermediate_size=256,
           n_routed_experts=16, num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=4,
           q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
           num_hidden_layers=3)

# In a fresh process: build this rank's model, then load it. ru_maxrss (checkpoint.peak_rss_bytes) is inherited from
# the parent across fork/vfork + exec on Linux (a child's value starts at pytest's peak), so the growth is measured
# with the child's own high-water mark VmHWM (a fresh exec starts it afresh; reset to the current RSS before
# loading where /proc/self/clear_refs allows).
_MEASURE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import checkpoint as C
import model as M
ws, path = int(sys.argv[2]), sys.argv[3]
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
M.set_tp(ws, 0)
m = M.Transformer(C.model_args(path))
param_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
try:
    open("/proc/self/clear_refs", "w").write("5")       # VmHWM := current RSS (best effort)
except OSError:
    pass
before, peak_before, hwm_before = status("VmRSS"), C.peak_rss_bytes(), status("VmHWM")
stats = C.load_checkpoint(m, path)
print(json.dumps(dict(ws=ws, before=before, hwm_before=hwm_before, hwm=status("VmHWM"), peak_before=peak_before,
                      peak=C.peak_rss_bytes(), stats_peak=stats["peak_rss_bytes"], bytes_read=stats["bytes_read"],
                      param_bytes=param_bytes)))
"""


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("big")
    tiny.write_k26(path, tiny.text_config(**BIG), seed=13, n_shards=8)
    return path


def _ckpt_bytes(path):
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _measure(path, ws):
    """Build rank 0 of a TP=ws model in a fresh process and load it: host-memory figures."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, ROOT, str(ws), str(path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_load_peak_host_memory(big_ckpt):
    total = _ckpt_bytes(big_ckpt)
    assert total >= 40e6, total                       # big enough that RSS noise (a few MB) does not matter
    for ws in (1, 2):
        s = _measure(big_ckpt, ws)
        assert s["hwm_before"] <= s["before"] + 4e6, s
        growth = s["hwm"] - s["before"]
        # growth = the parameters' own pages (torch.empty leaves them untouched until loaded) + at most one
        # shard's mapped pages and one tensor's slice temporaries; never a second copy of the model
        assert growth <= 1.5 * s["param_bytes"], (s, total)
        # checkpoint.peak_rss_bytes() agrees whenever the parent's peak does not mask it (see _MEASURE); read
        # inside and after the load it can differ by the pages freed in between: Linux reports VmHWM as the larger
        # of the current RSS and a high-water mark it records only at unmap
        assert s["peak"] >= s["hwm"] - 4e6 and abs(s["stats_peak"] - s["peak"]) <= 4e6, s
        if s["peak_before"] <= s["before"] + 4e6:
            assert s["peak"] - s["before"] <= 1.5 * s["param_bytes"], s
        if ws == 2:
            assert s["bytes_read"] <= 0.6 * total, s
            # one rank never holds the whole checkpoint: 2 ranks together stay well below 2 x checkpoint
            assert 2 * growth <= 1.5 * total, (s, total)


def test_tp2_reads_half(big_ckpt):
    index = json.load(open(big_ckpt / "model.safetensors.index.json"))
    skipped = 0
    for fname in set(index["weight_map"].values()):
        with safe_open(str(big_ckpt / fname), "pt") as f:
            for n in f.keys():
                if n.startswith(("vision_tower.", "mm_projector.")) or n.endswith("weight_shape"):
                    t = f.get_tensor(n)
                    skipped += t.numel() * t.element_size()
    full_model = M.Transformer(C.model_args(big_ckpt))
    full = C.load_checkpoint(full_model, str(big_ckpt))["bytes_read"]
    assert full == index["metadata"]["total_size"] - skipped          # every text tensor read once, whole
    parts = []
    try:
        for r in (0, 1):
            M.set_tp(2, r)
            m = M.Transformer(C.model_args(big_ckpt))
            got = C.load_checkpoint(m, str(big_ckpt))["bytes_read"]
            assert got == sum(p.numel() * p.element_size() for p in m.parameters())
            replicated = sum(p.numel() * p.element_size() for p in m.parameters()
                             if getattr(p, "shard_dim", 0) is None)
            assert got - replicated == (full - replicated) / 2, (r, got, full, replicated)
            assert 0.45 * full <= got <= 0.6 * full, (got, full)
            parts.append(m)
    finally:
        M.set_tp(1, 0)
    # the two ranks' slices of the packed INT4 words put back together are the whole tensors
    ex = [p.layers[1].mlp.experts for p in parts]
    fx = full_model.layers[1].mlp.experts
    n = fx.inter // 2
    assert torch.equal(torch.cat([ex[0].w2_packed, ex[1].w2_packed], -1), fx.w2_packed)      # row-parallel down
    assert torch.equal(torch.cat([ex[0].w2_scale, ex[1].w2_scale], -1), fx.w2_scale)
    assert torch.equal(torch.cat([ex[0].w13_packed[:, :n], ex[1].w13_packed[:, :n]], 1), fx.w13_packed[:, :2 * n])
    assert torch.equal(torch.cat([ex[0].w13_packed[:, n:], ex[1].w13_packed[:, n:]], 1), fx.w13_packed[:, 2 * n:])


# ---------------------------------------------------------------------------------------------------------------
# 4. Malformed checkpoints: the error names the tensor (and file) or config.json and the offending field.
# (tests/test_model.py already covers: a missing tensor, a wrong float shape/dtype, a missing scale, a packed
# tensor a word too narrow, a wrong weight_shape, a tensor missing from the index, symmetric:false given as a
# dict, a deleted shard.)


def _load(path):
    m = M.Transformer(C.model_args(path))
    C.load_checkpoint(m, str(path))


def _rewrite(path, suffix, change):
    """Apply change(tensors, name) to the shard holding the tensor whose name ends with `suffix`."""
    index = json.load(open(path / "model.safetensors.index.json"))
    name = next(n for n in index["weight_map"] if n.endswith(suffix))
    fname = index["weight_map"][name]
    tensors = load_file(path / fname)
    backup = dict(tensors)
    change(tensors, name)
    for n in tensors:
        index["weight_map"].setdefault(n, fname)
    save_file(tensors, path / fname)
    json.dump(index, open(path / "model.safetensors.index.json", "w"))
    return name, fname, backup


@pytest.fixture
def k26(tmp_path):
    tiny.write_k26(tmp_path, cfg_tiny(), seed=14)
    return tmp_path


def _set(fn):
    return lambda t, name: t.__setitem__(name, fn(t[name]))


TENSOR_CASES = [
    # scales for group 16 while config.json says 32: twice the groups per row
    ("experts.1.gate_proj.weight_scale", _set(lambda s: s.repeat_interleave(2, -1).contiguous()),
     r"shape \[64, 4\], expected \[64, 2\] \(one scale per group of 32\)"),
    ("experts.0.down_proj.weight_scale", _set(lambda s: s[:, :1].contiguous()),
     r"shape \[64, 1\], expected \[64, 2\]"),
    # 8-bit packing (4 values per word) where 4-bit (8 per word) is expected: a word too many per 4 columns
    ("experts.4.up_proj.weight_packed", _set(lambda p: torch.cat([p, p], -1).contiguous()),
     r"shape \[64, 16\], expected \[64, 8\] \(int32 words"),
    ("experts.5.gate_proj.weight_packed", _set(lambda p: p.to(torch.int64)), r"dtype torch.int64"),
    ("experts.6.gate_proj.weight_packed", _set(lambda p: p.view(torch.uint8)), r"dtype torch.uint8"),
    ("experts.2.up_proj.weight_scale", _set(lambda s: s.to(torch.int32)), r"dtype torch.int32"),
]


@pytest.mark.parametrize("suffix,change,pattern", TENSOR_CASES, ids=[c[0] for c in TENSOR_CASES])
def test_malformed_tensor(k26, suffix, change, pattern):
    name, fname, backup = _rewrite(k26, suffix, change)
    with pytest.raises(C.CheckpointError) as e:
        _load(k26)
    msg = str(e.value)
    assert name in msg and fname in msg and re.search(pattern, msg), msg
    save_file(backup, k26 / fname)
    _load(k26)       # the untouched checkpoint loads


def test_extra_and_mismatched_expert_tensors(k26):
    cases = [
        # asymmetric leftovers in a symmetric checkpoint: a zero point / act-order g_idx is not silently dropped
        ("layers.1.mlp.experts.0.gate_proj.weight_scale",
         lambda t, n: t.__setitem__(n.replace("weight_scale", "weight_zero_point"),
                                    torch.zeros(64, 2, dtype=torch.int32)), "weight_zero_point"),
        ("layers.2.mlp.experts.7.down_proj.weight_scale",
         lambda t, n: t.__setitem__(n.replace("weight_scale", "weight_g_idx"),
                                    torch.zeros(64, dtype=torch.int32)), "weight_g_idx"),
        # an unquantized expert weight in a quantized checkpoint
        ("layers.1.mlp.experts.3.down_proj.weight_packed",
         lambda t, n: t.__setitem__(n.replace("weight_packed", "weight"), torch.zeros(64, 64)),
         "is unquantized"),
    ]
    for suffix, change, word in cases:
        name, fname, backup = _rewrite(k26, suffix, change)
        with pytest.raises(C.CheckpointError) as e:
            _load(k26)
        msg = str(e.value)
        assert word in msg and fname in msg and ".experts." in msg, msg
        save_file(backup, k26 / fname)
        index = json.load(open(k26 / "model.safetensors.index.json"))
        index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n in backup or f != fname}
        json.dump(index, open(k26 / "model.safetensors.index.json", "w"))
    _load(k26)


def test_quantized_tensors_without_quantization_config(k26):
    cfg = json.load(open(k26 / "config.json"))
    cfg.pop("quantization_config")
    cfg["text_config"].pop("quantization_config")
    json.dump(cfg, open(k26 / "config.json", "w"))
    with pytest.raises(C.CheckpointError, match=r"experts\.\d+\.\w+_proj\.weight_\w+ in model-.*no quantization_config"):
        _load(k26)


CONFIG_CASES = [
    ({"symmetric": False}, "weights.symmetric = False"),
    ({"num_bits": 8}, "weights.num_bits = 8"),
    ({"actorder": "group"}, "weights.actorder = 'group'"),
    ({"type": "float"}, "weights.type = 'float'"),
    ({"strategy": "channel"}, "weights.strategy = 'channel'"),
    ({"dynamic": True}, "weights.dynamic = True"),
    ({"group_size": 12}, "weights.group_size = 12"),
]


@pytest.mark.parametrize("weights,pattern", CONFIG_CASES, ids=[p.split(" ")[0] for _, p in CONFIG_CASES])
def test_malformed_quantization_config(k26, weights, pattern):
    cfg = json.load(open(k26 / "config.json"))
    for q in (cfg["quantization_config"], cfg["text_config"]["quantization_config"]):
        q["config_groups"]["group_0"]["weights"].update(weights)
    json.dump(cfg, open(k26 / "config.json", "w"))
    with pytest.raises(ValueError) as e:
        _load(k26)
    msg = str(e.value)
    assert str(k26 / "config.json") in msg and pattern in msg, msg


@pytest.mark.parametrize("key,value,pattern", [
    ("format", "naive-quantized", "format 'naive-quantized'"),
    ("format", "int-quantized", "format 'int-quantized'"),
    ("format", "marlin-24", "format 'marlin-24'"),
    ("quant_method", "gptq", "quant_method 'gptq'"),
])
def test_malformed_quantization_format(k26, key, value, pattern):
    cfg = json.load(open(k26 / "config.json"))
    for q in (cfg["quantization_config"], cfg["text_config"]["quantization_config"]):
        q[key] = value
    json.dump(cfg, open(k26 / "config.json", "w"))
    with pytest.raises(ValueError) as e:
        _load(k26)
    assert str(k26 / "config.json") in str(e.value) and pattern in str(e.value), str(e.value)


def test_activation_quantization_rejected(k26):
    cfg = json.load(open(k26 / "config.json"))
    act = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    for q in (cfg["quantization_config"], cfg["text_config"]["quantization_config"]):
        q["config_groups"]["group_0"]["input_activations"] = act
    json.dump(cfg, open(k26 / "config.json", "w"))
    with pytest.raises(ValueError, match="activation quantization"):
        _load(k26)


@pytest.mark.parametrize("weights,pattern", [({"symmetric": False}, "weights.symmetric = False"),
                                             ({"num_bits": 8}, "weights.num_bits = 8")])
def test_compressed_tensors_asymmetric_or_8bit_rejected(tmp_path, weights, pattern):
    """Real compressed-tensors output for settings we do not support (asymmetric INT4 with packed zero points,
    INT8 pack-quantized): config.json is refused, naming the file and the field, before any tensor is read."""
    ct_checkpoint(hf_model(cfg_tiny(), seed=15), tmp_path, nested=True, weights=weights)
    names = read_all(tmp_path).keys()
    if weights.get("symmetric") is False:
        assert any(n.endswith("weight_zero_point") for n in names)
    with pytest.raises(ValueError) as e:
        C.model_args(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "config.json") in msg and pattern in msg, msg


def test_mtp_layer_tensors_are_skipped(k26):
    """The layers past num_hidden_layers that num_nextn_predict_layers declares (multi-token prediction) are
    skipped, their routed experts included. K2.6 has none (num_nextn_predict_layers 0), DeepSeek-V3-style
    checkpoints do; undeclared, such a layer is an error (a config that names too few layers)."""
    extra = {"language_model.model.layers.3.input_layernorm.weight": torch.ones(64),
             "language_model.model.layers.3.mlp.experts.0.gate_proj.weight_packed":
                 torch.zeros(64, 8, dtype=torch.int32)}
    _rewrite(k26, "layers.0.input_layernorm.weight", lambda t, n: t.update(extra))
    with pytest.raises(C.CheckpointError, match=r"layers\.3\..* is of layer 3, past config.json's "
                                                r"num_hidden_layers = 3 \(\+ num_nextn_predict_layers = 0\)"):
        _load(k26)
    cfg = json.load(open(k26 / "config.json"))
    cfg["text_config"]["num_nextn_predict_layers"] = 1
    json.dump(cfg, open(k26 / "config.json", "w"))
    _load(k26)
