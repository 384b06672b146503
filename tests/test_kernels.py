"""
Tests for kernels.py: the one switch (every registered kernel has its `@kernels.fast` reference in a stage file
and back, with the same arguments; --no-triton runs the references; each fits() holds its kernel's limits), the
references that the kernels copy against naive float64 math, and every Triton kernel against its reference.

    python -m pytest -q tests/test_kernels.py

On a CUDA machine the kernel tests run directly (fp32, fp16, bf16). On a CPU machine they run under the Triton
interpreter in a subprocess (test_kernels_under_triton_interpreter): TRITON_INTERPRET=1 has to be set before triton
is imported, and in this process pytest (or another test module) may have imported it already.
"""
import dataclasses
import functools
import inspect
import math
import os
import subprocess
import types
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import checkpoint as C  # noqa: E402
from bench import int4_ref  # noqa: E402  (model.Experts.forward as written, on fused_moe_w4a16's arguments)
import draft as Dr  # noqa: E402
import kernels  # noqa: E402
import model as M  # noqa: E402
import tiny  # noqa: E402
import tree as ddtree  # noqa: E402
import verify  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if torch.cuda.is_available() and kernels.HAS_TRITON and not INTERPRET:
    KERNEL_DEVICE = "cuda"
elif INTERPRET and kernels.HAS_TRITON:
    KERNEL_DEVICE = "cpu"
else:
    KERNEL_DEVICE = None
needs_kernels = pytest.mark.skipif(KERNEL_DEVICE is None, reason="run by test_kernels_under_triton_interpreter")
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if KERNEL_DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # max abs error / max abs value

if INTERPRET and kernels.HAS_TRITON:
    import triton.runtime.interpreter as _interp
    if "squeeze" not in inspect.getsource(_interp._patch_lang_tensor):
        # triton 3.6's interpreter turns a loop bound into an int with int(1-element array), which numpy >= 2.4
        # rejects (https://github.com/triton-lang/triton/issues/9171); the upstream fix: squeeze first
        _patch_lang_tensor = _interp._patch_lang_tensor

        def _patch_lang_tensor_fixed(tensor, scope):
            _patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
        _interp._patch_lang_tensor = _patch_lang_tensor_fixed


def assert_close(actual, expected, tol, what=""):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not actual.isnan().any(), f"{what}: {int(actual.isnan().sum())} NaN elements (unwritten output?)"
    err = (actual - expected).abs()
    scale = expected.abs().max().clamp_min(1e-12)
    assert err.max() <= tol * scale, \
        f"{what}: max err {err.max():.3e}, mean {err.mean():.3e}, max |ref| {scale:.3e}, tol {tol}"


def launch(name, *args, **kw):
    """The kernel registered under `name` (or a (fits, launcher) pair), on these arguments; on a GPU its fits()
    must accept them (outside autograd, as the model serves), on the interpreter's CPU tensors refuse them."""
    fits, run = kernels._KERNELS[name] if isinstance(name, str) else name
    with torch.no_grad():
        assert fits(*args, **kw) == (KERNEL_DEVICE == "cuda"), f"{name}: fits() on {KERNEL_DEVICE} tensors"
    return run(*args, **kw)


# ----------------------------------------------------------------------------------------------------------
# The switch

STAGES = (M, Dr, ddtree, verify)


def fast_ops() -> dict:
    """Every `@kernels.fast` op of the stage files, and block part (a method): its qualified name -> the op."""
    found = [f for mod in STAGES for f in vars(mod).values() if getattr(f, "__module__", None) == mod.__name__]
    found += [f for cls in found if isinstance(cls, type) for f in vars(cls).values()]
    return {f.__qualname__: f for f in found if callable(f) and hasattr(f, "ref")}


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_every_kernel_has_its_reference_and_back():
    """The registry and the stage files name the same ops, and each op's reference, launcher and fits() take the
    same arguments (the dispatch hands all three the caller's arguments as they are)."""
    ops = fast_ops()
    assert set(ops) == set(kernels._KERNELS), (set(ops) ^ set(kernels._KERNELS))
    assert set(kernels._HOST) <= set(ops)
    for table in (kernels._KERNELS, kernels._HOST):
        for name, (fits, run) in table.items():
            op = ops[name]
            assert params(op.ref) == params(run) == params(fits), name
            defaults = [[p.default for p in inspect.signature(f).parameters.values()] for f in (op.ref, run, fits)]
            assert defaults[0] == defaults[1] == defaults[2], name


def test_host_paths_read_only_the_visible_slots():
    """On the CPU the attention ops hand their references only the slots that can be visible (the committed prefix
    and the new tree or block): the same outputs as the references over the whole cache, and a slot past the last
    row's tree or block is never read (NaN there changes nothing)."""
    torch.manual_seed(0)
    B, T, H, R, P, S = 2, 5, 3, 16, 8, 64
    prefix = torch.tensor([7, 20])
    cache = torch.randn(B, S, R + P)
    cache[:, 25:] = float("nan")                                            # past 20 + T: never visible
    q_lat, q_pe = torch.randn(B, T, H, R), torch.randn(B, T, H, P)
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    with torch.no_grad():
        got = M.mla_attention(q_lat, q_pe, cache, prefix, mask, 0.3)
        want = M.mla_attention.ref(q_lat, q_pe, cache.nan_to_num(), prefix, mask, 0.3)
    assert_close(got, want, 1e-5, "mla_attention, visible slots")
    KV, hd = 1, 16
    q, k, v = torch.randn(B, T, H, hd), torch.randn(B, S, KV, hd), torch.randn(B, S, KV, hd)
    k[:, 25:], v[:, 25:] = float("nan"), float("nan")
    with torch.no_grad():
        got = Dr.block_attention(q, k, v, prefix, 0.25)
        want = Dr.block_attention.ref(q, k.nan_to_num(), v.nan_to_num(), prefix, 0.25)
    assert_close(got, want, 1e-5, "block_attention, visible slots")


def test_host_experts_run_together(monkeypatch):
    """On the CPU the INT4 routed experts run together (the used ones dequantized in one go, every row through each):
    the reference's output; past HOST_EXPERTS_BYTES, or for float experts, the reference runs as written."""
    x, ids, w, *weights = make_moe(T=6, E=8, K=3, D=64, I=32, dtype=torch.float32)
    experts = C.int4_experts(*weights)
    fits = kernels._HOST["Experts.forward"][0]
    with torch.no_grad():
        assert fits(experts, x, w, ids) and not fits(types.SimpleNamespace(quant=None), x, w, ids)
        assert_close(experts(x, w, ids), M.Experts.forward.ref(experts, x, w, ids), 1e-6, "experts together")
        per_expert = (3 * 32 * 64 + 6 * (3 * 32 + 64)) * 4                    # weights and the 6 rows' outputs
        monkeypatch.setattr(kernels, "HOST_EXPERTS_BYTES", 8 * per_expert - 1)            # a byte short for 8
        assert not fits(experts, x, w, ids)


def test_switch_off_runs_the_reference(monkeypatch):
    """With ENABLED (the default) a fitting kernel takes the call; with ENABLED False (--no-triton), or when its fits()
    says no, the reference does."""
    def boom(*a, **k):
        raise RuntimeError("the kernel ran")
    x, w = torch.randn(3, 8), torch.rand(8)
    want = M.rms_norm.ref(x, w, 1e-6)
    monkeypatch.setitem(kernels._KERNELS, "rms_norm", (lambda x, weight, eps: True, boom))
    with pytest.raises(RuntimeError, match="the kernel ran"):
        M.rms_norm(x, w, 1e-6)
    monkeypatch.setattr(kernels, "ENABLED", False)
    assert torch.equal(M.rms_norm(x, w, 1e-6), want)
    monkeypatch.setattr(kernels, "ENABLED", True)
    monkeypatch.setitem(kernels._KERNELS, "rms_norm", (lambda x, weight, eps: False, boom))
    assert torch.equal(M.rms_norm(x, weight=w, eps=1e-6), want)


def test_glue_kernels_stay_out_of_autograd_and_compile(monkeypatch):
    """The glue kernels have no backward and inductor fuses their PyTorch forms: their fits() refuse a call that
    autograd records or that torch.compile traces; the opaque ones (attention, MoE, tree search) do not care."""
    monkeypatch.setattr(kernels, "_gpu", lambda t: True)             # pretend the tensors live on a GPU
    x, w = torch.randn(2, 16), torch.ones(16)
    fits = kernels._KERNELS["rms_norm"][0]
    with torch.no_grad():
        assert fits(x, w, 1e-6)
    assert not fits(x, w, 1e-6)                                      # grad mode on
    lp = torch.zeros(1, 3, 4)
    tok = torch.zeros(1, 3, 4, dtype=torch.long)
    assert kernels._KERNELS["ddtree_search"][0](lp, tok, torch.zeros(1, dtype=torch.long), 8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        assert not fits(x, w, 1e-6)


def router(weight, bias, top_k: int, norm: bool, scale: float, n_group: int = 1) -> types.SimpleNamespace:
    """What model.Gate.forward and its launcher read of a Gate: its tensors and settings (topk_group 1)."""
    return types.SimpleNamespace(weight=weight, e_score_correction_bias=bias, top_k=top_k, norm=norm, scale=scale,
                                 n_group=n_group, topk_group=1)


def tiny_moe(**over) -> M.MoE:
    """An INT4 MoE part of the tiny config (D = 64), weights uninitialized: for fits() only."""
    return M.MoE(C.model_args(C.k26_config(tiny.text_config(**over), 32)))


def fits_cases():
    """(name, args that fit, the same with one thing the kernel cannot take), small CPU tensors."""
    f32, f16, i64 = torch.float32, torch.float16, torch.int64
    r = lambda *s, dtype=f32: torch.zeros(*s, dtype=dtype)
    tree = ddtree.Tree(*ddtree.ddtree_search.ref(r(1, 3, 4), r(1, 3, 4, dtype=i64), r(1, dtype=i64), 4))
    big_tree = ddtree.Tree(*ddtree.ddtree_search.ref(r(1, 3, 4), r(1, 3, 4, dtype=i64), r(1, dtype=i64), 64))  # 65 nodes
    b = torch.bool
    attn = lambda T_, R: (r(1, T_, 2, R), r(1, T_, 2, 16), r(1, 80, R + 16), r(1, dtype=i64), r(1, T_, T_, dtype=b), 0.1)
    moe = lambda gs: (C.int4_experts(r(4, 64, 8, dtype=torch.int32), r(4, 64, 64 // 32), r(4, 64, 4, dtype=torch.int32),
                                 r(4, 64, 1), gs), r(2, 64), r(2, 2), r(2, 2, dtype=i64))
    gate = lambda n_group: router(r(8, 16), r(8), 2, True, 1.0, n_group)
    blocks = lambda debug: (None, r(1, 2, 64), None, None, None, 0, None, True, None, (), debug)
    qkv = lambda hd: (r(1, 3, 4 * hd), 2, 1, r(hd), r(hd), 1e-6, r(1, 3, hd), r(1, 3, hd), r(1, 8, 1, hd),
                      r(1, 8, 1, hd), r(1, 3, dtype=i64), 1)
    return [
        ("linear", (r(2, 3, 16, dtype=f16), r(8, 16, dtype=f16)), (r(65, 16, dtype=f16), r(8, 16, dtype=f16))),
        ("rms_norm", (r(2, 16), r(16), 1e-6), (r(2, 16), r(8), 1e-6)),
        ("rope", (r(1, 2, 3, 16), r(1, 2, 16), r(1, 2, 16)), (r(1, 2, 3, 12), r(1, 2, 12), r(1, 2, 12))),
        ("mla_latent_to_cache", (r(1, 2, 48), r(32), 1e-6, r(1, 2, 16), r(1, 2, 16), r(2, 9, 48), r(1, 2, dtype=i64)),
         (r(1, 2, 40), r(24), 1e-6, r(1, 2, 16), r(1, 2, 16), r(2, 9, 40), r(1, 2, dtype=i64))),
        ("mla_attention", attn(64, 32), attn(65, 32)),                     # 65 > one mask word in the kernel
        ("mla_attention", attn(9, 32), attn(9, 24)),                                  # R not a power of two
        ("mla_attention", attn(9, 32), attn(9, 32)[:4] + (r(1, 9, 9, dtype=b).transpose(1, 2), 0.1)),  # strided
        ("Gate.forward", (gate(1), r(2, 16)), (gate(2), r(2, 16))),                           # group-limited routing
        ("Experts.forward", moe(32), moe(64)),                                             # group 64 > I = 32
        ("Transformer.blocks", blocks(False), blocks(True)),                                 # --debug: plain stack
        ("MoE.local", (tiny_moe(), r(2, 64)), (tiny_moe(n_group=2), r(2, 64))),          # group-limited routing
        ("qkv_norm_rope", qkv(16), qkv(24)),
        ("block_attention", (r(1, 4, 2, 16), r(1, 8, 1, 16), r(1, 8, 1, 16), r(1, dtype=i64), 0.25),
         (r(1, 4, 2, 8), r(1, 8, 1, 8), r(1, 8, 1, 8), r(1, dtype=i64), 0.25)),
        ("rank_topk", (r(3, 100), 64), (r(3, 100), 65)),
        ("ddtree_search", (r(1, 3, 4), r(1, 3, 4, dtype=i64), r(1, dtype=i64), 64),
         (r(1, 3, 4), r(1, 3, 4, dtype=i64), r(1, dtype=i64), 65)),
        ("accept", (tree, r(1, 5, dtype=i64)), (big_tree, r(1, 65, dtype=i64))),
        ("commit_kv", (r(2, 1, 9, 4), r(1, dtype=i64), r(1, 5, dtype=i64), r(1, dtype=i64)),
         (r(2, 1, 9, 4), 3, r(1, 5, dtype=i64), r(1, dtype=i64))),
    ]


@pytest.mark.parametrize("name, ok, bad", fits_cases(), ids=[c[0] for c in fits_cases()])
def test_fits_hold_the_kernels_limits(name, ok, bad, monkeypatch):
    """Each fits() accepts what its kernel takes and refuses one thing it cannot (then the reference runs): a mask
    wider than one int64 word, a width that is not a power of two, group-limited routing, too many top-k rounds,
    a tree budget past 64, a tree without packed mask rows, an int start position. CPU tensors never fit."""
    fits = kernels._KERNELS[name][0]
    with torch.no_grad():
        assert not fits(*ok), "CPU tensors must go to the reference"
        monkeypatch.setattr(kernels, "_gpu", lambda t: True)         # pretend the tensors live on a GPU
        assert fits(*ok) and not fits(*bad)


def test_moe_tiles_hold_whole_scale_groups(monkeypatch):
    """A tensor-core tile narrower than a scale group (BLOCK_K 16 < group 32) sends the experts to the reference."""
    _, ok, _ = next(c for c in fits_cases() if c[0] == "Experts.forward")
    fits = kernels._KERNELS["Experts.forward"][0]
    monkeypatch.setattr(kernels, "_gpu", lambda t: True)
    assert fits(*ok)
    monkeypatch.setattr(kernels, "MOE_MMA_BLOCKS", {k: dict(c, BLOCK_K=16) for k, c in kernels.MOE_MMA_BLOCKS.items()})
    assert not fits(*ok)


def test_references_run_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"     # makes `import triton` raise ImportError
        "import torch, kernels, model as M, draft, tree, verify\n"
        "assert not kernels.HAS_TRITON\n"
        "x = torch.randn(3, 8)\n"
        "assert torch.equal(M.rms_norm(x, torch.ones(8), 1e-6), M.rms_norm.ref(x, torch.ones(8), 1e-6))\n"
        "o = M.mla_attention(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 5, 32),"
        " torch.tensor([3]), torch.ones(1, 2, 2, dtype=torch.bool), 0.1)\n"
        "assert o.shape == (1, 2, 1, 16)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------------
# The references the kernels copy, against float64 by hand

def pack_bytewise(q: torch.Tensor) -> torch.Tensor:
    # independent packer: column 8k + i -> bits 4i..4i+3 of word k, stored as q + 8
    u = (q.numpy().astype(np.uint32) + 8).reshape(*q.shape[:-1], -1, 8) & 0xF
    words = (u << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    return torch.from_numpy(words.view(np.int32).copy())


def unpack_bytewise(packed: torch.Tensor) -> torch.Tensor:
    # independent unpacker: view each little-endian int32 word as 4 bytes; byte b holds column 2b (low nibble) and
    # column 2b+1 (high nibble), so the columns of word k come out in order 8k .. 8k+7
    b = packed.contiguous().numpy().view(np.uint8).astype(np.int64)  # [..., I/8 * 4]
    u = np.stack([b & 0xF, b >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return torch.from_numpy(u - 8)


def test_int4_bit_order():
    """The layout the MoE kernel reads (its header cites model.unpack_int4): every value at every nibble."""
    o, j = torch.arange(16)[:, None], torch.arange(64)[None, :]
    q = ((o + j) % 16 - 8).to(torch.int8)
    packed = pack_bytewise(q)
    assert int(packed[0, 0]) & 0xFFFFFFFF == sum((int(q[0, i]) + 8) << (4 * i) for i in range(8))
    assert (packed < 0).any(), "a top nibble >= 8 makes the int32 word negative"
    assert torch.equal(M.unpack_int4(packed), q) and torch.equal(unpack_bytewise(packed), q.long())


def make_moe(T, E, K, D, I, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q13 = torch.randint(-8, 8, (E, 2 * I, D), dtype=torch.int8, generator=g)
    q2 = torch.randint(-8, 8, (E, D, I), dtype=torch.int8, generator=g)
    s13 = (torch.rand(E, 2 * I, D // 32, generator=g) + 0.5) / (7 * math.sqrt(D))
    s2 = (torch.rand(E, D, I // 32, generator=g) + 0.5) / (7 * math.sqrt(I))
    x = torch.randn(T, D, generator=g)
    scores = torch.rand(T, E, generator=g)
    scores[:, 0] += 1.0                                      # expert 0 is chosen by every token (duplicates)
    topk_weights, topk_ids = scores.topk(K, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    args = (x.to(dtype), topk_ids, topk_weights.float(), pack_bytewise(q13), s13.to(dtype), pack_bytewise(q2),
            s2.to(dtype))
    return tuple(a.to(device) for a in args)


def parents_to_mask(parents):
    # parents[i] < i, -1 for roots -> [T, T] bool: row i = i and its ancestors
    T_ = len(parents)
    mask = torch.eye(T_, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def make_tree_mask(kind, B, T_, g):
    masks = []
    for _ in range(B):
        if kind == "chain":
            masks.append(torch.tril(torch.ones(T_, T_, dtype=torch.bool)))
        elif kind == "bushy":
            parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, T_)]
            masks.append(parents_to_mask(parents))
        else:  # "holes": random bits, no diagonal, every third row empty: with prefix 0 those rows see nothing
            mask = torch.rand(T_, T_, generator=g) < 0.3
            mask[::3] = False
            masks.append(mask)
    return torch.stack(masks)


def make_attn(B, T_, H, R, P, prefixes, kind, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    S_max = max(prefixes) + T_ + 3
    q_lat = torch.randn(B, T_, H, R, generator=g)
    q_pe = torch.randn(B, T_, H, P, generator=g)
    cache = torch.randn(B, S_max, R + P, generator=g)
    prefix_len = torch.tensor(prefixes, dtype=torch.int64)
    tree_mask = make_tree_mask(kind, B, T_, g)
    args = (q_lat.to(dtype), q_pe.to(dtype), cache.to(dtype), prefix_len, tree_mask)
    return tuple(a.to(device) for a in args) + (1.0 / math.sqrt(R + P),)


def test_int4_experts_ref_vs_naive():
    """The reference (each used expert dequantized on its own, applied to the tokens that chose it) == float64 by
    hand."""
    x, ids, w, w13p, s13, w2p, s2 = make_moe(T=5, E=6, K=3, D=64, I=32, dtype=torch.float32)
    I = 32
    w13 = unpack_bytewise(w13p).double() * s13.double().repeat_interleave(32, -1)   # [E, 2I, D]
    w2 = unpack_bytewise(w2p).double() * s2.double().repeat_interleave(32, -1)      # [E, D, I]
    expected = torch.zeros(5, 64, dtype=torch.float64)
    for t in range(5):
        for k in range(3):
            e = int(ids[t, k])
            gate, up = w13[e, :I] @ x[t].double(), w13[e, I:] @ x[t].double()
            expected[t] += float(w[t, k]) * (w2[e] @ (F.silu(gate) * up))
    out = int4_ref(x, ids, w, w13p, s13, w2p, s2)
    assert out.dtype == torch.float32
    assert_close(out, expected, 1e-5, "INT4 experts reference")


@pytest.mark.parametrize("kind", ["chain", "bushy", "holes"])
def test_attention_ref_vs_naive(kind):
    B, T_, H, R, P = 2, 6, 2, 16, 8
    q_lat, q_pe, cache, prefix_len, tree_mask, scale = make_attn(B, T_, H, R, P, [0, 7], kind, torch.float32)
    expected = torch.zeros(B, T_, H, R, dtype=torch.float64)
    c = cache.double()
    for b in range(B):
        n = int(prefix_len[b])
        for t in range(T_):
            slots = list(range(n)) + [n + j for j in range(T_) if tree_mask[b, t, j]]
            if not slots:
                continue                                     # nothing visible -> zeros
            for h in range(H):
                s = scale * (c[b, slots, :R] @ q_lat[b, t, h].double() + c[b, slots, R:] @ q_pe[b, t, h].double())
                expected[b, t, h] = torch.softmax(s, 0) @ c[b, slots, :R]
    out = M.mla_attention.ref(q_lat, q_pe, cache, prefix_len, tree_mask, scale)
    assert out.dtype == torch.float32
    assert_close(out, expected, 1e-5, f"attention reference {kind}")


# ----------------------------------------------------------------------------------------------------------
# Kernels vs references (CUDA, or the interpreter in a subprocess)

# T, E, K, D, I, tiles. 16-bit activations with fewer than MOE_MMA_MIN_PAIRS pairs take the GEMV path, fp32 the
# tensor-core path; "mma" forces the tensor-core path at 16 bits. "small": the GEMV's tiles of 32 columns (BLOCK_W =
# 4 words), so rows span several tiles and the reduction dim is split across programs; the tensor-core path's
# BLOCK_N = 16 rows and BLOCK_K = 32 columns (D = 160: five whole tiles; I = 96: three).
MOE_CASES = [
    (1, 8, 2, 160, 64, "small"),        # D split 4 ways over 5 tiles: the last split is empty and must store zeros
    (1, 8, 4, 128, 64, "default"),
    (9, 16, 4, 128, 64, "default"),
    (9, 16, 4, 128, 64, "mma"),
    (17, 8, 3, 160, 96, "default"),     # D, I not multiples of the tile sizes: masked tails
    (5, 8, 3, 160, 96, "small"),
    (33, 12, 4, 128, 64, "default"),
    (80, 2, 2, 64, 32, "small mma"),    # an expert with more pairs than BLOCK_M: the loop over token blocks
]


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("T_, E, K, D, I, tiles", MOE_CASES)
def test_int4_experts_kernel(T_, E, K, D, I, tiles, dtype, monkeypatch):
    monkeypatch.setattr(kernels, "POISON_BUFFERS", True)
    if "small" in tiles:
        small = dict(BLOCK_N=16, BLOCK_W=4, num_warps=4, num_stages=2)
        monkeypatch.setattr(kernels, "MOE_GEMV_BLOCKS", dict(gate_up=small, down=small))
        monkeypatch.setattr(kernels, "MOE_MMA_BLOCKS", {k: dict(c, BLOCK_N=16, BLOCK_K=32)
                                                        for k, c in kernels.MOE_MMA_BLOCKS.items()})
    if "mma" in tiles:
        monkeypatch.setattr(kernels, "MOE_MMA_MIN_PAIRS", 0)
    args = make_moe(T_, E, K, D, I, dtype, KERNEL_DEVICE, seed=T_)
    if dtype != torch.float32:   # an outlier channel: the GEMV's per-row power-of-two scale keeps fp16 in range
        args[0][0, 3] = 300.0
    x, ids, w = args[:3]
    out = launch("Experts.forward", C.int4_experts(*args[3:]), x, w, ids)
    assert out.dtype == torch.float32 and out.shape == (T_, D)
    assert_close(out, int4_ref(*args), TOL[dtype], f"moe T={T_} {tiles} {dtype}")


tl = kernels.tl


@kernels.triton.jit
def _scales_probe(s_ptr, out_ptr, N, KG, NG: tl.constexpr, S_PAIRS: tl.constexpr):
    # kernels._scales for every row and every NG-group step of a [N, KG] scale table -> out [N, KG] fp32
    rows = tl.arange(0, 8)
    for g0 in range(0, KG, NG):
        s = kernels._scales(s_ptr + rows[:, None] * KG, g0, KG, rows < N, NG, S_PAIRS)
        gg = g0 + tl.arange(0, NG)
        tl.store(out_ptr + rows[:, None] * KG + gg[None, :], s, mask=(rows < N)[:, None] & (gg < KG)[None, :])


@needs_kernels
@pytest.mark.parametrize("KG, NG", [(8, 2), (6, 4), (4, 1)])
def test_moe_scales_read_in_pairs(KG, NG):
    """The tensor-core kernel's bf16 scales read two at a time as int32 are the scales, in fp32 (a tail past the row
    masked; one group a step reads them one at a time)."""
    scale = torch.randn(5, KG, generator=torch.Generator().manual_seed(KG)).to(torch.bfloat16).to(KERNEL_DEVICE)
    out = torch.full((5, KG), float("nan"), device=KERNEL_DEVICE)
    _scales_probe[(1,)](scale, out, 5, KG, NG=NG, S_PAIRS=kernels._scale_pairs(scale))
    assert kernels._scale_pairs(scale) == (KG % 2 == 0)
    assert torch.equal(out, scale.float())


@kernels.triton.jit
def _w4_tile_probe(w_ptr, s_ptr, out_ptr, N, K, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, S_PAIRS: tl.constexpr):
    # kernels._w4_tile for every BLOCK_K-column step of an INT4 weight [N, K] (words [N, K/8], scales [N, K/GROUP])
    rows = tl.arange(0, 8)
    for k0 in range(0, K, BLOCK_K):
        w = kernels._w4_tile(w_ptr + rows[:, None] * (K // 8), s_ptr + rows[:, None] * (K // GROUP), k0, K, rows < N,
                             GROUP, BLOCK_K, S_PAIRS, s_ptr.dtype.element_ty)
        kk = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + rows[:, None] * K + kk[None, :], w, mask=(rows < N)[:, None] & (kk < K)[None, :])


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_moe_w4_tile_is_dequant_int4(dtype):
    """The tensor-core kernel's dequantized tile (nibbles turned to floats by bit patterns, not conversions) ==
    model.dequant_int4, bit for bit, at every nibble value and in each activation dtype (a tail tile masked)."""
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(-2**31, 2**31, (5, 24), dtype=torch.int32, generator=g)                 # K = 192
    scale = (torch.rand(5, 6, generator=g) * 4 - 2).to(dtype)
    want = M.dequant_int4(packed, scale)
    out = torch.full((5, 192), float("nan"), dtype=dtype, device=KERNEL_DEVICE)
    _w4_tile_probe[(1,)](packed.to(KERNEL_DEVICE), scale.to(KERNEL_DEVICE), out, 5, 192, GROUP=32, BLOCK_K=128,
                         S_PAIRS=kernels._scale_pairs(scale))
    assert torch.equal(out.cpu(), want)


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("T_, mma_min_pairs", [(3, None), (3, 0), (70, None)])
def test_moe_part(T_, mma_min_pairs, dtype, monkeypatch):
    """The MoE part's launcher == MoE.local as written: 3 tokens (the router's two launches, the pairs sorted and x
    packed for the GEMV by the route launch; or the tensor-core path), 70 (the router's matmul in two token blocks);
    the shared experts on a side stream, added where the pairs are summed."""
    monkeypatch.setattr(kernels, "POISON_BUFFERS", True)
    if mma_min_pairs is not None:
        monkeypatch.setattr(kernels, "MOE_MMA_MIN_PAIRS", mma_min_pairs)
    model = C.random_model("random:tiny", KERNEL_DEVICE, dtype, seed=T_)
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, M.MoE))
    x = torch.randn(T_, model.args.hidden_size, generator=torch.Generator().manual_seed(T_)).to(dtype)
    x = x.to(KERNEL_DEVICE)
    with torch.no_grad():
        got = launch("MoE.local", moe, x)
        want = M.MoE.local.ref(moe, x)
    assert got.dtype == want.dtype == torch.float32
    assert_close(got, want, TOL[dtype], f"MoE part T={T_} {dtype}")


def part_inputs(name: str, dtype, T_: int = 5):
    """(the part's module, its arguments) for a verify step of T_ tree tokens after 8 cached ones, random:tiny."""
    model = C.random_model("random:tiny", KERNEL_DEVICE, dtype, seed=T_)
    model.setup_cache(2, 16)
    g = torch.Generator().manual_seed(T_)
    randn = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(KERNEL_DEVICE)
    with torch.no_grad():
        model(torch.randint(0, model.args.vocab_size, (2, 8), generator=g).to(KERNEL_DEVICE), start_pos=0)
    start = torch.tensor([8, 6], device=KERNEL_DEVICE)                                        # [B]
    slots = start[:, None] + torch.arange(T_, device=KERNEL_DEVICE)                           # [B, T]
    mask = make_tree_mask("bushy", 2, T_, g).to(KERNEL_DEVICE)                                # [B, T, T]
    cos, sin = M.rope_cos_sin(model.inv_freq, model.rope_attn_factor, slots, dtype)
    mla, D = model.layers[1].self_attn, model.args.hidden_size
    if name == "Transformer.blocks":
        return model, (randn(2, T_, D), cos, sin, model.kv_cache, start, mask, True, slots, (0, 2), False)
    if name == "MLA.attend":
        return mla, (randn(2, T_, D), cos, sin, model.kv_cache[1], start, mask, True, slots)
    if name == "MLP.forward":
        return model.layers[1].mlp.shared_experts, (randn(2, T_, D),)
    drafter = C.random_drafter("random:tiny-dflash", model.args, KERNEL_DEVICE, dtype, seed=T_)
    drafter.setup_cache(2, 16)
    hd, n = drafter.args.head_dim, 3                                      # n context rows, then the block
    cos, sin = (t[:n + T_].expand(2, -1, -1) for t in (drafter.rope_cos, drafter.rope_sin))
    cache = Dr.BlockCache(drafter.ctx_cache[0], torch.arange(n + T_, device=KERNEL_DEVICE).expand(2, -1),
                          torch.full((2,), n, device=KERNEL_DEVICE), 16)
    D = drafter.args.hidden_size
    assert cos.shape[-1] == hd
    return drafter.layers[0], (randn(2, T_, D), randn(2, n, D), cos, sin, None, cache)


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["Transformer.blocks", "MLA.attend", "MLA.attend unfused", "MLP.forward",
                                  "Layer.forward"])
def test_parts_equal_their_plain_forward(name, dtype, monkeypatch):
    """Each part's launcher == its plain forward as written: the layer stack (each residual add deferred into the next
    norm; the tapped layers' outputs), MLA's attention (q_pe's rope inside the attention kernel, on its own when
    unfused; the cache rows it writes too),
    the SwiGLU MLP (one SwiGLU launch), the drafter's layer (its middle add and norm in one launch). The attention
    part and the MLP run every kernel they launch, under the interpreter too; fused, the attention part never calls
    the ops it folds in."""
    monkeypatch.setattr(kernels, "POISON_BUFFERS", True)
    name, unfused = name.split()[0], name.endswith("unfused")
    if unfused:
        monkeypatch.setattr(kernels, "FUSE", dict.fromkeys(kernels.FUSE, False))
    elif name == "MLA.attend":
        def refuse(*args, **kw):
            raise AssertionError("a fused op ran on its own")
        monkeypatch.setitem(kernels._OPS, "rope", refuse)
        monkeypatch.setitem(kernels._OPS, "mla_attention", refuse)
    module, args = part_inputs(name, dtype)
    ref = functools.reduce(getattr, name.split("."), M if name != "Layer.forward" else Dr).ref
    fits, run = kernels._KERNELS[name]
    tensors = [a for a in args if torch.is_tensor(a)]                         # the caches among them
    before = [a.clone() for a in tensors]
    with torch.no_grad():
        assert fits(module, *args) == (KERNEL_DEVICE == "cuda")
        want = ref(module, *args)
        wrote = [a.clone() for a in tensors]
        for a, b in zip(tensors, before):
            if not torch.equal(a, b):                                          # (cos / sin may be expanded views)
                a.copy_(b)
        if name in ("MLA.attend", "MLP.forward"):               # the interpreter: every kernel these launch
            monkeypatch.setattr(kernels, "_gpu", lambda t: True)
        got = run(module, *args)
    for a, b in zip(tensors, wrote):
        assert_close(a, b, TOL[dtype], f"{name} {dtype}: the caches it wrote")
    if name == "Transformer.blocks":
        (got, got_taps), (want, want_taps) = got, want
        assert len(got_taps) == len(want_taps) == 2
        for a, b in zip(got_taps, want_taps):
            assert_close(a, b, TOL[dtype], f"{name} taps {dtype}")
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, TOL[dtype], f"{name} {dtype}")


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("ids", [[[3, 3, 5, 3]], [[3, 1, 3, 0], [3, 0, 2, 1]]], ids=["T1", "T2"])
def test_int4_experts_repeated_expert(ids, dtype, monkeypatch):
    """One expert taken 3 times by one token, or 2 + 1 times by two: a GEMV program takes its expert's pairs one
    after another over the same weights; every pair must be summed exactly once."""
    monkeypatch.setattr(kernels, "POISON_BUFFERS", True)
    args = list(make_moe(len(ids), 6, len(ids[0]), 128, 64, dtype, KERNEL_DEVICE, seed=5))
    args[1] = torch.tensor(ids, device=KERNEL_DEVICE)
    assert_close(kernels.fused_moe_w4a16(*args), int4_ref(*args), TOL[dtype], f"repeated expert {ids}")


def unpack_f16x2_planes(xk: torch.Tensor) -> torch.Tensor:
    # [rows, 4, N/8] int32, plane p word w = f16x2 (x[8w+p], x[8w+p+4]) -> [rows, N] fp32, independently of kernels.py
    rows, _, nw = xk.shape
    halves = xk.cpu().contiguous().view(torch.float16).view(rows, 4, nw, 2).float()   # little-endian: lo half first
    return torch.cat([halves[..., 0], halves[..., 1]], dim=1).permute(0, 2, 1).reshape(rows, 8 * nw)


@needs_kernels
@pytest.mark.parametrize("swiglu", [False, True])
def test_moe_prep_f16_packing(swiglu):
    """The GEMV's activation format: f16x2 planes in the lop3 nibble order, a power-of-two scale per row with
    max |x| / scale in [1, 2), rows longer than one program's block (N/8 = 160 words > 128) and SwiGLU over split
    sums; a row of zeros gets scale 1."""
    g = torch.Generator().manual_seed(3)
    rows, N, split_k = 3, 1280, 3
    if swiglu:
        src = torch.randn(split_k, rows, 2 * N, generator=g)
        gate, up = src.sum(0).chunk(2, dim=-1)
        x = F.silu(gate) * up
    else:
        src = torch.randn(rows, N, generator=g) * torch.tensor([[1.0], [300.0], [0.0]])
        x = src
    xk, xs = kernels._prep_f16(src.to(KERNEL_DEVICE), rows, N, split_k if swiglu else 1, swiglu=swiglu)
    xs = xs.cpu()
    amax = x.abs().amax(dim=1)
    expected = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(amax.clamp_min(1e-30)))), torch.ones(()))
    assert torch.equal(xs, expected)
    assert_close(unpack_f16x2_planes(xk) * xs[:, None], x, 1e-3, f"prep swiglu={swiglu}")


@needs_kernels
@pytest.mark.parametrize("T_, E, K", [(1, 384, 8), (9, 384, 8), (17, 8, 2), (3, 16, 4), (64, 384, 8), (5, 7, 7)])
def test_moe_sort(T_, E, K, monkeypatch):
    """One-program pair sort (decode / verify) == the torch.sort path (prefill): the same slot table, and each
    used expert's pairs are exactly the pairs that chose it (E = 8, 16: a power of two, so the padding bin is E)."""
    monkeypatch.setattr(kernels, "POISON_BUFFERS", True)
    g = torch.Generator().manual_seed(T_ * E)
    ids = torch.rand(T_, E, generator=g).topk(K, dim=-1).indices.to(KERNEL_DEVICE)          # [T, K] distinct per row
    pair_ids, slots = kernels._moe_sort(ids, E)
    monkeypatch.setattr(kernels, "MOE_SORT_MAX_PAIRS", 0)
    pair_ref, slots_ref = kernels._moe_sort(ids, E)
    assert torch.equal(slots, slots_ref), f"{slots} vs {slots_ref}"
    flat = ids.view(-1).cpu()
    for e, first, count in slots.tolist():
        mine = pair_ids[first:first + count].cpu()
        assert torch.equal(mine, pair_ref[first:first + count].cpu().sort().values), "pairs of an expert, in order"
        assert (flat[mine] == e).all() and count == int((flat == e).sum()) or count == 0


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("shape, N, w_fp32", [((1, 7168), 7168, False), ((2, 3, 1536), 1536, False),
                                              ((4, 5, 48), 32, False), ((3, 128), 128, True), ((0, 64), 64, False)])
def test_rms_norm_kernel(shape, N, w_fp32, dtype):
    """One-launch RMSNorm == the PyTorch form: rows of K2.6 widths, a last-dim slice of a wider tensor (the
    kv_a_layernorm input; strided rows), and an fp32 weight on 16-bit x (the output takes the promoted dtype)."""
    g = torch.Generator().manual_seed(N)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(KERNEL_DEVICE)[..., :N]
    w = (torch.rand(N, generator=g) + 0.5).to(torch.float32 if w_fp32 else dtype).to(KERNEL_DEVICE)
    y, ref = launch("rms_norm", x, w, 1e-6), M.rms_norm.ref(x, w, 1e-6)
    assert y.dtype == ref.dtype and y.shape == ref.shape
    if y.numel():                                # (0, 64): no rows, no launch
        assert_close(y, ref, TOL[dtype], f"rms_norm {shape} {N} {dtype}")


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 7168), (2, 9, 96), (0, 3, 64)])
@pytest.mark.parametrize("r_fp32", [False, True], ids=["r same dtype", "r fp32"])
def test_add_rms_norm_kernel(shape, dtype, r_fp32):
    """Residual add + RMSNorm in one launch: the sum bit-exact, the norm to rounding; an fp32 r (an MoE's output)
    rounded to x's dtype first."""
    g = torch.Generator().manual_seed(shape[-1])
    x, r = [(torch.randn(*shape, generator=g) * 3).to(dtype).to(KERNEL_DEVICE) for _ in range(2)]
    if r_fp32:
        r = r.float() + torch.randn(*shape, generator=g).to(KERNEL_DEVICE) * 1e-3     # not a value of dtype
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(KERNEL_DEVICE)
    s, y = launch((kernels._add_rms_norm_fits, lambda *a: kernels.add_rms_norm(*a, 1e-6)), x, r, w)
    s_ref = x + r.to(dtype)
    y_ref = M.rms_norm.ref(s_ref, w, 1e-6)
    assert torch.equal(s, s_ref) and y.dtype == y_ref.dtype and y.shape == y_ref.shape
    if y.numel():
        assert_close(y, y_ref, TOL[dtype], f"add_rms_norm {shape} {dtype}")


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("layout", ["q_pe slice", "3d", "cos slice"])
def test_rope_kernel(layout, interleaved, dtype, monkeypatch):
    """One-launch rope == the four-op form to one rounding (the kernel rounds where the PyTorch ops round; a GPU
    may still contract a product into an FMA). Inputs: the q_pe slice of q (strided heads), a [B, T, P] tensor, and
    cos / sin sliced out of a longer [B, T', P] (the drafter splits one cos table into context and block rows)."""
    g = torch.Generator().manual_seed(len(layout) + interleaved)
    B, T_, H, P = 2, 5, 3, 16
    if layout == "q_pe slice":
        monkeypatch.setattr(kernels, "ROPE_BLOCK_H", 2)        # heads over two programs, the second one partial
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 4).to(dtype).to(KERNEL_DEVICE)
    cos, sin = rnd(B, T_ + 3, P), rnd(B, T_ + 3, P)
    cos, sin = (cos[:, 3:], sin[:, 3:]) if layout == "cos slice" else (cos[:, :T_].contiguous(), sin[:, :T_].contiguous())
    x = rnd(B, T_, P) if layout == "3d" else rnd(B, T_, H, 8 + P)[..., 8:]
    y = launch("rope", x, cos, sin, interleaved)
    assert y.is_contiguous() and y.shape == x.shape
    # within a few roundings of the products (near-cancelling sums make a per-element relative bound meaningless,
    # so the bound is relative to the largest value, as assert_close's)
    ulp = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    assert_close(y, M.rope.ref(x, cos, sin, interleaved), 4 * ulp, f"rope {layout} {interleaved} {dtype}")


@needs_kernels
@pytest.mark.parametrize("dtype", [d for d in KERNEL_DTYPES if KERNEL_DEVICE == "cpu" or d != torch.float32], ids=str)
@pytest.mark.parametrize("M_, N, K", [(1, 96, 256), (9, 200, 384), (16, 64, 1000), (33, 128, 512), (64, 40, 7168)])
def test_linear_kernel(M_, N, K, dtype, monkeypatch):
    """Skinny GEMM == F.linear to rounding: N and K tails masked, 16- and 64-row tiles, K split over programs and summed
    by the last to finish (poisoned partials); up to 16 rows, a row's result does not depend on the rows beside it; a
    row-strided x (a slice of a wider GEMM's output) read in place."""
    monkeypatch.setattr(kernels, "POISON_BUFFERS", True)
    g = torch.Generator().manual_seed(M_ * N + K)
    x = torch.randn(M_, K, generator=g).to(dtype).to(KERNEL_DEVICE)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(KERNEL_DEVICE)
    assert kernels._skinny_split(N, K, KERNEL_DEVICE) > 1 or K <= kernels.SKINNY["BLOCK_K"]
    y = launch("linear", x, w)
    assert_close(y, M.linear.ref(x, w), TOL[dtype], f"linear {M_}x{N}x{K} {dtype}")
    if M_ <= 16:                                        # one 16-row tile for all of them
        assert torch.equal(launch("linear", x[:1], w), y[:1]), "a row's result depends on the rows beside it"
    wide = torch.cat([x, torch.randn(M_, 8, generator=g).to(dtype).to(KERNEL_DEVICE)], dim=1)[:, :K]
    assert torch.equal(launch("linear", wide, w), y)


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_silu_mul_kernel(dtype):
    g = torch.Generator().manual_seed(0)
    a, b = [(torch.randn(3, 1500, generator=g) * 4).to(dtype).to(KERNEL_DEVICE) for _ in range(2)]
    silu_mul = (kernels._silu_mul_fits, kernels.silu_mul)
    assert_close(launch(silu_mul, a, b), F.silu(a) * b, TOL[dtype], f"silu_mul {dtype}")
    # the two halves of one gate/up GEMM's output (model.MLP): row-strided views, not copies
    gu = (torch.randn(2, 5, 2 * 96, generator=g) * 4).to(dtype).to(KERNEL_DEVICE)
    gate, up = gu.split(96, dim=-1)
    y = launch(silu_mul, gate, up)
    assert not gate.is_contiguous() and y.shape == (2, 5, 96) and y.is_contiguous()
    assert torch.equal(y, kernels.silu_mul(gate.contiguous(), up.contiguous()))
    assert_close(y, F.silu(gate) * up, TOL[dtype], f"silu_mul strided {dtype}")


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("B, T_", [(1, 1), (2, 9)])
def test_mla_latent_to_cache_kernel(B, T_, dtype):
    """The new compressed-cache rows (norm | rope) land at their slots, rows elsewhere stay as they were."""
    g = torch.Generator().manual_seed(B * 100 + T_)
    R, P, S = 32, 16, 40
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 2).to(dtype).to(KERNEL_DEVICE)
    # kv as model.MLA splits it: the last columns of the q_a | kv_a GEMM's rows (row-strided)
    kv, cos, sin, w = rnd(B, T_, 24 + R + P)[..., 24:], rnd(B, T_, P), rnd(B, T_, P), rnd(R)
    assert B * T_ == 1 or not kv.is_contiguous()          # (one row counts as contiguous)
    slots = (torch.tensor([3, 20][:B])[:, None] + torch.arange(T_)).to(KERNEL_DEVICE)      # [B, T]
    cache = rnd(B + 1, S, R + P)                                                             # a spare batch row too
    ref = cache.clone()
    launch("mla_latent_to_cache", kv, w, 1e-6, cos, sin, cache, slots)
    M.mla_latent_to_cache.ref(kv, w, 1e-6, cos, sin, ref, slots)
    assert_close(cache, ref, TOL[dtype], f"latent B={B} T={T_} {dtype}")
    written = torch.zeros(B + 1, S, dtype=torch.bool)
    written[torch.arange(B)[:, None], slots.cpu()] = True
    assert torch.equal(cache[~written.to(KERNEL_DEVICE)], ref[~written.to(KERNEL_DEVICE)]), "rows off the slots changed"


ATTN_CASES = [  # T, H, prefixes (B = len), mask kind, tiles: "default" or "small" (short splits, several per row)
    (1, 4, [0, 100], "chain", "default"),
    (9, 2, [1, 100], "bushy", "small"),
    (17, 3, [100, 0], "bushy", "default"),
    (33, 2, [1000, 1], "bushy", "small"),
    (33, 4, [0, 0], "chain", "small"),
    (9, 4, [1000, 257], "chain", "default"),
    (17, 2, [0, 40], "holes", "small"),      # rows with nothing visible -> zeros, like the reference
    (64, 1, [5, 70], "bushy", "small"),      # tree slot 63 is the sign bit of the mask word
    (17, 4, [1000, 3], "bushy", "wide"),     # 64-row query blocks (ATTN_WIDE): 68 rows, the second block partial
    (9, 2, [0, 200], "holes", "wide"),
]


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("T_, H, prefixes, kind, tiles", ATTN_CASES)
def test_mla_attention_kernel(T_, H, prefixes, kind, tiles, dtype, monkeypatch):
    """Split + merge attention == the reference, every element of its poisoned output written; the same bits from
    the mask packed once per forward (what model.py passes) and from q_lat as the absorbed-query einsum leaves it
    (strided, read in place). The attention part's variant: q_pe rotated as it is loaded."""
    monkeypatch.setattr(kernels, "POISON_BUFFERS", True)
    if tiles == "small":
        monkeypatch.setattr(kernels, "ATTN_BLOCKS", dict(BLOCK_Q=16, BLOCK_S=16, num_warps=4, num_stages=2))
        monkeypatch.setattr(kernels, "ATTN_SPLITS", dict(kernels.ATTN_SPLITS, max_splits=8, min_split_len=32))
        monkeypatch.setattr(kernels, "ATTN_MERGE", dict(elements=128, num_warps=1))   # 16 columns: two blocks
    if tiles == "wide":
        monkeypatch.setattr(kernels, "ATTN_WIDE", dict(kernels.ATTN_WIDE, min_rows=0, BLOCK_S=16, waves=0.5))
        monkeypatch.setattr(kernels, "ATTN_SPLITS", dict(kernels.ATTN_SPLITS, max_splits=8, min_split_len=32))
    args = make_attn(len(prefixes), T_, H, 32, 16, prefixes, kind, dtype, KERNEL_DEVICE, seed=T_ + H)
    out = launch("mla_attention", *args)          # POISON_BUFFERS: an unwritten element would read NaN
    ref = M.mla_attention.ref(*args)
    assert_close(out, ref, TOL[dtype], f"attn T={T_} H={H} {prefixes} {kind} {dtype}")
    strided = args[0].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)                  # [B, T, H, R] view
    assert (H == 1 or not strided.is_contiguous()) and torch.equal(strided, args[0])
    assert torch.equal(launch("mla_attention", strided, *args[1:]), out)
    # a mask shared by the batch (stride 0, as Transformer.forward's causal default) reads like its copy
    shared = args[4][:1].expand_as(args[4])
    assert torch.equal(launch("mla_attention", *args[:4], shared, args[5]),
                       launch("mla_attention", *args[:4], shared.contiguous(), args[5]))
    # q_pe not rotated yet, a slice of q_b_proj's rows as MLA.attend leaves it: the kernel rotates it as it loads it
    g = torch.Generator().manual_seed(T_)
    q_pe = torch.randn(len(prefixes), T_, H, 24 + 16, generator=g).to(dtype).to(KERNEL_DEVICE)[..., 24:]
    cos, sin = M.rope_cos_sin(torch.rand(8, generator=g), 1.0, torch.arange(T_).expand(len(prefixes), -1), dtype)
    cos, sin = cos.to(KERNEL_DEVICE), sin.to(KERNEL_DEVICE)
    ref = M.mla_attention.ref(args[0], M.rope.ref(q_pe, cos, sin), *args[2:])
    assert_close(kernels._mla_attention(args[0], q_pe, *args[2:], rope=(cos, sin)), ref, TOL[dtype],
                 f"attn with rope T={T_} H={H} {dtype}")


@needs_kernels
@pytest.mark.parametrize("N, E, D, k, dtype, max_blocks", [
    (1, 384, 448, 8, torch.float16, None), (9, 384, 448, 8, torch.float32, None), (17, 16, 200, 4, torch.float16, None),
    (70, 64, 96, 6, torch.float32, None), (150, 16, 64, 2, torch.float16, None), (600, 16, 64, 2, torch.float16, None),
    (70, 64, 96, 6, torch.float16, 3), (3, 16, 64, 16, torch.float32, None)])
def test_router_kernel(N, E, D, k, dtype, max_blocks, monkeypatch):
    """Router matmul in (token, expert) blocks and D-slices + routing == F.linear in fp32 + the reference's routing:
    logits to fp32 rounding, the same experts in the same order, and (up to MOE_SORT_MAX_PAIRS pairs) the pairs sorted
    by expert in the route launch. D = 200: a masked tail slice; N = 70, 150, 600: several token blocks, the last one
    partial (600 x 2 pairs: sorted apart); max_blocks 3: more blocks than counters, the F.linear branch; k = E: every
    expert."""
    g = torch.Generator().manual_seed(N * E + D)
    x = torch.randn(N, D, generator=g).to(dtype).to(KERNEL_DEVICE)
    if max_blocks is not None:      # the counters made at full size first: they are made once, on first use
        kernels._counters(x.device)
        monkeypatch.setattr(kernels, "ROUTER_MAX_BLOCKS", max_blocks)
    weight = (torch.randn(E, D, generator=g) / D**0.5).to(torch.bfloat16).float().to(KERNEL_DEVICE)  # a bf16 checkpoint
    bias = (torch.randn(E, generator=g) * 0.1).to(KERNEL_DEVICE)
    for norm in (True, False):
        w, ids = launch("Gate.forward", router(weight, bias, k, norm, 2.827), x)
        w_ref, ids_ref = M.Gate.forward.ref(router(weight, bias, k, norm, 2.827), x)
        assert ids.dtype == torch.int64 and torch.equal(ids, ids_ref), f"{ids} vs {ids_ref}"
        assert_close(w, w_ref, 1e-5, f"router weights N={N} E={E} D={D} norm={norm}")
        _, _, pairs, prep = kernels._route(x, weight, bias, k, norm, 2.827, prep=True)    # the MoE part's call
        kernel = max_blocks is None
        assert (pairs is not None) == (kernel and N * k <= kernels.MOE_SORT_MAX_PAIRS)
        assert (prep is not None) == (kernel and dtype != torch.float32)
        if pairs is not None:       # the pairs sorted by expert for the experts, as _moe_sort
            (pair_ids, slots), (pair_ref, slots_ref) = pairs, kernels._moe_sort(ids, E)
            assert torch.equal(pair_ids, pair_ref) and torch.equal(slots, slots_ref)
        if prep is not None:        # and x packed for the MoE GEMV, as _prep_f16
            xk_ref, xs_ref = kernels._prep_f16(x, N, D, 1, swiglu=False)
            assert torch.equal(prep[0], xk_ref) and torch.equal(prep[1], xs_ref)


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("B, n_ctx, interleaved", [(1, 0, False), (2, 3, False), (2, 8, True)])
def test_qkv_norm_rope_kernel(B, n_ctx, interleaved, dtype):
    """The drafter's q|k|v glue: the block's queries (normed, rotated) come back; every row's key (normed, rotated) and
    value land at its cache slot (padding rows parked past the block included); nothing else in the caches moves."""
    g = torch.Generator().manual_seed(B * 10 + n_ctx)
    H, KV, hd, bs, S = 4, 2, 32, 8, 40
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 2).to(dtype).to(KERNEL_DEVICE)
    T_ = n_ctx + bs
    qkv = rnd(B, T_, (H + 2 * KV) * hd + 16)[..., 16:]       # row-strided, like a slice of a wider GEMM output
    cos, sin, qw, kw = rnd(B, T_, hd), rnd(B, T_, hd), rnd(hd), rnd(hd)
    slots = torch.stack([torch.randperm(S, generator=g)[:T_] for _ in range(B)]).to(KERNEL_DEVICE)   # [B, T] distinct
    cache = rnd(2, B + 1, S, KV, hd)                                     # K and V, a spare batch row too
    ref_cache = cache.clone()
    q = launch("qkv_norm_rope", qkv, H, KV, qw, kw, 1e-6, cos, sin, cache[0], cache[1], slots, n_ctx, interleaved)
    q_ref = Dr.qkv_norm_rope.ref(qkv, H, KV, qw, kw, 1e-6, cos, sin, ref_cache[0], ref_cache[1], slots, n_ctx,
                                 interleaved)
    assert q.shape == (B, bs, H, hd) and q.is_contiguous()
    assert_close(q, q_ref, TOL[dtype], f"q B={B} n_ctx={n_ctx} {dtype}")
    assert_close(cache, ref_cache, TOL[dtype], f"k/v cache B={B} n_ctx={n_ctx} {dtype}")
    assert torch.equal(cache[1], ref_cache[1]), "values are copied, not rounded"
    written = torch.zeros(B + 1, S, dtype=torch.bool)
    written[torch.arange(B)[:, None], slots.cpu()] = True
    untouched = ~written.to(KERNEL_DEVICE)
    assert torch.equal(cache[:, untouched], ref_cache[:, untouched]), "slots nobody writes changed"


BLOCK_ATTN_CASES = [  # B, T (block), H, KV, prefixes, tiles (small: several splits and the merge)
    (1, 8, 4, 2, [0], "default"),            # only the block itself is visible
    (2, 8, 4, 2, [5, 300], "default"),       # one split: the output is written directly
    (2, 8, 4, 2, [5, 300], "small"),         # several splits (row 0 fills only the first), merged
    (1, 4, 8, 1, [77], "small"),             # 8 query heads on one kv head (the K2.6 drafter at TP8), 32 rows
]


@needs_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("B, T_, H, KV, prefixes, tiles", BLOCK_ATTN_CASES)
def test_block_attention_kernel(B, T_, H, KV, prefixes, tiles, dtype, monkeypatch):
    monkeypatch.setattr(kernels, "POISON_BUFFERS", True)
    if tiles == "small":
        monkeypatch.setattr(kernels, "DRAFT_ATTN", dict(kernels.DRAFT_ATTN, BLOCK_S=16, min_split_len=32, waves=64))
        monkeypatch.setattr(kernels, "ATTN_MERGE", dict(elements=256, num_warps=1))   # 16 columns: two blocks
    g = torch.Generator().manual_seed(B + T_ + H)
    hd, S = 32, 320
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(KERNEL_DEVICE)
    q = rnd(B, T_, H, hd)
    cache = rnd(3, 2, B + 1, S + 16, KV, hd)             # [layers, K/V, Bmax, slots, KV, hd], like the drafter's
    k, v = cache[1, 0, :B, :S], cache[1, 1, :B, :S]       # strided views of one layer's rows
    prefix = torch.tensor(prefixes, device=KERNEL_DEVICE)
    out = launch("block_attention", q, k, v, prefix, hd ** -0.5)      # POISON_BUFFERS: unwritten reads NaN
    ref = Dr.block_attention.ref(q.float(), k.float(), v.float(), prefix, hd ** -0.5)
    assert_close(out, ref, TOL[dtype], f"block attention B={B} T={T_} H={H} KV={KV} {prefixes} {tiles} {dtype}")
    k2 = k.clone()                                        # keys past prefix + T are invisible: changing them
    for b, p in enumerate(prefixes):                      # changes nothing
        k2[b, p + T_:] = 100.0
    assert torch.equal(kernels.block_attention(q, k2, v, prefix, hd ** -0.5), out)


@needs_kernels
@pytest.mark.parametrize("V_, k, kind", [(37, 37, "ints"), (300, 8, "gauss"), (1024, 64, "ints"), (1500, 16, "ties"),
                                         (4352, 8, "gauss"), (4352, 63, "neg_inf"), (20000, 16, "gauss"),
                                         (20000, 5, "zeros"), (300, 16, "nonfinite"), (4352, 8, "nonfinite")])
def test_rank_topk_kernel(V_, k, kind):
    """Top-k of (logp desc, token asc) without a vocabulary sort == the keyed top-k reference == a stable sort, bit
    for bit: exact ties, -0.0 next to 0.0, -inf, all-equal rows; one chunk (V <= 1024), several (merge launch), and
    the 4096-token chunks of a large vocabulary (V = 20000). A non-finite logp (NaN of either sign, +inf: a broken
    drafter's) ranks and reads back as -inf."""
    g = torch.Generator().manual_seed(V_ + k)
    x = torch.randn(3, V_, generator=g) * 3
    if kind == "ints":
        x = x.round()
    elif kind == "ties":
        x = (x * 0.5).round()
    elif kind == "neg_inf":
        x[torch.rand(3, V_, generator=g) < 0.5] = float("-inf")
    elif kind == "zeros":
        x = torch.zeros(3, V_)
    logp = torch.log_softmax(x, -1).to(KERNEL_DEVICE)
    if kind == "ties":
        logp[:, 7], logp[:, 9] = 0.0, -0.0                               # a -0.0 must tie with 0.0 (token order)
        assert logp[0, 9].signbit() and not logp[0, 7].signbit()
    if kind == "nonfinite":
        pick = torch.rand(3, V_, generator=g).to(KERNEL_DEVICE)
        logp[pick < 0.1], logp[pick > 0.95], logp[(pick > 0.5) & (pick < 0.55)] = float("nan"), -float("nan"), \
            float("inf")
        logp[1] = float("nan")                                           # a whole row: all tie, token order
        assert logp.isnan().any() and logp[0].signbit()[pick[0] > 0.95].all()
    lp, tok = launch("rank_topk", logp, k)
    lp_ref, tok_ref = ddtree.rank_topk.ref(logp, k)
    want_lp, want_tok = torch.sort(logp.where(logp.isfinite(), float("-inf")), dim=-1, descending=True, stable=True)
    assert torch.equal(tok, tok_ref) and torch.equal(tok, want_tok[:, :k]), f"{tok}\n{want_tok[:, :k]}"
    assert torch.equal(lp.view(torch.int32), lp_ref.view(torch.int32))
    assert torch.equal(lp.view(torch.int32), want_lp[:, :k].contiguous().view(torch.int32))


# ----------------------------------------------------------------------------------------------------------
# ddtree_search, accept, commit_kv: bit for bit

def check_tree(lp: torch.Tensor, tok: torch.Tensor, roots: torch.Tensor, B: int, msg: str = "") -> None:
    """The kernel's 7 outputs == the reference's, bitwise (scores as int32: -0.0 and -inf padding included)."""
    dev = lambda t: t.to(KERNEL_DEVICE)
    got = launch("ddtree_search", dev(lp), dev(tok), dev(roots), B)
    want = ddtree.ddtree_search.ref(lp, tok, roots, B)
    for f, a, b in zip([f.name for f in dataclasses.fields(ddtree.Tree)], got, want):
        if b is None:
            assert a is None and B + 1 > 64, f"{f} {msg}"
            continue
        a = a.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, f"{f}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)} {msg}"
        if f == "scores":
            a, b = a.view(torch.int32), b.view(torch.int32)
        assert torch.equal(a, b), f"{f} differs {msg}\n{a}\n{b}"


def tree_logits(g: torch.Generator, b: int, L: int, V_: int, kind: str) -> torch.Tensor:
    if kind == "broken":        # a broken drafter's: NaN, +-inf, huge values at random places, a NaN row
        pick = torch.rand(b, L, V_, generator=g)
        x = torch.randn(b, L, V_, generator=g) * 3
        x[pick < 0.1], x[pick > 0.9], x[(pick > 0.5) & (pick < 0.55)] = float("nan"), float("inf"), -3e38
        x[:, -1] = float("nan")
        return x
    if kind == "gauss":
        return torch.randn(b, L, V_, generator=g) * 3
    if kind == "rounded":       # few distinct values: many exact ties, within and across depths
        return torch.randn(b, L, V_, generator=g).mul(2).round()
    if kind == "equal":         # maximal ties: every prefix of a depth has the same score
        return torch.zeros(b, L, V_)
    x = torch.randint(-2, 1, (b, L, V_), generator=g).float()      # "peaked": a dominant token, ties, some -inf
    x[torch.rand(b, L, V_, generator=g) < 0.3] = float("-inf")
    x[..., 0] = 5.0
    return x


@needs_kernels
@pytest.mark.parametrize("B", [1, 3, 8, 16, 63, 64])
def test_ddtree_search_kernel(B):
    """Depths 1..15 against budgets up to 64, vocabularies small enough to leave padding
    tails (V < B), batches of 1 and 3, and tie-heavy logits."""
    g = torch.Generator().manual_seed(B)
    kinds, vocabs = ["gauss", "rounded", "equal", "peaked"], [2, 3, 5, 64, 1000]
    for j, L in enumerate([1, 3, 7, 15]):
        n = j + B
        V_, bsz, kind = vocabs[n % len(vocabs)], [1, 3][n % 2], kinds[(n // 2) % len(kinds)]
        lp, tok = ddtree.rank_tokens(tree_logits(g, bsz, L, V_, kind), min(B, V_))
        check_tree(lp, tok, torch.randint(0, V_, (bsz,), generator=g), B, f"B={B} L={L} V={V_} b={bsz} {kind}")
    for L, V_ in ((1, 64), (7, 5), (15, 1000)):      # a broken drafter's logits: the root stays node 0
        lp, tok = ddtree.rank_tokens(tree_logits(g, 3, L, V_, "broken"), min(B, V_))
        check_tree(lp, tok, torch.tensor([4, 0, 1]), B, f"B={B} L={L} V={V_} broken")


@needs_kernels
def test_ddtree_search_exact_ties():
    """Integer logp tables fed straight in: float sums are exact, so different paths tie often (across depths too)
    and only the rank-tuple order decides; plus a lexicographic-order case where (0,1,0) ties with its cousins."""
    g = torch.Generator().manual_seed(7)
    ranked = lambda x, k: tuple(t[..., :k].contiguous() for t in torch.sort(x, dim=-1, descending=True, stable=True))
    for trial in range(10):
        L, V_, B = [2, 5, 9, 12, 16][trial % 5], [2, 3, 4, 7, 12][trial % 4], [8, 20, 40, 63, 64][trial % 5]
        x = -torch.randint(0, 3, (2, L, V_), generator=g).float()
        if trial % 2:
            x[..., 0] = 0.0
        check_tree(*ranked(x, min(B, V_)), torch.zeros(2, dtype=torch.long), B, f"L={L} V={V_} B={B} trial={trial}")
    x = torch.full((1, 3, 9), -30.0)
    x[0, 0, :2] = 0.0
    x[0, 1, :2] = torch.tensor([0.0, -1.0])
    x[0, 2, :8] = torch.tensor([0.0] + [-1.0] * 7)
    for B in (15, 16, 17):
        check_tree(*ranked(x, 9), torch.tensor([0]), B, f"lex regression B={B}")


@needs_kernels
def test_ddtree_search_vs_heap():
    """Against the paper's heap (tree.build_tree_heap) directly, including (0), (1), (0,0), (1,0) all tied."""
    def kernel_tree(x, root, B):
        lp, tok = ddtree.rank_tokens(x[None], min(B, x.shape[-1]))
        return ddtree.Tree(*launch("ddtree_search", lp.to(KERNEL_DEVICE), tok.to(KERNEL_DEVICE),
                              torch.tensor([root], device=KERNEL_DEVICE), B))[0]
    got = kernel_tree(torch.tensor([[0.0, 0.0], [0.0, float("-inf")]]), 5, 4)
    assert got.tokens.tolist() == [5, 0, 1, 0, 0] and got.parents.tolist() == [-1, 0, 0, 1, 2]   # shallower first
    g = torch.Generator().manual_seed(3)
    for L, V_, B in [(4, 6, 20), (16, 3, 64), (1, 1, 5), (7, 40, 1)]:
        x = torch.randn(L, V_, generator=g).mul(1.5).round()
        got, ref = kernel_tree(x, 1, B), ddtree.build_tree_heap(x, 1, B)
        for f in ["tokens", "parents", "depths", "scores", "valid", "ancestor_mask"]:
            assert torch.equal(getattr(got, f).cpu(), getattr(ref, f)), f"{f} L={L} V={V_} B={B}"


@needs_kernels
@pytest.mark.parametrize("B", [1, 8, 63])
def test_accept_kernel(B):
    """The accept kernel == verify.accept's reference on search trees (padding tails with a tiny vocabulary; at B = 63
    node 63's mask bit is the sign bit) against target tokens that follow a random root-to-node path part of the
    way, so every accept length shows up, plus fully random targets."""
    g = torch.Generator().manual_seed(B)
    for V_, L, kind in [(1000, 7, "gauss"), (3, 4, "peaked"), (50, 15, "rounded")]:
        bsz = 4
        lp, tok = ddtree.rank_tokens(tree_logits(g, bsz, L, V_, kind), min(B, V_))
        tr = ddtree.Tree(*ddtree.ddtree_search.ref(lp, tok, torch.randint(0, V_, (bsz,), generator=g), B))
        N = B + 1
        target = torch.randint(0, V_, (bsz, N), generator=g)                         # [bsz, N]
        for b in range(bsz - 1):                  # rows 0..2: the target agrees along a path for `stop` nodes
            node = int(torch.randint(0, N, (1,), generator=g)) if b else int(tr.valid[b].nonzero().max())
            path = [node]
            while tr.parents[b, path[-1]] >= 0:
                path.append(int(tr.parents[b, path[-1]]))
            path = path[::-1]                     # root .. node
            stop = int(torch.randint(0, len(path), (1,), generator=g)) if b else len(path) - 1   # row 0: all of it
            for parent, child in zip(path[:stop], path[1:stop + 1]):
                target[b, parent] = tr.tokens[b, child]
        want = verify.accept.ref(tr, target)
        got = launch("accept", tr.to(KERNEL_DEVICE), target.to(KERNEL_DEVICE))
        for name, a, b in zip(["accepted", "path_len", "bonus"], got, want):
            assert torch.equal(a.cpu(), b), f"{name} differs, B={B} V={V_} {kind}\n{a}\n{b}"
        assert want[1][0] > 1, "row 0 accepts its whole planted path"


@needs_kernels
@pytest.mark.parametrize("N, C", [(9, 48), (65, 576), (64, 1300)])
def test_commit_kv_kernel(N, C):
    """The commit kernel == verify.commit_kv's reference: a path that moves rows onto slots other rows are still read
    from (node indices strictly increase along a path), contiguous paths (all N nodes; 3), a finished row
    (path_len 0), rows longer than one column block; start positions as [B] and as [B, 1]."""
    g = torch.Generator().manual_seed(N)
    B, S = 4, 200
    starts = torch.tensor([3, 50, 0, 120])
    lens = torch.tensor([N, int(torch.randint(2, N, (1,), generator=g)), 3, 0])
    acc = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        n = max(int(lens[b]), 1)
        nodes = torch.randperm(N - 1, generator=g)[:n - 1].sort().values + 1 if b != 2 else torch.arange(1, n)
        path = torch.cat([torch.zeros(1, dtype=torch.long), nodes])
        acc[b] = torch.cat([path, path[-1:].expand(N - n)])
    cache = torch.randn(3, B + 1, S, C, generator=g).to(KERNEL_DEVICE)
    before, want = cache.clone(), cache.clone()
    dev = lambda t: t.to(KERNEL_DEVICE)
    verify.commit_kv.ref(want, dev(starts), dev(acc), dev(lens))
    for start in (starts, starts[:, None]):
        got = before.clone()
        launch("commit_kv", got, dev(start), dev(acc), dev(lens))
        assert torch.equal(got, want)
    assert not torch.equal(want[:, 1], before[:, 1]), "row 1's path moves rows"
    for b in (0, 2, 3):   # N nodes in order, 3 in order, a finished row: nothing moves
        assert torch.equal(want[:, b], before[:, b])


@needs_kernels
def test_bench_read_yardstick():
    """bench.py kernels' plain-read yardstick reads every element of x once: program i sums chunk i, the last one
    partial (masked), and nothing else."""
    import bench
    x = torch.randn(3, 1000, 7, generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    n, BLOCK, CHUNK = x.numel(), 64, 5 * 64
    out = torch.full((-(-n // CHUNK),), float("nan"), device=KERNEL_DEVICE)
    bench._read_sum_kernel[(out.numel(),)](x, out, n, CHUNK=CHUNK, BLOCK=BLOCK)
    chunks = F.pad(x.flatten(), (0, out.numel() * CHUNK - n)).view(-1, CHUNK)                       # [programs, CHUNK]
    assert_close(out, chunks.sum(1), 1e-5, "per-program sums")


@pytest.mark.skipif(KERNEL_DEVICE is not None or not kernels.HAS_TRITON, reason="kernels run directly here")
def test_kernels_under_triton_interpreter():
    """Every kernel test above, on a CPU: TRITON_INTERPRET=1 in a fresh process (it must be set before triton loads)."""
    this = sys.modules[__name__]
    tests = [f"{__file__}::{name}" for name, fn in vars(this).items()
             if name.startswith("test_") and needs_kernels.mark in getattr(fn, "pytestmark", [])]
    assert len(tests) >= 20, tests
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert "passed" in proc.stdout and "skipped" not in proc.stdout, report


def count_triton_launches(monkeypatch) -> list:
    """Every Triton kernel launched from now on, by name (compiled or interpreted)."""
    import triton.runtime.interpreter
    import triton.runtime.jit
    names = []
    for cls in (triton.runtime.jit.JITFunction, triton.runtime.interpreter.InterpretedFunction):
        def run(self, *args, _run=cls.run, **kw):
            names.append(self.fn.__name__ if hasattr(self, "fn") else self.__name__)
            return _run(self, *args, **kw)
        monkeypatch.setattr(cls, "run", run)
    return names


class MatmulLaunches(torch.utils._python_dispatch.TorchDispatchMode):
    """Inside: the PyTorch matmuls (cuBLAS launches on a GPU) are appended to `names` as "aten.bmm" etc."""
    def __init__(self, names: list):
        super().__init__()
        self.names = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in ("bmm", "mm", "addmm", "matmul", "baddbmm"):
            self.names.append("aten." + func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@needs_kernels
def test_moe_layer_launches(monkeypatch):
    """A K2.6-shaped MoE layer's decode step (bench.layer_step: per-rank TP8 shapes, shrunk) launches 20 kernels (18
    Triton, absorbed MLA's W_UK and W_UV bmms; 17 in order, the shared experts' three beside them), and each fusion of
    kernels.FUSE saves one launch: off, the step launches one more, the kernel it folds in."""
    import bench
    monkeypatch.setattr(kernels, "_gpu", lambda t: True)                   # (the interpreter's CPU tensors)
    args, block = bench.build_block(bench.k26_text_config("tiny"), 1, 8, KERNEL_DEVICE, torch.float16, 0)
    s = bench.step_inputs(args, 1, 64, "random", KERNEL_DEVICE, torch.float16, 0)
    cache = torch.randn(1, 65, args.kv_lora_rank + args.qk_rope_head_dim).half().to(KERNEL_DEVICE)
    step = bench.layer_step(block, s, cache)
    folded = dict(q_rope="_rope_kernel", route_prep="_moe_prep_f16")
    assert set(folded) == set(kernels.FUSE)
    with torch.no_grad():
        step()
        names = count_triton_launches(monkeypatch)
        with MatmulLaunches(names):
            step()
        assert len(names) == 20 and names.count("aten.bmm") == 2, names
        for fusion, kernel in folded.items():
            names.clear()
            monkeypatch.setitem(kernels.FUSE, fusion, False)
            with MatmulLaunches(names):
                step()
            monkeypatch.setitem(kernels.FUSE, fusion, True)
            assert len(names) == 21 and kernel in names, (fusion, names)


def test_moe_part_stream_order(monkeypatch):
    """The MoE launcher's two streams, with stand-ins (no GPU here): the side stream first waits for the main one
    (x is ready), the shared experts run on the side stream while the routed launches go on the main one, then the
    main stream waits for the side one before the sum reads the shared output, which is recorded on the main stream
    (freed there). A wait taken inside the side stream's context would be the side stream waiting on itself."""
    log, current = [], []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

    main, side = Stream("main"), Stream("side")
    current.append(main)

    class StreamContext:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            current.append(self.s)

        def __exit__(self, *exc):
            current.pop()

    class Shared:                                       # the shared experts' output
        def record_stream(self, s):
            log.append(f"shared recorded on {s.name}")

        def contiguous(self):
            return self

    x = types.SimpleNamespace(is_cuda=True, device="cuda:0", shape=(3, 8), dtype=torch.bfloat16, contiguous=lambda: x)
    moe = types.SimpleNamespace(
        gate=types.SimpleNamespace(weight=None, e_score_correction_bias=None, top_k=2, norm=True, scale=1.0),
        experts=types.SimpleNamespace(w13_packed=None, w13_scale=None, w2_packed=None, w2_scale=None,
                                      quant=types.SimpleNamespace(group_size=32)),
        shared_experts=lambda x: log.append(f"shared experts on {current[-1].name}") or Shared())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(kernels, "_side_stream", lambda device: side)
    monkeypatch.setattr(kernels, "_route", lambda *a, **k: log.append(f"route on {current[-1].name}") or (0, 0, 0, 0))
    monkeypatch.setattr(kernels, "_routed", lambda *a, **k: log.append(f"experts on {current[-1].name}"))
    monkeypatch.setattr(kernels, "_sum_pairs", lambda y, T, K, shared: log.append(f"sum on {current[-1].name}"))
    kernels._KERNELS["MoE.local"][1](moe, x)
    assert log == ["side waits for main", "shared experts on side", "route on main", "experts on main",
                   "main waits for side", "shared recorded on main", "sum on main"], log
