"""
Triton fast paths of nano-ddtree: each kernel computes what a plain PyTorch function of a stage file computes (its
reference), in fewer launches or fewer bytes.

    model.py   ops: linear, rms_norm, rope, mla_latent_to_cache, mla_attention
               parts: Transformer.blocks (each residual add fused into the next norm), MLA.attend (q_pe's rope
               in attention, W_UV's output in o_proj's rows), MLP.forward (one SwiGLU launch),
               Gate.forward (the router), Experts.forward (fused_moe_w4a16), MoE.local (router, routed and shared
               experts as one launcher); the fusions across op boundaries are switches in FUSE
    draft.py   ops: qkv_norm_rope, block_attention; part: Layer.forward
    tree.py    rank_topk, ddtree_search;   verify.py  accept, commit_kv

The one switch: a stage file marks its reference `@kernels.fast`: an op, or a part's method ("MoE.local"), whose
launcher runs the part's kernels in its own order, fused across the reference's op boundaries where that pays (a
part's launcher calls the ops it keeps through _OPS, the same switch). This file registers a launcher under the name
with `@register(name, fits=...)`, and a call goes to the launcher when ENABLED (--no-triton clears it) and fits(...)
accepts the arguments (a CUDA tensor, shapes and dtypes the kernel handles, ...), else to its host path if it has
one (section 0, on the CPU: the attention references on fewer cache slots, the routed experts together), else to
the reference. Launcher, fits and reference
take the same arguments. Invariant: every kernel == its reference, to rounding (bit for bit for ranking, tree search,
accept and commit).

    python -m pytest -q tests/test_kernels.py    # every kernel vs its reference (CPU: under TRITON_INTERPRET=1)
    python bench.py kernels [--sweep]            # GPU: K2.6 shapes, error and timings; launch-config sweep
"""
import contextlib
import functools
import os
import types

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # every op runs its reference; the @triton.jit definitions below stay plain functions
    HAS_TRITON = False
    triton = types.SimpleNamespace(jit=lambda fn: fn)
    tl = types.SimpleNamespace(constexpr=None)

ENABLED = True          # generate.py --no-triton sets False: every op runs its reference
POISON_BUFFERS = False  # tests set this: scratch buffers start as NaN (or -1), so an unwritten element shows up
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"   # kernels run on CPU tensors, in numpy (the tests)
_KERNELS: dict = {}     # reference name -> (fits, launch): its Triton kernel
_HOST: dict = {}        # reference name -> (fits, launch): its host path (section 0), tried after the kernel
_REFS: dict = {}        # reference name -> the reference, which a host path calls on less data
_OPS: dict = {}         # reference name -> its switch (what the stage file calls): a part's launcher calls its ops


def fast(ref):
    """Decorator for a stage file's reference op: calls go to its kernel, else its host path, where the switch is on and
    that path fits the arguments; else to ref itself. `op.ref` is the reference (tests use it). A method is
    registered under its class: "MoE.local"."""
    name = ref.__qualname__
    _REFS[name] = ref

    @functools.wraps(ref)
    def dispatch(*args, **kw):
        for table in (_KERNELS, _HOST):
            k = table.get(name)
            if k is not None and ENABLED and k[0](*args, **kw):
                return k[1](*args, **kw)
        return ref(*args, **kw)
    dispatch.ref = ref
    _OPS[name] = dispatch
    return dispatch


def register(name: str, fits, host: bool = False):
    """Decorator for a launcher: the fast path (host: the host path) of op `name` wherever fits(*args, **kw)."""
    def deco(launch):
        (_HOST if host else _KERNELS)[name] = (fits, launch)
        return launch
    return deco


def _gpu(t: torch.Tensor) -> bool:
    return HAS_TRITON and t.is_cuda


def _glue(t: torch.Tensor) -> bool:
    """The glue kernels' condition: on a GPU, outside torch.compile (inductor fuses the PyTorch form itself), not
    while autograd records (the kernels have no backward) and not under autocast (it mixes dtypes)."""
    return (_gpu(t) and not torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cuda"))


def _pow2(n: int, least: int = 2) -> bool:
    return n >= least and n & (n - 1) == 0


def _empty(shape, dtype, device):
    if POISON_BUFFERS:
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _sm_count(device) -> int:
    # SMs a grid is sized for; on CPU (the interpreter) 16, so that the tests exercise several splits
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16


def _row_warps(block: int) -> int:
    return min(8, max(1, block // 512))


MASK_WORD_BITS = 64     # tree slots one int64 word of a tree-mask row holds (the attention and search kernels)
# Fusions across a part's op boundaries, each one launch fewer a layer; a switch each, so that bench.py layers
# --fusions can time the part without it
FUSE = dict(q_rope=True,        # MLA: q_pe's rope inside the attention kernel, as it loads q_pe
            route_prep=True)    # MoE: the route launch also packs x for the MoE GEMV


# Programmatic dependent launch (PDL, Hopper and later): a kernel launched with launch_pdl may start while the kernel
# before it in the stream still runs, so its launch overlaps that kernel's tail. Each such kernel calls _gdc first:
# it lets the next kernel launch, then waits until the previous one has finished and its writes are visible, before
# it reads or writes anything a predecessor touches (so the order of every read and write stays the stream's). A
# CUDA graph keeps these edges. The interpreter and older GPUs launch plainly (PDL=False: _gdc is a no-op).
USE_PDL = True


@functools.lru_cache(maxsize=None)
def _pdl_ok(device) -> bool:
    return (HAS_TRITON and not INTERPRETED and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait"))


def _pdl(device) -> dict:
    """The launch arguments of a kernel that calls _gdc(PDL)."""
    return dict(PDL=True, launch_pdl=True) if USE_PDL and _pdl_ok(torch.device(device)) else dict(PDL=False)


@triton.jit
def _gdc(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


# ----------------------------------------------------------------------------------------------------------
# 0. Host paths: on the CPU, outside torch.compile, a host read is free, so the attention references get only the
# slots that can be visible (the committed prefix, the new tree or block), not the whole fixed-size cache; and a small
# model's step is bound by its op count, so the routed experts run together, not one at a time.

def _host(t: torch.Tensor) -> bool:
    return t.is_cpu and not torch.compiler.is_compiling()


@register("mla_attention", host=True, fits=lambda q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale:
          _host(cache))
def _mla_attention_visible(q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale):
    S = int(prefix_len.max()) + q_lat.shape[1]                                  # past the last row's tree
    return _REFS["mla_attention"](q_lat, q_pe, cache[:, :S], prefix_len, tree_mask, softmax_scale)


@register("block_attention", host=True, fits=lambda q, k_cache, v_cache, prefix_len, softmax_scale: _host(q))
def _block_attention_visible(q, k_cache, v_cache, prefix_len, softmax_scale):
    S = int(prefix_len.max()) + q.shape[1]                                      # past the last row's block
    return _REFS["block_attention"](q, k_cache[:, :S], v_cache[:, :S], prefix_len, softmax_scale)


HOST_EXPERTS_BYTES = 64 * 2**20   # fp32 bytes the used experts may take together: weights and every row's outputs


def _host_experts_fit(self, x, weights, ids) -> bool:
    if not (_host(x) and self.quant is not None):
        return False
    (N, D), I = x.shape, self.inter
    per_expert = (3 * I * D + N * (3 * I + D)) * 4               # fp32: w13 and w2, every row's gate, up, out
    return min(ids.numel(), len(self.w13_packed)) * per_expert <= HOST_EXPERTS_BYTES


# model.Experts.forward with the used experts dequantized in one go (expert() takes a tensor of ids), then every row
# through each of them, weighted 0 where it did not choose it: a dozen ops per layer instead of a dozen per expert.
@register("Experts.forward", host=True, fits=_host_experts_fit)
def _experts_together(self, x, weights, ids):
    used = ids.unique()                                                          # [g]
    w13, w2 = self.expert(used)                                                  # [g, 2I, D], [g, D, I] fp32
    gate, up = torch.matmul(x.to(w13.dtype), w13.transpose(1, 2)).chunk(2, dim=-1)   # [g, N, I] each
    o = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2)).float()                  # [g, N, D]
    w = (weights[:, :, None] * (ids[:, :, None] == used)).sum(1)                     # [N, g]
    return torch.einsum("ng,gnd->nd", w, o)


# ----------------------------------------------------------------------------------------------------------
# 1. The glue of a decode / verify layer (model.py). At T <= 64 tokens each PyTorch op is a launch of a few us even
# in a CUDA graph. Each kernel replaces a run of ops and rounds where its reference's ops round (each PyTorch op
# rounds to the tensor's dtype): the residual add is bit-exact, rope within one rounding, norms and sigmoids differ
# only in reduction order and exp.

@triton.jit
def _normalize(x, N, EPS: tl.constexpr):
    # RMSNorm without the weight: fp32 statistics, the result rounded to x's dtype (then the caller scales)
    xf = x.to(tl.float32)
    return (xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + EPS)).to(x.dtype)

@triton.jit
def _scale(w, y, dtype: tl.constexpr):
    return (w.to(tl.float32) * y.to(tl.float32)).to(dtype)

@triton.jit
def _rotate(x, partner, cos, sin):
    # x * cos + partner * sin, each product rounded to x's dtype before the sum, as the reference's four ops round
    a = (x.to(tl.float32) * cos.to(tl.float32)).to(x.dtype)
    b = (partner.to(tl.float32) * sin.to(tl.float32)).to(x.dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)

@triton.jit
def _partner(cols, P: tl.constexpr, INTERLEAVED: tl.constexpr):
    # the column a rope pair rotates against: adjacent (x[2i], x[2i+1]) for K2, halves (x[i], x[i+P/2]) for the drafter
    if INTERLEAVED:
        return cols ^ 1
    else:
        return (cols + P // 2) % P


# rms_norm: y = weight * x / sqrt(mean(x^2) + eps) per row, fp32 statistics. Grid: one program per row. One launch
# instead of 7-8. EPS is a constexpr, so it stays fp32. Reference: model.rms_norm.
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_row, N, EPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _gdc(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    y = _normalize(tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0), N, EPS)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * N + cols, _scale(w, y, y_ptr.dtype.element_ty), mask=mask)


@register("rms_norm", fits=lambda x, weight, eps: _glue(x) and x.stride(-1) == 1 and weight.shape == x.shape[-1:])
def rms_norm(x, weight, eps):
    N = x.shape[-1]
    rows = x.reshape(-1, N)                      # a view for contiguous x and for a last-dim slice of a contiguous one
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:                            # e.g. no new context rows for the drafter this step
        BLOCK = triton.next_power_of_2(N)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), N, EPS=float(eps), BLOCK=BLOCK,
                                           num_warps=_row_warps(BLOCK), **_pdl(x.device))
    return out


# add_rms_norm: (s, y) = (x + r, rms_norm(x + r)), the residual add and the next norm (r: an MLP's output, an MoE's
# in fp32, rounded to x's dtype first). Grid: one program per row. One read of x and r. Reference: x + r, then
# model.rms_norm.
@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, N, EPS: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    _gdc(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * N + cols, mask=mask, other=0.0).to(x.dtype)                 # an fp32 r rounded first
    s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)                                  # rounded
    tl.store(s_ptr + row * N + cols, s, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * N + cols, _scale(w, _normalize(s, N, EPS), y_ptr.dtype.element_ty), mask=mask)


def _add_rms_norm_fits(x, r, weight) -> bool:
    return _glue(x) and r.shape == x.shape and r.dtype in (x.dtype, torch.float32) and weight.shape == x.shape[-1:]


def add_rms_norm(x, r, weight, eps):
    # (x + r, rms_norm(x + r)): a residual add and the next norm; an fp32 r (the MoE's) rounds to x's dtype first
    N = x.shape[-1]
    x, r = x.contiguous(), r.contiguous()
    s = torch.empty_like(x)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    n_rows = x.numel() // N if N else 0
    if n_rows:
        BLOCK = triton.next_power_of_2(N)
        _add_rms_norm_kernel[(n_rows,)](x, r, weight, s, y, N, EPS=float(eps), BLOCK=BLOCK, num_warps=_row_warps(BLOCK),
                                        **_pdl(x.device))
    return s, y


# rope: x * cos + partner(x) * sin, partner = the other column of each rotated pair (the sign sits in sin). Grid:
# (token, block of ROPE_BLOCK_H heads). Reads x in place (e.g. the q_pe slice of q). Reference: model.rope.
@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, H, sx_b, sx_t, sx_h, sc_b, sc_t,
                 P: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr):
    # token n = (b, t), BLOCK_H of its H heads x P rope columns; y is contiguous [B, T, H, P]
    _gdc(PDL)
    n = tl.program_id(0).to(tl.int64)
    b, t = n // T, n % T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, P)[None, :]
    mask = h < H
    x_row = x_ptr + b * sx_b + t * sx_t + h * sx_h
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    partner = tl.load(x_row + _partner(cols, P, INTERLEAVED), mask=mask, other=0.0)
    c = b * sc_b + t * sc_t + cols
    y = _rotate(x, partner, tl.load(cos_ptr + c), tl.load(sin_ptr + c))
    tl.store(y_ptr + (n * H + h) * P + cols, y, mask=mask)


ROPE_BLOCK_H = 8        # heads per program: one program per token would leave a 64-head step with few programs


@register("rope", fits=lambda x, cos, sin, interleaved=True: (
    _glue(x) and x.dim() in (3, 4) and _pow2(x.shape[-1]) and cos.shape == sin.shape == (*x.shape[:2], x.shape[-1])
    and cos.stride() == sin.stride() and cos.dtype == sin.dtype == x.dtype and x.stride(-1) == cos.stride(-1) == 1))
def rope(x, cos, sin, interleaved=True):
    B, T, P = x.shape[0], x.shape[1], x.shape[-1]
    x4 = x if x.dim() == 4 else x.unsqueeze(2)                                       # [B, T, H, P]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)                         # contiguous
    if x.numel():
        H = x4.shape[2]
        BLOCK_H = min(ROPE_BLOCK_H, triton.next_power_of_2(H))
        _rope_kernel[(B * T, triton.cdiv(H, BLOCK_H))](x4, cos, sin, y, T, H, *x4.stride()[:3], *cos.stride()[:2], P=P,
                                                      BLOCK_H=BLOCK_H, INTERLEAVED=interleaved, **_pdl(x.device))
    return y


# silu_mul: SwiGLU's silu(g) * u, each op's rounding kept. Grid: (row, block of columns). Reads g and u in place
# (the two halves of one gate|up GEMM output). Reference: F.silu(g) * u.
@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _gdc(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)                                       # F.silu, rounded
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * N + cols, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def _silu_mul_fits(g, u) -> bool:
    return _glue(g) and g.shape == u.shape and g.dtype == u.dtype and g.stride(-1) == u.stride(-1) == 1


def silu_mul(g, u):
    N = g.shape[-1]
    g2, u2 = g.reshape(-1, N), u.reshape(-1, N)               # views when only the rows are strided
    y = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if g.numel():
        BLOCK = min(1024, triton.next_power_of_2(N))
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(N, BLOCK))](g2, u2, y, N, g2.stride(0), u2.stride(0), BLOCK=BLOCK,
                                                                **_pdl(g.device))
    return y


# A SwiGLU MLP's local part (model.MLP.forward: the dense MLP, the shared experts, the drafter's MLP): silu(gate) * up
# is one launch between the two GEMMs, not two. (Inside the down GEMM's prologue it would save that launch but cost the
# GEMM as much, off the critical path: the shared experts run beside the routed ones.)
@register("MLP.forward", fits=lambda self, x: _glue(x))
def mlp(self, x):
    gate, up = _OPS["linear"](x, self.gate_up_proj.weight).chunk(2, dim=-1)
    h = silu_mul(gate, up) if _silu_mul_fits(gate, up) else F.silu(gate) * up
    return _OPS["linear"](h, self.down_proj.weight)


# mla_latent_to_cache: the new tokens' compressed-cache rows, cache[b, slots[b, t]] = (rms_norm(kv[..., :R]) *
# weight | rope(kv[..., R:])), written in place. Grid: one program per token. One launch instead of the norm, rope,
# cat and scatter. Reference: model.mla_latent_to_cache.
@triton.jit
def _mla_latent_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, slots_ptr, cache_ptr, T, stride_kv, stride_cb, stride_cs,
                       R: tl.constexpr, P: tl.constexpr, EPS: tl.constexpr, PDL: tl.constexpr):
    _gdc(PDL)
    n = tl.program_id(0).to(tl.int64)
    dst = cache_ptr + (n // T) * stride_cb + tl.load(slots_ptr + n) * stride_cs
    src = kv_ptr + n * stride_kv
    r = tl.arange(0, R)
    c_kv = _normalize(tl.load(src + r), R, EPS)
    tl.store(dst + r, _scale(tl.load(w_ptr + r), c_kv, dst.dtype.element_ty))
    p = tl.arange(0, P)
    k_pe = tl.load(src + R + p)
    partner = tl.load(src + R + _partner(p, P, True))
    tl.store(dst + R + p, _rotate(k_pe, partner, tl.load(cos_ptr + n * P + p), tl.load(sin_ptr + n * P + p)))


@register("mla_latent_to_cache", fits=lambda kv, weight, eps, cos, sin, cache, slots: (
    _glue(kv) and _pow2(weight.shape[0]) and _pow2(kv.shape[-1] - weight.shape[0]) and kv.stride(-1) == 1
    and kv.dtype == weight.dtype == cache.dtype == cos.dtype == sin.dtype and cache.stride(-1) == 1))
def mla_latent_to_cache(kv, weight, eps, cos, sin, cache, slots):
    (B, T, C), R = kv.shape, weight.shape[0]
    rows = kv.reshape(B * T, C)        # a view for kv contiguous or a last-dim slice of one (MLA's q_a | kv_a GEMM)
    if B * T:
        _mla_latent_kernel[(B * T,)](rows, weight.contiguous(), cos.contiguous(), sin.contiguous(), slots.contiguous(),
                                     cache, T, rows.stride(0), cache.stride(0), cache.stride(1), R=R, P=C - R,
                                     EPS=float(eps), num_warps=_row_warps(R), **_pdl(kv.device))


# The projections of a decode / verify step (model.linear: every Linear): y = x W^T for M <= SKINNY_MAX_M rows, W
# [N, K] streamed once. cuBLAS runs a split-K GEMM and a separate reduce at these shapes; here program (n block,
# split) multiplies its [BLOCK_N, K / SPLIT] slice of W by all M rows (one tl.dot tile: W's BLOCK_N rows as its
# rows and x^T as its BLOCK_M columns: Hopper's wgmma), and the last split of an n block to finish sums the splits
# in order (the same bits every run; for a row, whatever the other rows of its tile). One launch.

SKINNY_MAX_M = 64
SKINNY = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, max_split=8, waves=1)
SKINNY_MAX_BLOCKS = 4096      # n blocks with a counter each


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, part_ptr, y_ptr, count_ptr, M, N, K, K_SPLIT, stride_x, SPLIT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   PDL: tl.constexpr):
    _gdc(PDL)
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_x
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(split * K_SPLIT, tl.minimum(split * K_SPLIT + K_SPLIT, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :], mask=n_mask[:, None] & (k < K)[None, :],
                    other=0.0)
        if IEEE:      # fp32 (the interpreter's tests): not tf32
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)                                               # [BLOCK_N, BLOCK_M]
    tile = offs_n[:, None] + offs_m[None, :] * N                                            # y[m, n]
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + tile, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split * M * N + tile, acc, mask=mask)
        if _last_to_arrive(count_ptr + pid_n, SPLIT):
            y = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT):                                 # in split order: the same bits each run
                y += tl.load(part_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + tile, y.to(y_ptr.dtype.element_ty), mask=mask)


def _skinny_split(N: int, K: int, device) -> int:
    # slices of K for ~`waves` waves of programs, to the nearest whole split (a split costs its partials and the last
    # program's sum: a part-filled wave is cheaper), each at least one BLOCK_K tile; depends on the shapes of W alone
    n_blocks, tiles = triton.cdiv(N, SKINNY["BLOCK_N"]), triton.cdiv(K, SKINNY["BLOCK_K"])
    return max(1, min(SKINNY["max_split"], tiles, int(SKINNY["waves"] * _sm_count(device) / n_blocks + 0.5)))


def _skinny_fits(x, weight) -> bool:
    # 16-bit only: in fp32 (the exactness tests' dtype) cuBLAS's F.linear in every loop, eager or compiled
    return (_glue(x) and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(-1) == 1 and weight.is_contiguous() and 0 < x.numel() // max(x.shape[-1], 1) <= SKINNY_MAX_M
            and triton.cdiv(weight.shape[0], SKINNY["BLOCK_N"]) <= SKINNY_MAX_BLOCKS)


@register("linear", fits=_skinny_fits)
def linear(x, weight):
    return _skinny(x, weight)


def _skinny(x, weight):
    """x [..., K] @ weight [N, K]^T -> [..., N]"""
    (N, K), M = weight.shape, x.numel() // x.shape[-1]
    x2 = x.reshape(M, x.shape[-1])              # a view for contiguous x and row-strided x
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    split = _skinny_split(N, K, x.device)
    k_split = triton.cdiv(triton.cdiv(K, split), SKINNY["BLOCK_K"]) * SKINNY["BLOCK_K"]
    split = triton.cdiv(K, k_split)                                     # no empty slice
    part = _empty((split, M, N), torch.float32, x.device) if split > 1 else y
    cfg = {k: SKINNY[k] for k in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    _skinny_kernel[(triton.cdiv(N, SKINNY["BLOCK_N"]), split)](
        x2, weight, part, y, _stream_counters(x.device), M, N, K, k_split, x2.stride(0), SPLIT=split,
        BLOCK_M=max(16, triton.next_power_of_2(M)), IEEE=x.dtype == torch.float32, **cfg, **_pdl(x.device))
    return y


# ----------------------------------------------------------------------------------------------------------
# 2. MLA tree attention over the compressed cache (absorbed form). Reference: model.mla_attention.
# Flash-decoding's split + merge with grouped heads, plus a tree mask. Stage 1, grid (query block, split, b): all
# T*H query rows of row b share one K and V (the latent is both), so a program loads each cache tile once for
# BLOCK_Q rows (t, h), runs an online softmax over its split of keys, and writes a normalized partial output and its
# log-sum-exp; stage 2 merges the splits. Visible: slot s < prefix_len[b], or s = prefix_len[b] + j with bit j of the
# query's mask word (tree_mask packed, one int64 per row). The grid depends on shapes only (graph-capturable).

ATTN_BLOCKS = dict(BLOCK_Q=16, BLOCK_S=64, num_warps=4, num_stages=2)   # query rows x keys per tile
# splits for ~`waves` waves of programs, each at least min_split_len keys long (the fp32 partial outputs stay small)
ATTN_SPLITS = dict(max_splits=256, min_split_len=128, waves=2)
# from min_rows query rows (T x local heads): 64-row blocks, so fewer blocks re-read the cache through L2
ATTN_WIDE = dict(min_rows=512, BLOCK_Q=64, BLOCK_S=64, num_warps=8, num_stages=2, waves=1)
ATTN_MERGE = dict(elements=16384, num_warps=4)   # the merge: BLOCK_R latent columns x every split ~ `elements`


@triton.jit
def _split_len(L, NUM_SPLITS, MIN_SPLIT: tl.constexpr, BLOCK_S: tl.constexpr):
    # keys per split for a row with L visible-or-not keys: even split, at least MIN_SPLIT, a whole number of tiles
    n = tl.maximum(tl.cdiv(L, NUM_SPLITS), MIN_SPLIT)
    return tl.cdiv(n, BLOCK_S) * BLOCK_S


@triton.jit
def _mla_split_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, prefix_ptr, mask_ptr, o_ptr, lse_ptr, cos_ptr, sin_ptr,
                      sm_scale, T, H, NUM_SPLITS, stride_cb, stride_cs, stride_qb, stride_qt, stride_qh,
                      stride_pb, stride_pt, stride_ph, stride_mb, stride_mt, R: tl.constexpr, P: tl.constexpr,
                      MIN_SPLIT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr, TREE: tl.constexpr,
                      ROPE: tl.constexpr):
    # the q blocks of one split are launched next to each other, so the cache tiles that the first one reads are
    # still in L2 for the others (the cache is read from HBM about once, not once per block)
    b, split = tl.program_id(2), tl.program_id(1)
    prefix = tl.load(prefix_ptr + b).to(tl.int32)
    L = prefix + T                                   # keys of row b: the prefix, then the T tree slots
    split_len = _split_len(L, NUM_SPLITS, MIN_SPLIT, BLOCK_S)
    s_start = split * split_len
    if s_start >= L:                                 # beyond this row's keys; the merge never reads it
        return
    s_end = tl.minimum(s_start + split_len, L)

    # query rows r = t*H + h of row b (q_lat and q_pe may be strided: read in place)
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_mask = rows < T * H
    offs_r, offs_p = tl.arange(0, R), tl.arange(0, P)
    q_rows = q_lat_ptr + b * stride_qb + (rows // H) * stride_qt + (rows % H) * stride_qh
    q_lat = tl.load(q_rows[:, None] + offs_r[None, :], mask=row_mask[:, None], other=0.0)
    pe_rows = (q_pe_ptr + b * stride_pb + (rows // H) * stride_pt + (rows % H) * stride_ph)[:, None]
    q_pe = tl.load(pe_rows + offs_p[None, :], mask=row_mask[:, None], other=0.0)
    if ROPE:     # q_pe as q_b_proj made it: rotated here as model.rope rotates it (cos, sin [B, T, P])
        partner = tl.load(pe_rows + _partner(offs_p, P, True)[None, :], mask=row_mask[:, None], other=0.0)
        cs = (b * T + rows // H)[:, None] * P + offs_p[None, :]
        q_pe = _rotate(q_pe, partner, tl.load(cos_ptr + cs, mask=row_mask[:, None], other=0.0),
                       tl.load(sin_ptr + cs, mask=row_mask[:, None], other=0.0))
    # each query row's tree-mask row [T] bool, packed once into an int64 word: bit j = tree slot j visible
    j_tree = tl.arange(0, TREE)
    tm = tl.load(mask_ptr + b * stride_mb + (rows // H)[:, None] * stride_mt + j_tree[None, :],
                 mask=row_mask[:, None] & (j_tree < T)[None, :], other=0)
    bits = tl.sum(tl.where(tm != 0, tl.full([BLOCK_Q, TREE], 1, tl.int64) << j_tree[None, :].to(tl.int64), 0), 1)

    m_i = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)                 # running max
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)                               # running sum of exp
    acc = tl.zeros((BLOCK_Q, R), dtype=tl.float32)
    cache_b = cache_ptr + b.to(tl.int64) * stride_cb
    for s0 in range(s_start, s_end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < s_end
        rows_s = cache_b + s[:, None] * stride_cs
        kv = tl.load(rows_s + offs_r[None, :], mask=s_mask[:, None], other=0.0)          # [BS, R] latent = K and V
        k_pe = tl.load(rows_s + R + offs_p[None, :], mask=s_mask[:, None], other=0.0)    # [BS, P] rope part of K
        scores = tl.dot(q_lat, tl.trans(kv), input_precision="ieee")
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision="ieee")
        # fp32 on purpose: a Python float sm_scale may arrive as fp64 (inductor), which would make the softmax fp64
        scores = (scores * sm_scale).to(tl.float32)                                                          # [BQ, BS]

        j = s - prefix                                                             # tree slot index of key s
        in_tree = ((bits[:, None] >> tl.maximum(j, 0)[None, :]) & 1) != 0
        visible = (s < prefix)[None, :] | ((j >= 0)[None, :] & in_tree)
        visible = visible & s_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        # online softmax; m_safe keeps fully masked rows at exp(-inf) = 0 instead of exp(-inf - -inf) = nan
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new

    seen = l_i > 0
    o = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = (b * NUM_SPLITS + split) * T * H + rows              # o_part [B, NS, T*H, R], lse_part [B, NS, T*H]
    tl.store(o_ptr + part[:, None].to(tl.int64) * R + offs_r[None, :], o, mask=row_mask[:, None])
    tl.store(lse_ptr + part, lse, mask=row_mask)


@triton.jit
def _mla_merge_kernel(o_part_ptr, lse_ptr, prefix_ptr, out_ptr, T, H, NUM_SPLITS, R: tl.constexpr,
                      MIN_SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr):
    # Program (b, row, r-block): out = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M), M = max_i lse_i, over the
    # splits i that stage 1 wrote (all of them loaded at once: SPLITS = next power of two >= NUM_SPLITS).
    b, row = tl.program_id(0), tl.program_id(1)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    L = tl.load(prefix_ptr + b).to(tl.int32) + T
    split = tl.arange(0, SPLITS)
    written = split < tl.cdiv(L, _split_len(L, NUM_SPLITS, MIN_SPLIT, BLOCK_S))
    part = (b * NUM_SPLITS + split) * T * H + row
    lse = tl.load(lse_ptr + part, mask=written, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m))                      # 0 for unwritten / empty splits
    o = tl.load(o_part_ptr + part[:, None].to(tl.int64) * R + offs_r[None, :], mask=written[:, None], other=0.0)
    l = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(l > 0, l, 1.0)                  # no visible key -> zeros
    tl.store(out_ptr + (b * T * H + row) * R + offs_r, out.to(out_ptr.dtype.element_ty))


def _num_splits(S: int, max_splits: int, min_split_len: int, waves: float, programs: int, device) -> int:
    # splits of S cache keys for ~`waves` waves of `programs` programs each, at most one per min_split_len keys
    return max(1, min(max_splits, triton.cdiv(S, min_split_len), triton.cdiv(int(waves * _sm_count(device)), programs)))

def _merge_splits(o_part, lse_part, prefix_len, out, T: int, H: int, MIN_SPLIT: int, BLOCK_S: int) -> None:
    # stage 2 of the split attentions: o_part [B, NS, T*H, R] fp32 and lse_part [B, NS, T*H] -> out [B, T, H, R]
    B, num_splits, _, R = o_part.shape
    SPLITS = triton.next_power_of_2(num_splits)
    BLOCK_R = min(R, max(16, 1 << (ATTN_MERGE["elements"] // SPLITS).bit_length() - 1))     # a power of two
    _mla_merge_kernel[(B, T * H, R // BLOCK_R)](
        o_part, lse_part, prefix_len, out, T, H, num_splits, R=R, MIN_SPLIT=MIN_SPLIT, BLOCK_S=BLOCK_S,
        SPLITS=SPLITS, BLOCK_R=BLOCK_R, num_warps=ATTN_MERGE["num_warps"])


ATTN_MAX_T = MASK_WORD_BITS      # each query row's tree-mask row is packed into one word


def _mla_attention_fits(q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale):
    B, T, H, R = q_lat.shape
    return (_gpu(q_lat) and _pow2(R, 16) and _pow2(q_pe.shape[-1], 16) and q_lat.stride(-1) == q_pe.stride(-1) == 1
            and q_lat.dtype == q_pe.dtype == cache.dtype and cache.shape[0] >= B and cache.is_contiguous()
            and isinstance(prefix_len, torch.Tensor)
            and tree_mask.dtype == torch.bool and T <= ATTN_MAX_T and tree_mask.stride(-1) == 1)


@register("mla_attention", fits=_mla_attention_fits)
def mla_attention(q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale):
    return _mla_attention(q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale)


# opaque to torch.compile: inductor would rebuild the kernels from their source; a graph break instead
@torch.compiler.disable
def _mla_attention(q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale, rope=None):
    """rope: (cos, sin) [B, T, P] contiguous: q_pe is not rotated yet; the kernel rotates it as it loads it."""
    (B, T, H, R), P = q_lat.shape, q_pe.shape[-1]
    prefix_len = prefix_len.contiguous()
    cos, sin = rope if rope is not None else (q_pe, q_pe)
    out = _empty(q_lat.shape, q_lat.dtype, q_lat.device)
    wide = T * H >= ATTN_WIDE["min_rows"]
    cfg = {k: ATTN_WIDE[k] for k in ATTN_BLOCKS} if wide else ATTN_BLOCKS
    waves = ATTN_WIDE["waves"] if wide else ATTN_SPLITS["waves"]
    BLOCK_S, MIN_SPLIT = cfg["BLOCK_S"], ATTN_SPLITS["min_split_len"]
    n_qblocks = triton.cdiv(T * H, cfg["BLOCK_Q"])
    num_splits = _num_splits(cache.shape[1], ATTN_SPLITS["max_splits"], MIN_SPLIT, waves, B * n_qblocks, q_lat.device)
    o_part = _empty((B, num_splits, T * H, R), torch.float32, q_lat.device)
    lse_part = _empty((B, num_splits, T * H), torch.float32, q_lat.device)
    _mla_split_kernel[(n_qblocks, num_splits, B)](
        q_lat, q_pe, cache, prefix_len, tree_mask.view(torch.int8), o_part, lse_part, cos, sin,
        softmax_scale, T, H, num_splits, cache.stride(0), cache.stride(1), *q_lat.stride()[:3], *q_pe.stride()[:3],
        *tree_mask.stride()[:2], R=R, P=P, MIN_SPLIT=MIN_SPLIT, TREE=max(16, triton.next_power_of_2(T)),
        ROPE=rope is not None, **cfg)
    _merge_splits(o_part, lse_part, prefix_len, out, T, H, MIN_SPLIT, BLOCK_S)
    return out


# MLA's attention part for decode and verify (model.MLA.attend with a cache, absorbed), model.MLA._absorbed's math in
# fewer launches: q_pe's rope inside the attention kernel (FUSE["q_rope"]), and W_UV multiplying each head's o_lat
# straight into the [B, T, H, v] rows o_proj reads (one bmm writing a strided view of them; the reference's einsum
# leaves [H, B*T, v] to copy). Measured and left out, each slower: W_UK folded into q_b_proj's weight (3x its bytes
# at a few rows), the q_a RMSNorm inside the q_b GEMM, W_UV inside the merge (each merge program would re-read every
# split's latent row).
def _attend_cache(self, q_lat, q_pe, cache, start_pos, tree_mask, rope):
    """Absorbed attention, then W_UV: q_lat [B, T, H, R], q_pe [B, T, H, P] (not rotated yet: rope = (cos, sin)) ->
    [B, T, H, v]."""
    (B, T, H, R), v = q_lat.shape, self.v_dim
    prefix = start_pos if torch.is_tensor(start_pos) else torch.full((B,), start_pos, device=q_lat.device)
    w_uv = self.kv_b_proj.weight.view(H, self.nope + v, R)[:, self.nope:]                         # [H, v, R]
    args = (q_lat, q_pe, cache, prefix, tree_mask, self.softmax_scale)
    fits = _mla_attention_fits(*args)
    if not (fits and FUSE["q_rope"] and all(
            t.shape == (B, T, q_pe.shape[-1]) and t.is_contiguous() and t.dtype == q_pe.dtype for t in rope)):
        q_pe, rope = _OPS["rope"](q_pe, *rope), None
        args = (q_lat, q_pe, *args[2:])
    o_lat = _mla_attention(*args, rope=rope) if fits else _OPS["mla_attention"](*args)
    o = torch.empty(B, T, H, v, dtype=o_lat.dtype, device=o_lat.device)
    torch.bmm(o_lat.reshape(B * T, H, R).transpose(0, 1), w_uv.transpose(1, 2), out=o.view(B * T, H, v).transpose(0, 1))
    return o


@register("MLA.attend", fits=lambda self, x, cos, sin, cache, start_pos, tree_mask, absorb, slots: (
    _glue(x) and absorb and cache is not None))
def mla_attend(self, x, cos, sin, cache, start_pos, tree_mask, absorb, slots):
    (B, T, _), H, R, nope = x.shape, self.n_heads, self.kv_lora_rank, self.nope
    q_a, kv = self.qkv_a_proj(x).split([self.q_lora_rank, R + self.rope_dim], -1)
    q = self.q_b_proj(self.q_a_layernorm(q_a)).view(B, T, H, -1)                              # [B, T, H, qk]
    q_nope, q_pe = q.split([nope, self.rope_dim], dim=-1)
    w_uk = self.kv_b_proj.weight.view(H, nope + self.v_dim, R)[:, :nope]                        # [H, nope, R]
    q_lat = torch.einsum("bthd,hdr->bthr", q_nope, w_uk)                                        # [B, T, H, R]
    n = self.kv_a_layernorm
    _OPS["mla_latent_to_cache"](kv, n.weight, n.eps, cos, sin, cache, slots)
    return _attend_cache(self, q_lat, q_pe, cache[:B], start_pos, tree_mask, (cos, sin))


# ----------------------------------------------------------------------------------------------------------
# 3. The noaux_tc router (model.py): logits = x @ weight^T in fp32, sigmoid scores, top-k of score + bias, weights =
# the chosen scores renormalized and scaled. Reference: model.Gate.forward. Two launches: the matmul in programs of
# BLOCK_T tokens x BLOCK_E experts x one slice of D (on tensor cores; cuBLAS's fp32 GEMM is slower at any row count),
# where the last slice of a block to finish sums the block's slices in a fixed order (the same bits every run); then
# one program per token routes it, and the last of them to finish sorts the (token, k) pairs by expert for the routed
# experts (_sort_pairs), which fused_moe_w4a16 reads instead of sorting them again; beside each token's routing
# program, programs that pack x for the MoE GEMV (_prep_block), which it reads too.

ROUTER_BLOCKS = dict(BLOCK_T=64, BLOCK_E=32, BLOCK_D=64, num_warps=4, num_stages=3)   # BLOCK_T: at most


@triton.jit
def _split_bf16(v):
    # v (fp32) = hi + lo + O(2^-16 |v|), hi and lo bf16: exactly v when v is a bf16 or fp16 value (8 + 8 mantissa bits)
    hi = v.to(tl.bfloat16)
    return hi, (v - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _last_to_arrive(counter_ptr, n):
    # True in the program that arrives n-th at this counter, which it resets to 0 for the next launch. What the
    # others stored before arriving is visible to it: a barrier, then an acq_rel atomic; it reads with .cg (not L1).
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == n - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0)
    return last


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, count_ptr, pair_ids_ptr, slots_ptr, N, E, N_SLOTS,
                  x_ptr, xk_ptr, xs_ptr, D, K: tl.constexpr, K_POW2: tl.constexpr, NORM: tl.constexpr,
                  SCALE: tl.constexpr, E_POW2: tl.constexpr, SORT: tl.constexpr, P_POW2: tl.constexpr,
                  BINS: tl.constexpr, S_POW2: tl.constexpr, PREP: tl.constexpr, D_POW2: tl.constexpr,
                  PREP_W: tl.constexpr, PDL: tl.constexpr):
    _gdc(PDL)
    # program (t, 0), t = token: top-K of sigmoid(logits) + bias by K rounds of one max over int64 keys (the choice's
    # order bits, then the lower id on ties); weights = the chosen scores (without the bias), renormalized, scaled.
    # SORT: the last program to finish sorts every token's pairs by expert. PREP: program (t, j) also packs block j
    # of x's row t for the MoE GEMV (_moe_prep_f16's work, in this launch instead of its own).
    if PREP:
        _prep_block(x_ptr, xk_ptr, xs_ptr, tl.program_id(0), tl.program_id(1), N, D, 1, False, D_POW2, PREP_W)
    if tl.program_id(1) > 0:
        return
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_POW2)
    k = tl.arange(0, K_POW2)
    logits = tl.load(logits_ptr + t * E + e, mask=e < E, other=0.0, cache_modifier=".cg")              # [E]
    choice = tl.sigmoid(logits) + tl.load(bias_ptr + e, mask=e < E, other=0.0)
    key = tl.where(e < E, (_sortable(choice).to(tl.int64) << 32) | (E_POW2 - 1 - e).to(tl.int64), _KEY_NONE)
    ids = tl.zeros([K_POW2], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(key, 0)
        ids = tl.where(k == j, E_POW2 - 1 - (best & 0xFFFFFFFF), ids)
        key = tl.where(key == best, _KEY_NONE, key)
    w = tl.sigmoid(tl.load(logits_ptr + t * E + ids, mask=k < K, other=0.0, cache_modifier=".cg"))      # [K]
    w = tl.where(k < K, w, 0.0)
    if NORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    tl.store(w_ptr + t * K + k, w * SCALE, mask=k < K)
    tl.store(ids_ptr + t * K + k, ids, mask=k < K)
    if SORT:
        if _last_to_arrive(count_ptr, N):
            _sort_pairs(ids_ptr, pair_ids_ptr, slots_ptr, N * K, E, N_SLOTS, P_POW2, BINS, S_POW2)


@triton.jit
def _router_kernel(x_ptr, w_ptr, part_ptr, logits_ptr, count_ptr, N, E, D, D_SPLIT, N_SPLIT: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BF16: tl.constexpr,
                   PDL: tl.constexpr):
    # Program (e block, split, t block): partial logits over columns split*D_SPLIT.. of D -> part[split, t, e]; the
    # block's last program to finish sums its N_SPLIT partials -> logits[t, e].
    # SPLIT_BF16 (GPU): each operand as hi + lo bf16 and three tensor-core dots with fp32 accumulation (lo x lo is
    # below fp32 rounding); for bf16 x and a bf16 checkpoint weight the lo parts are 0 and every product is exact,
    # so only the summation order differs from F.linear in fp32. Else (the interpreter, whose bf16 dot is wrong):
    # one fp32 dot (on a GPU a plain fp32 tl.dot lowers to FMAs, slower than cuBLAS).
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    e_mask, t_mask = offs_e < E, offs_t < N
    _gdc(PDL)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for d0 in range(split * D_SPLIT, tl.minimum(split * D_SPLIT + D_SPLIT, D), BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < D
        x = tl.load(x_ptr + offs_t[:, None] * D + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_e[:, None] * D + d[None, :], mask=e_mask[:, None] & d_mask[None, :], other=0.0)
        if SPLIT_BF16:
            x_hi, x_lo = _split_bf16(x.to(tl.float32))
            w_hi, w_lo = _split_bf16(w)
            acc = tl.dot(x_hi, tl.trans(w_hi), acc)
            acc = tl.dot(x_hi, tl.trans(w_lo), acc)
            acc = tl.dot(x_lo, tl.trans(w_hi), acc)                                         # [BLOCK_T, BLOCK_E]
        else:
            acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    tile = offs_t[:, None] * E + offs_e[None, :]
    mask = t_mask[:, None] & e_mask
    tl.store(part_ptr + split * N * E + tile, acc, mask=mask)
    if _last_to_arrive(count_ptr + tl.program_id(0) * tl.num_programs(2) + tl.program_id(2), N_SPLIT):
        logits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for s in tl.static_range(N_SPLIT):                                   # in split order: the same bits each run
            logits += tl.load(part_ptr + s * N * E + tile, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(logits_ptr + tile, logits, mask=mask)


_COUNTERS: dict = {}    # device -> int32 arrival counters (_last_to_arrive), zero between launches: the router's
ROUTER_MAX_BLOCKS = 1023  # (expert, token) blocks at [0, n_blocks), the route launch's at the last


def _counters(device) -> torch.Tensor:
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(ROUTER_MAX_BLOCKS + 1, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _stream_counters(device) -> torch.Tensor:
    """The skinny GEMM's counters: one set per stream (the shared experts' GEMMs run on a side stream, beside the
    main stream's)"""
    key = (device, torch.cuda.current_stream(device).cuda_stream if torch.device(device).type == "cuda" else 0)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(SKINNY_MAX_BLOCKS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _route_launch(logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm: bool, scale: float, sort: bool,
                  x: torch.Tensor | None = None):
    """logits [N, E] fp32 -> (weights, ids, pairs, prep): sort: pairs = the pairs sorted by expert (_moe_sort's
    output), else None; x [N, D] (16-bit): prep = x packed for the MoE GEMV (_prep_f16's output), else None."""
    (N, E), D = logits.shape, (x.shape[1] if x is not None else 8)
    xk, xs = _prep_buffers(N, D, logits.device) if x is not None else (logits, logits)
    w = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    P = N * top_k
    pair_ids, slots = _empty((P,), torch.int64, logits.device), _empty((min(E, P), 3), torch.int64, logits.device)
    if N:
        blocks = triton.cdiv(D // 8, PREP_BLOCK_W) if x is not None else 1
        _route_kernel[(N, blocks)](logits, bias, w, ids, _counters(logits.device)[-1:], pair_ids, slots, N, E,
                                   slots.shape[0], logits if x is None else x, xk, xs, D, K=top_k,
                                   K_POW2=triton.next_power_of_2(top_k), NORM=norm, SCALE=float(scale),
                                   E_POW2=triton.next_power_of_2(E), SORT=sort, P_POW2=triton.next_power_of_2(P),
                                   BINS=triton.next_power_of_2(E + 1),
                                   S_POW2=triton.next_power_of_2(max(slots.shape[0], 1)), PREP=x is not None,
                                   D_POW2=triton.next_power_of_2(D), PREP_W=PREP_BLOCK_W, **_pdl(logits.device))
    return w, ids, (pair_ids, slots) if sort else None, (xk, xs) if x is not None else None


def _route(x, weight, bias, top_k, norm, scale, prep: bool = False):
    """Gate.forward's work -> (weights, ids, pairs, prep) as _route_launch gives them: two launches (the router
    matmul; the route, which also sorts the pairs and, with prep, packs x for the GEMV)."""
    (N, D), E = x.shape, weight.shape[0]
    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    cfg = dict(ROUTER_BLOCKS)
    cfg["BLOCK_T"] = min(cfg["BLOCK_T"], max(16, triton.next_power_of_2(N)))   # tl.dot's smallest tile is 16
    n_eb, n_tb = triton.cdiv(E, cfg["BLOCK_E"]), triton.cdiv(N, cfg["BLOCK_T"])
    if N == 0 or n_eb * n_tb > ROUTER_MAX_BLOCKS:                            # a long prefill: cuBLAS
        return _route_launch(F.linear(x.float(), weight), bias, top_k, norm, scale, sort=False)
    want_splits = triton.cdiv(2 * _sm_count(x.device), n_eb * n_tb)        # slices of D for ~2 waves of programs
    d_split = triton.cdiv(triton.cdiv(D, want_splits), cfg["BLOCK_D"]) * cfg["BLOCK_D"]   # whole BLOCK_D tiles
    n_split = triton.cdiv(D, d_split)                                       # no empty slice
    part = _empty((n_split, N, E), torch.float32, x.device)                 # [splits, N, E] partial logits
    logits = _empty((N, E), torch.float32, x.device)
    _router_kernel[(n_eb, n_split, n_tb)](x, weight, part, logits, _counters(x.device), N, E, D, d_split,
                                          N_SPLIT=n_split, SPLIT_BF16=not INTERPRETED, **cfg, **_pdl(x.device))
    prep = prep and FUSE["route_prep"] and x.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0
    return _route_launch(logits, bias, top_k, norm, scale, sort=N * top_k <= MOE_SORT_MAX_PAIRS,
                         x=x if prep else None)


def _router_fits(x, weight, bias, top_k, norm, scale, n_group=1, topk_group=1) -> bool:
    # group-limited routing (n_group > 1, DeepSeek-V3) stays with the reference: K2 / K2.6 use one group
    return (_glue(x) and n_group == 1 and x.dim() == 2 and weight.dtype == bias.dtype == torch.float32
            and weight.shape[0] <= ROUTER_MAX_BLOCKS * ROUTER_BLOCKS["BLOCK_E"])     # one token block fits


@register("Gate.forward", fits=lambda self, x: _router_fits(x, self.weight, self.e_score_correction_bias, self.top_k,
                                                             self.norm, self.scale, self.n_group, self.topk_group))
def router(self, x):
    return _route(x, self.weight, self.e_score_correction_bias, self.top_k, self.norm, self.scale)[:2]


# ----------------------------------------------------------------------------------------------------------
# 4. Routed experts straight from the INT4 checkpoint, W4A16 (model.py). Reference: model.Experts.forward. The weights
# are in the compressed-tensors pack-quantized layout (see model.unpack_int4): W [O, I] -> packed [O, I/8] int32,
# column 8k + i in bits 4i..4i+3 of word k, stored as q + 8; scale [O, I/group]; W = q * scale.
# The T*K (token, k) pairs are grouped by expert on the GPU with fixed-shape ops (_moe_sort; no host sync), and
# program `slot` of every grid serves the slot-th *used* expert for all its pairs: an expert that several tokens
# chose (a tree's siblings route alike) is read from HBM once, then from L2.
# Few pairs (decode / verify at one request, 16-bit activations): a bandwidth-bound GEMV, no tl.dot and no dequantized
# tile: each int32 word is reduced against its 8 activations where it was loaded (row strides as arguments: 128-bit
# loads), with Marlin's f16x2 trick in PTX (_DEQUANT_DOT_PTX) on activations packed and scaled by _prep_block (x: in
# the router's route launch where it ran on this x, else in _moe_prep_f16); a run of 4 words (one scale group) is
# summed in f16x2, converted to fp32 once; no load masks when tiles fit (EVEN).
# Stage 1 (gate | up) may split D over SPLIT_K programs when few experts are live (TP8 decode); _moe_prep_f16 then
# sums the slices, applies SwiGLU, packs h for stage 2 (down, x routing weight).
# Many pairs (MOE_MMA_MIN_PAIRS on: batches, prefill) and fp32 activations: one grouped W4A16 kernel, launched for
# gate | up and for down: each weight tile is dequantized in registers once and meets all its expert's pairs
# (BLOCK_M at a time) in tensor-core dots; the gate | up launch stores SwiGLU(gate, up), in the activations' dtype.
# The interpreter (CPU tests) cannot run PTX: there the GEMV uses _dequant_dot_portable, the same data in plain
# Triton. Per-pair buffers, no atomics: the same bits each run.

MOE_GEMV_BLOCKS = dict(gate_up=dict(BLOCK_N=16, BLOCK_W=128, num_warps=4, num_stages=2),    # BLOCK_W int32 words
                       down=dict(BLOCK_N=64, BLOCK_W=64, num_warps=4, num_stages=2))        # = 8 * BLOCK_W columns
MOE_GEMV_MIN_SPLIT_K = 2   # stage 1's least split over D at T > 1 (verify); decode keeps _split_k's choice
MOE_MMA_BLOCKS = dict(gate_up=dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),   # the tensor-core path:
                      down=dict(BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3))      # BLOCK_K columns
MOE_MMA_MIN_PAIRS = 1280   # from this many (token, expert) pairs on, the tensor-core path (16-bit activations)
MOE_MAX_SPLIT_K = 8
MOE_SORT_MAX_PAIRS = 1024  # up to here the pairs are sorted by one program (_moe_sort_kernel); prefill: torch.sort
MOE_PTX = not INTERPRETED and torch.version.hip is None                   # PTX only on NVIDIA hardware


@triton.jit
def _load_slot(slots_ptr):
    slot = slots_ptr + tl.program_id(0) * 3
    return tl.load(slot), tl.load(slot + 1), tl.load(slot + 2)


# --- decode / verify path: GEMV on packed f16x2 activations ---

# acc + sum_i q_i * x_i for one int32 word of 8 nibbles, in f16x2: $1 the word, $2..$5 the f16x2 planes (x0,x4)
# (x1,x5) (x2,x6) (x3,x7), $6 the running f16x2 sum; $0 the new sum. Nibbles 0/4 (mask 0x000F000F) OR'd into fp16
# 1024.0 (0x6400) give 1024 + u; nibbles 1/5 (mask 0x00F000F0) give 1024 + 16u, turned into u - 8 by * 1/16
# (0x2C00) - 72 (0xD480); word >> 8 repeats both for nibbles 2/6 and 3/7. Every step is exact except the f16x2
# products and sums.
_DEQUANT_DOT_PTX = """{
    .reg .b32 w2, t0, t1, t2, t3, m_lo, m_hi, magic, bias, sc, off, s;
    mov.b32 m_lo, 0x000F000F; mov.b32 m_hi, 0x00F000F0; mov.b32 magic, 0x64006400;
    mov.b32 bias, 0x64086408; mov.b32 sc, 0x2C002C00; mov.b32 off, 0xD480D480;
    shr.u32 w2, $1, 8;
    lop3.b32 t0, $1, m_lo, magic, 0xEA; lop3.b32 t1, $1, m_hi, magic, 0xEA;
    lop3.b32 t2, w2, m_lo, magic, 0xEA; lop3.b32 t3, w2, m_hi, magic, 0xEA;
    sub.f16x2 t0, t0, bias; fma.rn.f16x2 t1, t1, sc, off; sub.f16x2 t2, t2, bias; fma.rn.f16x2 t3, t3, sc, off;
    fma.rn.f16x2 s, t0, $2, $6; fma.rn.f16x2 s, t1, $3, s; fma.rn.f16x2 s, t2, $4, s; fma.rn.f16x2 s, t3, $5, s;
    mov.b32 $0, s;
}"""
# the two fp16 halves of an f16x2 sum, added in fp32
_F16X2_SUM_PTX = """{
    .reg .b16 lo, hi; .reg .f32 f0, f1;
    mov.b32 {lo, hi}, $1; cvt.f32.f16 f0, lo; cvt.f32.f16 f1, hi; add.f32 $0, f0, f1;
}"""
# the first word of a run: its products alone (no running sum to add)
_DEQUANT_MUL_PTX = _DEQUANT_DOT_PTX.replace("fma.rn.f16x2 s, t0, $2, $6", "mul.rn.f16x2 s, t0, $2")
if HAS_TRITON:   # a jit global must be constexpr
    _DEQUANT_DOT_PTX, _DEQUANT_MUL_PTX = tl.constexpr(_DEQUANT_DOT_PTX), tl.constexpr(_DEQUANT_MUL_PTX)
    _F16X2_SUM_PTX = tl.constexpr(_F16X2_SUM_PTX)


@triton.jit
def _f16_half(packed, HIGH: tl.constexpr):
    # one fp16 half of f16x2 words, as fp32
    bits = (packed >> 16) if HIGH else packed
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

@triton.jit
def _plane_dot(words, xp, p: tl.constexpr):
    # nibbles p and p + 4 of each word times plane p's two halves, fp32
    q_lo = ((words >> (4 * p)) & 0xF) - 8
    q_hi = ((words >> (4 * p + 16)) & 0xF) - 8
    return q_lo.to(tl.float32) * _f16_half(xp, False) + q_hi.to(tl.float32) * _f16_half(xp, True)

@triton.jit
def _dequant_dot_portable(words, x04, x15, x26, x37):
    # the PTX's data in plain Triton (fp32 products and sums): what the interpreter runs. [BN, BW] one sum per word
    acc = tl.zeros(words.shape, dtype=tl.float32) + _plane_dot(words, x04, 0) + _plane_dot(words, x15, 1)
    return acc + _plane_dot(words, x26, 2) + _plane_dot(words, x37, 3)

@triton.jit
def _dequant_dot_word(words, x04, x15, x26, x37, acc, FIRST: tl.constexpr):
    # acc + this word's 8 products (f16x2); FIRST: no acc yet (a mul instead of zeroing a register per run)
    if FIRST:
        return tl.inline_asm_elementwise(_DEQUANT_MUL_PTX, "=r,r,r,r,r,r", [words, x04, x15, x26, x37],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_DEQUANT_DOT_PTX, "=r,r,r,r,r,r,r", [words, x04, x15, x26, x37, acc],
                                         dtype=tl.int32, is_pure=True, pack=1)

@triton.jit
def _halves(v):
    # [R, 2C] -> (columns 0, 2, 4, ..., columns 1, 3, 5, ...), [R, C] each
    return tl.split(tl.reshape(v, (v.shape[0], v.shape[1] // 2, 2)))

@triton.jit
def _split_words(w, a, b, c, d):
    # words w and their four activation planes a..d -> the even columns of all five, then the odd ones
    w0, w1 = _halves(w)
    a0, a1 = _halves(a)
    b0, b1 = _halves(b)
    c0, c1 = _halves(c)
    d0, d1 = _halves(d)
    return w0, a0, b0, c0, d0, w1, a1, b1, c1, d1

@triton.jit
def _dequant_dot_runs(words, x04, x15, x26, x37, RUN: tl.constexpr):
    # [BN, BW] words -> [BN, BW // RUN] fp32: each a sum over RUN consecutive words (RUN in 1, 2, 4) accumulated in
    # f16x2 and converted once, not per word. |sum| <= 16 RUN * 8 * 2 (|q| <= 8, |x| < 2): no overflow.
    if RUN == 1:
        acc = _dequant_dot_word(words, x04, x15, x26, x37, None, True)
    else:
        w_e, a_e, b_e, c_e, d_e, w_o, a_o, b_o, c_o, d_o = _split_words(words, x04, x15, x26, x37)
        if RUN == 2:                        # words 2r and 2r+1 of run r
            acc = _dequant_dot_word(w_e, a_e, b_e, c_e, d_e, None, True)
            acc = _dequant_dot_word(w_o, a_o, b_o, c_o, d_o, acc, False)
        else:                               # RUN == 4: halve again -> words 4r, 4r+2 and 4r+1, 4r+3
            w0, a0, b0, c0, d0, w2, a2, b2, c2, d2 = _split_words(w_e, a_e, b_e, c_e, d_e)
            w1, a1, b1, c1, d1, w3, a3, b3, c3, d3 = _split_words(w_o, a_o, b_o, c_o, d_o)
            acc = _dequant_dot_word(w0, a0, b0, c0, d0, None, True)
            acc = _dequant_dot_word(w1, a1, b1, c1, d1, acc, False)
            acc = _dequant_dot_word(w2, a2, b2, c2, d2, acc, False)
            acc = _dequant_dot_word(w3, a3, b3, c3, d3, acc, False)
    return tl.inline_asm_elementwise(_F16X2_SUM_PTX, "=r,r", [acc], dtype=tl.int32, is_pure=True,
                                     pack=1).to(tl.float32, bitcast=True)

@triton.jit
def _weight_tile(w_rows, s_rows, n_words, w0, n_mask, GW: tl.constexpr, BLOCK_W: tl.constexpr, EVEN: tl.constexpr):
    # Rows n of W (pointers w_rows / s_rows [BLOCK_N, 1]), words w0 .. w0+BLOCK_W: ([BN, BW] int32 words, their
    # [BN, BW // GW] fp32 group scales). EVEN: whole tiles only, so no masks (a masked load zeroes registers first).
    ww = w0 + tl.arange(0, BLOCK_W)
    offs_g = w0 // GW + tl.arange(0, BLOCK_W // GW)
    w_mask = None if EVEN else n_mask[:, None] & (ww < n_words)[None, :]
    g_mask = None if EVEN else n_mask[:, None] & (offs_g < n_words // GW)[None, :]
    z = None if EVEN else 0                                                     # `other` needs a mask
    words = tl.load(w_rows + ww[None, :], mask=w_mask, other=z)
    s = tl.load(s_rows + offs_g[None, :], mask=g_mask, other=z)
    return words, s.to(tl.float32)

@triton.jit
def _tile_dot(words, s, xk_row, n_words, w0, GW: tl.constexpr, BLOCK_W: tl.constexpr, PTX: tl.constexpr,
              EVEN: tl.constexpr):
    # a weight tile (_weight_tile) times one packed activation row xk_row [4, n_words] over the same words:
    # [BN, BW // GW] fp32, one sum per scale group (GW words), already scaled
    BLOCK_N: tl.constexpr = words.shape[0]
    ww = w0 + tl.arange(0, BLOCK_W)
    w_mask = None if EVEN else ww < n_words
    z = None if EVEN else 0
    x04 = tl.broadcast_to(tl.load(xk_row + ww, mask=w_mask, other=z)[None, :], (BLOCK_N, BLOCK_W))       # f16x2 planes
    x15 = tl.broadcast_to(tl.load(xk_row + n_words + ww, mask=w_mask, other=z)[None, :], (BLOCK_N, BLOCK_W))
    x26 = tl.broadcast_to(tl.load(xk_row + 2 * n_words + ww, mask=w_mask, other=z)[None, :], (BLOCK_N, BLOCK_W))
    x37 = tl.broadcast_to(tl.load(xk_row + 3 * n_words + ww, mask=w_mask, other=z)[None, :], (BLOCK_N, BLOCK_W))
    if PTX:   # runs of words summed in f16x2 within a group: 4 words if the group has a multiple of 4, else 2 or 1
        RUN: tl.constexpr = 4 if GW % 4 == 0 else (2 if GW % 2 == 0 else 1)
        d = _dequant_dot_runs(words, x04, x15, x26, x37, RUN)                  # [BN, BW // RUN]
    else:
        d = _dequant_dot_portable(words, x04, x15, x26, x37)                   # [BN, BW]
    return tl.sum(tl.reshape(d, (BLOCK_N, BLOCK_W // GW, d.shape[1] // (BLOCK_W // GW))), 2) * s

@triton.jit
def _prep_values(src_ptr, row, P, N, SPLIT_K, cols, mask, SWIGLU: tl.constexpr):
    # columns `cols` of one activation row, fp32: x[row, cols], or h = silu(sum_s gate) * (sum_s up) from gu
    # [SPLIT_K, P, 2N] (stage 1's split sums: SwiGLU needs the complete ones)
    if SWIGLU:
        gate = tl.zeros(cols.shape, dtype=tl.float32)
        up = tl.zeros(cols.shape, dtype=tl.float32)
        for s in range(0, SPLIT_K):
            gu_row = src_ptr + (s * P + row) * (2 * N)
            gate += tl.load(gu_row + cols, mask=mask, other=0.0)
            up += tl.load(gu_row + N + cols, mask=mask, other=0.0)
        v = gate * tl.sigmoid(gate) * up
    else:
        v = tl.load(src_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    return v

@triton.jit
def _moe_prep_f16(src_ptr, xk_ptr, xs_ptr, P, N, SPLIT_K,
                  SWIGLU: tl.constexpr, N_POW2: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    _gdc(PDL)
    _prep_block(src_ptr, xk_ptr, xs_ptr, tl.program_id(0), tl.program_id(1), P, N, SPLIT_K, SWIGLU, N_POW2, BLOCK_W)


@triton.jit
def _prep_block(src_ptr, xk_ptr, xs_ptr, row, block, P, N, SPLIT_K, SWIGLU: tl.constexpr, N_POW2: tl.constexpr,
                BLOCK_W: tl.constexpr):
    # Program (row, block): words block*BLOCK_W.. of one activation row of N -> xk[row] [4, N/8] int32 f16x2 planes
    # (plane p, word w = (x[8w+p], x[8w+p+4])), scaled by 2^-e with e = floor(log2 max |x|); xs[row] = 2^e. Every
    # program of a row reads the whole row for the max (a few KB, from L2): one parallel pass, not a serial one.
    cols = tl.arange(0, N_POW2)
    m = tl.max(tl.abs(_prep_values(src_ptr, row, P, N, SPLIT_K, cols, cols < N, SWIGLU)), 0)
    e = tl.where(m > 0, tl.floor(tl.log2(tl.where(m > 0, m, 1.0))), 0.0)
    if block == 0:
        tl.store(xs_ptr + row, tl.exp2(e))
    scale = tl.exp2(-e)                                                      # a power of two: exact
    NW = N // 8
    ww = block * BLOCK_W + tl.arange(0, BLOCK_W)
    wm = ww < NW
    for p in tl.static_range(4):
        lo = (_prep_values(src_ptr, row, P, N, SPLIT_K, ww * 8 + p, wm, SWIGLU) * scale).to(tl.float16)
        hi = (_prep_values(src_ptr, row, P, N, SPLIT_K, ww * 8 + p + 4, wm, SWIGLU) * scale).to(tl.float16)
        packed = ((lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF)
                  | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16))
        tl.store(xk_ptr + row * (4 * NW) + p * NW + ww, packed, mask=wm)


PREP_BLOCK_W = 128     # words of a row per program


def _prep_buffers(rows: int, N: int, device):
    return _empty((rows, 4, N // 8), torch.int32, device), _empty((rows,), torch.float32, device)


def _prep_f16(src, rows: int, N: int, split_k: int, swiglu: bool):
    """src: x [rows, N] or gu [split_k, rows, 2N] -> (packed planes [rows, 4, N/8] int32, scales [rows] fp32)."""
    xk, xs = _prep_buffers(rows, N, src.device)
    _moe_prep_f16[(rows, triton.cdiv(N // 8, PREP_BLOCK_W))](src, xk, xs, rows, N, split_k, SWIGLU=swiglu,
                                                              N_POW2=triton.next_power_of_2(N), BLOCK_W=PREP_BLOCK_W,
                                                              **_pdl(src.device))
    return xk, xs

@triton.jit
def _moe_gate_up_gemv(xk_ptr, xs_ptr, w_ptr, s_ptr, gu_ptr, pair_ptr, slots_ptr, I, K, P, DW, DG,
                      GROUP: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                      PTX: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    # Program (slot, pid_n, split): rows pid_n*BLOCK_N.. of gate and of up of the slot-th used expert over the split-th
    # slice of D, for each of its pairs in turn (the repeats from L2) -> gu[split, pair] (gate 0..I-1, up I..2I-1).
    # DW = D/8 and DG = D/group are arguments (not D // 8 here) so the compiler sees them divisible by 16.
    _gdc(PDL)
    e, start, count = _load_slot(slots_ptr)
    if count == 0:
        return
    split = tl.program_id(2)
    GW: tl.constexpr = GROUP // 8
    w_len = tl.cdiv(tl.cdiv(DW, BLOCK_W), SPLIT_K) * BLOCK_W                 # a whole number of tiles per split
    w_start = split * w_len
    w_end = tl.minimum(w_start + w_len, DW)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    w_gate = w_ptr + e * (2 * I) * DW + offs_n[:, None] * DW                 # gate rows 0..I-1, up rows I..2I-1
    s_gate = s_ptr + e * (2 * I) * DG + offs_n[:, None] * DG
    for i in range(0, count):                                                # usually one
        pair = tl.load(pair_ptr + start + i)                                 # pair = t*K + k
        xk_row = xk_ptr + (pair // K) * 4 * DW
        acc_g = tl.zeros((BLOCK_N, BLOCK_W // GW), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_W // GW), dtype=tl.float32)
        for w0 in range(w_start, w_end, BLOCK_W):                             # empty slice: zeros
            wg, sg = _weight_tile(w_gate, s_gate, DW, w0, n_mask, GW, BLOCK_W, EVEN)
            wu, su = _weight_tile(w_gate + I * DW, s_gate + I * DG, DW, w0, n_mask, GW, BLOCK_W, EVEN)
            acc_g += _tile_dot(wg, sg, xk_row, DW, w0, GW, BLOCK_W, PTX, EVEN)
            acc_u += _tile_dot(wu, su, xk_row, DW, w0, GW, BLOCK_W, PTX, EVEN)
        g, u = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
        xs = tl.load(xs_ptr + pair // K)                                     # undo the activation scale
        out = gu_ptr + (split * P + pair) * (2 * I) + offs_n
        tl.store(out, g * xs, mask=n_mask)
        tl.store(out + I, u * xs, mask=n_mask)


@triton.jit
def _moe_down_gemv(hk_ptr, hs_ptr, w_ptr, s_ptr, topk_w_ptr, y_ptr, pair_ptr, slots_ptr, D, IW, IG,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PTX: tl.constexpr,
                   EVEN: tl.constexpr, PDL: tl.constexpr):
    # Program (slot, pid_n): output columns pid_n*BLOCK_N.. of down_proj for the slot-th used expert's pairs, times
    # each pair's routing weight -> y[pair]
    _gdc(PDL)
    e, start, count = _load_slot(slots_ptr)
    if count == 0:
        return
    GW: tl.constexpr = GROUP // 8
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    w_rows = w_ptr + e * D * IW + offs_n[:, None] * IW
    s_rows = s_ptr + e * D * IG + offs_n[:, None] * IG
    for i in range(0, count):
        pair = tl.load(pair_ptr + start + i)
        hk_row = hk_ptr + pair * 4 * IW
        acc = tl.zeros((BLOCK_N, BLOCK_W // GW), dtype=tl.float32)
        for w0 in range(0, IW, BLOCK_W):
            w, sc = _weight_tile(w_rows, s_rows, IW, w0, n_mask, GW, BLOCK_W, EVEN)
            acc += _tile_dot(w, sc, hk_row, IW, w0, GW, BLOCK_W, PTX, EVEN)
        y = tl.sum(acc, 1) * (tl.load(hs_ptr + pair) * tl.load(topk_w_ptr + pair))
        tl.store(y_ptr + pair * D + offs_n, y, mask=n_mask)


# --- many rows per expert (batches, prefill) and fp32 activations: tensor-core tiles ---

@triton.jit
def _w4_tile(w_rows, s_rows, k0, K, n_mask, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, S_PAIRS: tl.constexpr,
             dtype: tl.constexpr):
    # Columns k0 .. k0 + BLOCK_K of W's rows (pointers w_rows / s_rows [BN, 1]) -> [BN, BK] in dtype: column 8w + i
    # is nibble i of word w less 8, x its group's scale, both exact in the activations' dtype: one rounding, as the
    # reference's dequantization. Built as 8 tiles [BN, BK/8] (nibble i of every word) joined, not as one shift over a
    # broadcast [BN, BK/8, 8]: a thread then loads each packed word it takes from shared memory once, where the
    # broadcast's layout spread one word's nibbles over threads that each loaded it
    ww = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_rows + ww[None, :], mask=n_mask[:, None] & (ww < K // 8)[None, :], other=0)     # [BN, BK/8]
    s = _scales(s_rows, k0 // GROUP, K // GROUP, n_mask, BLOCK_K // GROUP, S_PAIRS)                   # [BN, BK/G]
    BN: tl.constexpr = words.shape[0]
    s = tl.broadcast_to(s.to(dtype)[:, :, None], (BN, BLOCK_K // GROUP, GROUP // 8))
    s = tl.reshape(s, (BN, BLOCK_K // 8))                                                            # each word's
    q = tl.join(tl.join(tl.join(_nibble(words, 0, s), _nibble(words, 4, s)),                         # [BN, BK/8, 2,
                        tl.join(_nibble(words, 2, s), _nibble(words, 6, s))),                        #  2, 2]: nibble
                tl.join(tl.join(_nibble(words, 1, s), _nibble(words, 5, s)),                         #  4a + 2b + c
                        tl.join(_nibble(words, 3, s), _nibble(words, 7, s))))
    return tl.reshape(q, (BN, BLOCK_K))


@triton.jit
def _nibble(words, i: tl.constexpr, s):
    # nibble i of each word - 8, x the word's scale (exact x exact: one rounding), in the scale's dtype
    return _nibble_minus_8((words >> (4 * i)) & 0xF, s.dtype) * s


@triton.jit
def _nibble_minus_8(q, dtype: tl.constexpr):
    # nibbles q (int32, 0..15) -> q - 8 in dtype, exact, without an int-to-float conversion: the float 2^m + q has
    # 2^m's bits with q in the low mantissa bits (an OR), less 2^m + 8
    if dtype == tl.float32:
        v = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0                          # 2^23 + q - (2^23 + 8)
    elif dtype == tl.bfloat16:
        v = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0                        # 128 + q - 136
    else:
        v = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0                        # 1024 + q - 1032
    return v


@triton.jit
def _scales(s_rows, g0, KG, n_mask, NG: tl.constexpr, S_PAIRS: tl.constexpr):
    # Scales g0 .. g0 + NG of each row -> [BN, NG] fp32. S_PAIRS (bf16 scales, an even number a row, 4-byte aligned):
    # read in pairs as int32 (a bf16 is the high half of an fp32), 4-byte loads, which the compiler stages ahead of
    # the dots like the weights; it does not stage 2-byte loads
    if S_PAIRS and NG % 2 == 0:
        gp = g0 // 2 + tl.arange(0, NG // 2)
        v = tl.load(s_rows.to(tl.pointer_type(tl.int32)) + gp[None, :], mask=n_mask[:, None] & (gp < KG // 2)[None, :],
                    other=0)                                                                       # [BN, NG/2]
        lo, hi = (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(lo, hi), (v.shape[0], NG))
    gg = g0 + tl.arange(0, NG)
    return tl.load(s_rows + gg[None, :], mask=n_mask[:, None] & (gg < KG)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _moe_mma_kernel(a_ptr, w_ptr, s_ptr, topk_w_ptr, out_ptr, pair_ptr, slots_ptr, N, K, A_STRIDE, ROWS_PER,
                    GROUP: tl.constexpr, GATE_UP: tl.constexpr, S_PAIRS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # Program (slot, pid_n): BLOCK_M pairs at a time of the slot-th used expert, A's rows (row pair // ROWS_PER of
    # a_ptr) times W^T. GATE_UP: W = w13 [2N, K], h[pair, n] = SwiGLU(gate row n, up row N + n) in h's dtype; else
    # W = w2 [N, K], out[pair, n] fp32 x the pair's routing weight. Each weight tile is loaded and dequantized once
    # for all the pairs, then meets them in one tensor-core dot with W as the tile's rows (the dot's M: wgmma wants
    # 64; the pairs are its N).
    _gdc(PDL)
    e, start, count = _load_slot(slots_ptr)
    if count == 0:
        return
    KG = K // GROUP
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    n_rows = 2 * N if GATE_UP else N
    w_rows = w_ptr + e * n_rows * (K // 8) + offs_n[:, None] * (K // 8)
    s_rows = s_ptr + e * n_rows * KG + offs_n[:, None] * KG
    dtype = s_ptr.dtype.element_ty
    for m0 in range(0, count, BLOCK_M):                                       # usually one pass
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        pair = tl.load(pair_ptr + start + offs_m, mask=m_mask, other=0)      # pair = t*k + j
        a_rows = a_ptr + (pair // ROWS_PER) * A_STRIDE
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                  # (gate) out^T
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                # up^T
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            a = tl.load(a_rows[None, :] + kk[:, None], mask=m_mask[None, :] & k_mask[:, None], other=0.0)  # [BK, BM]
            w = _w4_tile(w_rows, s_rows, k0, K, n_mask, GROUP, BLOCK_K, S_PAIRS, dtype)                  # [BN, BK]
            acc = tl.dot(w, a, acc, input_precision="ieee")
            if GATE_UP:
                w_up = _w4_tile(w_rows + N * (K // 8), s_rows + N * KG, k0, K, n_mask, GROUP, BLOCK_K, S_PAIRS, dtype)
                acc_u = tl.dot(w_up, a, acc_u, input_precision="ieee")
        if GATE_UP:
            out = tl.trans(acc * tl.sigmoid(acc) * acc_u).to(out_ptr.dtype.element_ty)             # [BM, BN]
        else:
            out = tl.trans(acc) * tl.load(topk_w_ptr + pair, mask=m_mask, other=0.0)[:, None]
        tl.store(out_ptr + pair[:, None] * N + offs_n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])


def _split_k(n_units: int, n_programs: int, device) -> int:
    # slices of the reduction dim so that ~2 waves of programs fill the GPU
    return max(1, min(MOE_MAX_SPLIT_K, n_units, triton.cdiv(2 * _sm_count(device), n_programs)))

def _even(n_rows: int, n_words: int, cfg: dict) -> bool:
    # the GEMV tiles cover the weight exactly (K2.6 at any TP), so its loads need no masks
    return n_rows % cfg["BLOCK_N"] == 0 and n_words % cfg["BLOCK_W"] == 0


def _moe_gemv(x, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size, pair_ids, slots, y, prep=None):
    (T, D), P, n_slots, I = x.shape, y.shape[0], slots.shape[0], w13_packed.shape[1] // 2
    K = P // T
    xk, xs = prep or _prep_f16(x, T, D, 1, swiglu=False)                  # packed f16x2 planes, their scales
    cfg = MOE_GEMV_BLOCKS["gate_up"]
    n_blocks = triton.cdiv(I, cfg["BLOCK_N"])
    n_tiles = triton.cdiv(D // 8, cfg["BLOCK_W"])
    split_min = MOE_GEMV_MIN_SPLIT_K if T > 1 else 1                         # verify steps (see the constant)
    split_k = max(min(split_min, n_tiles), _split_k(n_tiles, n_slots * n_blocks, x.device))
    gu = _empty((split_k, P, 2 * I), torch.float32, x.device)
    _moe_gate_up_gemv[(n_slots, n_blocks, split_k)](
        xk, xs, w13_packed, w13_scale, gu, pair_ids, slots, I, K, P, D // 8, D // group_size,
        GROUP=group_size, SPLIT_K=split_k, PTX=MOE_PTX, EVEN=_even(I, D // 8, cfg), **cfg,
        **_pdl(x.device))
    hk, hs = _prep_f16(gu, P, I, split_k, swiglu=True)                      # h = SwiGLU, packed the same way
    cfg = dict(MOE_GEMV_BLOCKS["down"])
    cfg["BLOCK_W"] = min(cfg["BLOCK_W"], triton.next_power_of_2(I // 8))   # no wider than a row (TP8: 32 words)
    _moe_down_gemv[(n_slots, triton.cdiv(D, cfg["BLOCK_N"]))](
        hk, hs, w2_packed, w2_scale, topk_weights, y, pair_ids, slots, D, I // 8, I // group_size,
        GROUP=group_size, PTX=MOE_PTX, EVEN=_even(D, I // 8, cfg), **cfg,
        **_pdl(x.device))


def _mma_block_m(P: int, n_slots: int) -> int:
    # pairs per tile: the mean pairs per used expert, as a power of two in [16, 64] (16: tl.dot's least)
    return min(64, max(16, triton.next_power_of_2(triton.cdiv(P, max(n_slots, 1)))))


def _scale_pairs(scale: torch.Tensor) -> bool:
    # the tensor-core kernel may read these scales two at a time as int32 (_scales)
    return scale.dtype == torch.bfloat16 and scale.shape[-1] % 2 == 0 and scale.data_ptr() % 4 == 0


def _moe_mma(x, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size, pair_ids, slots, y, prep=None):
    (T, D), P, n_slots, I = x.shape, y.shape[0], slots.shape[0], w13_packed.shape[1] // 2
    cfg = dict(GROUP=group_size, BLOCK_M=_mma_block_m(P, n_slots), **_pdl(x.device))
    h = _empty((P, I), x.dtype, x.device)                                    # SwiGLU(gate, up) per pair
    c = MOE_MMA_BLOCKS["gate_up"]
    _moe_mma_kernel[(n_slots, triton.cdiv(I, c["BLOCK_N"]))](
        x, w13_packed, w13_scale, topk_weights, h, pair_ids, slots, I, D, D, P // max(T, 1),
        GATE_UP=True, S_PAIRS=_scale_pairs(w13_scale), **c, **cfg)
    c = MOE_MMA_BLOCKS["down"]
    _moe_mma_kernel[(n_slots, triton.cdiv(D, c["BLOCK_N"]))](
        h, w2_packed, w2_scale, topk_weights, y, pair_ids, slots, D, I, I, 1,
        GATE_UP=False, S_PAIRS=_scale_pairs(w2_scale), **c, **cfg)


@triton.jit
def _sort_pairs(ids_ptr, pair_ids_ptr, slots_ptr, P, E, N_SLOTS, P_POW2: tl.constexpr, BINS: tl.constexpr,
                S_POW2: tl.constexpr):
    # The (token, k) pairs sorted by expert (keys expert * P_POW2 + pair: unique, so the order within an expert is
    # the pair order), per-expert counts by histogram (BINS > E: a bin E for the padding), and the slot table of the
    # used experts in id order.
    p = tl.arange(0, P_POW2)
    ids = tl.load(ids_ptr + p, mask=p < P, other=E, cache_modifier=".cg").to(tl.int32)   # padding pairs: bin E
    key = tl.sort(ids * P_POW2 + p)
    tl.store(pair_ids_ptr + p, (key % P_POW2).to(tl.int64), mask=p < P)
    e = tl.arange(0, BINS)
    count = tl.histogram(ids, BINS)
    used = (count > 0) & (e < E)
    slot = tl.cumsum(used.to(tl.int32), 0) - 1
    first = tl.cumsum(count, 0) - count                                # first sorted pair of expert e
    tl.store(slots_ptr + slot * 3, e.to(tl.int64), mask=used)
    tl.store(slots_ptr + slot * 3 + 1, first.to(tl.int64), mask=used)
    tl.store(slots_ptr + slot * 3 + 2, count.to(tl.int64), mask=used)
    s = tl.arange(0, S_POW2)                                           # slots past the used experts: count 0, exit
    rest = (s >= tl.sum(used.to(tl.int32), 0)) & (s < N_SLOTS)
    for f in tl.static_range(3):
        tl.store(slots_ptr + s * 3 + f, tl.zeros([S_POW2], dtype=tl.int64), mask=rest)


@triton.jit
def _moe_sort_kernel(ids_ptr, pair_ids_ptr, slots_ptr, P, E, N_SLOTS,
                     P_POW2: tl.constexpr, BINS: tl.constexpr, S_POW2: tl.constexpr):
    # one program: _sort_pairs
    _sort_pairs(ids_ptr, pair_ids_ptr, slots_ptr, P, E, N_SLOTS, P_POW2, BINS, S_POW2)


def _moe_sort(topk_ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> pair_ids [T*K] (pairs t*K + k grouped by expert, in expert id order) and slots
    [min(E, T*K), 3] int64 = (expert, first index into pair_ids, pair count) of the used experts in id order, then
    (0, 0, 0) rows. One launch at decode / verify sizes; prefill: a sort and a few fixed-shape ops."""
    P, device = topk_ids.numel(), topk_ids.device
    if P <= MOE_SORT_MAX_PAIRS:
        slots = _empty((min(E, P), 3), torch.int64, device)
        pair_ids = _empty((P,), torch.int64, device)
        _moe_sort_kernel[(1,)](topk_ids, pair_ids, slots, P, E, slots.shape[0], P_POW2=triton.next_power_of_2(P),
                               BINS=triton.next_power_of_2(E + 1), S_POW2=triton.next_power_of_2(slots.shape[0]),
                               num_warps=4)
        return pair_ids, slots
    sorted_ids, pair_ids = torch.sort(topk_ids.view(-1))                                          # [P], [P]
    bounds = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=device))                   # [E+1]
    count = bounds[1:] - bounds[:-1]                                                              # [E] pairs
    e = torch.sort((count == 0).to(torch.int8), stable=True).indices[:min(E, P)]  # used experts first, in id order
    return pair_ids, torch.stack([e, bounds[e], count[e]], 1) * (count[e] > 0)[:, None]


@triton.jit
def _moe_sum_kernel(y_ptr, shared_ptr, out_ptr, D, K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    _gdc(PDL)
    # program (token t, column block): out[t] = sum over k of y[t, k] (the pairs' weighted outputs), + shared[t]
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(y_ptr + (t * K + k) * D + cols, mask=mask, other=0.0)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t * D + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + cols, acc, mask=mask)


_SIDE: dict = {}        # device -> the side stream the shared experts run on


def _side_stream(device) -> "torch.cuda.Stream":
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def _int4_weights_fit(x, w13_packed, w13_scale, w2_packed, w2_scale, group_size) -> bool:
    D, I = x.shape[1], w2_packed.shape[-1] * 8
    return (_gpu(x) and D % group_size == 0 and I % group_size == 0 and group_size % 8 == 0
            and all(8 * c["BLOCK_W"] % group_size == 0 for c in MOE_GEMV_BLOCKS.values())
            and all(c["BLOCK_K"] % group_size == 0 for c in MOE_MMA_BLOCKS.values())
            and x.dtype == w13_scale.dtype == w2_scale.dtype
            and all(w.is_contiguous() for w in (w13_packed, w13_scale, w2_packed, w2_scale)))


def _gemv_wins(x: torch.Tensor, P: int) -> bool:
    """Few (token, expert) pairs: the GEMV, at the weights' bandwidth; many: tensor-core tiles, which read each
    expert once for all its pairs (the GEMV takes them one after another)."""
    return x.dtype != torch.float32 and P < MOE_MMA_MIN_PAIRS


def _routed(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size, pairs=None,
            prep=None) -> torch.Tensor:
    """-> y [T*K, D] fp32: pair t*K + k's expert output times its routing weight. pairs / prep: the route launch's
    (the pairs sorted by expert, x packed for the GEMV), where it made them."""
    (T, D), K = x.shape, topk_ids.shape[1]
    pair_ids, slots = pairs if pairs is not None else _moe_sort(topk_ids, w13_packed.shape[0])
    y = _empty((T * K, D), torch.float32, x.device)                          # per pair, weighted by topk_weights
    path = _moe_gemv if _gemv_wins(x, T * K) else _moe_mma
    path(x, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size, pair_ids, slots, y, prep)
    return y


def _sum_pairs(y: torch.Tensor, T: int, K: int, shared: torch.Tensor | None = None) -> torch.Tensor:
    """y [T*K, D] -> [T, D] fp32: each token's K pairs summed (+ shared[t], the shared experts)."""
    D = y.shape[1]
    out = torch.empty(T, D, dtype=torch.float32, device=y.device)
    if T:
        BLOCK = 256                                                          # enough programs for T = 9 x 7168
        _moe_sum_kernel[(T, triton.cdiv(D, BLOCK))](y, y if shared is None else shared, out, D, K=K,
                                                    HAS_SHARED=shared is not None, BLOCK=BLOCK, **_pdl(y.device))
    return out


# opaque to torch.compile: inductor would rebuild the kernels from their source, inline PTX included
@torch.compiler.disable
def fused_moe_w4a16(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32):
    x, topk_ids, topk_weights = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    y = _routed(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size)
    return _sum_pairs(y, *topk_ids.shape)


# The routed experts alone (model.Experts.forward): where the MoE part runs its reference (torch.compile, a router
# the launcher doesn't take), its INT4 experts still take the grouped kernels.
def _experts_fits(self, x, weights, ids) -> bool:
    return (self.quant is not None and ids.dtype == torch.int64 and weights.dtype == torch.float32
            and _int4_weights_fit(x, self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale,
                                  self.quant.group_size))


@register("Experts.forward", fits=_experts_fits)
def experts_forward(self, x, weights, ids):
    return fused_moe_w4a16(x, ids, weights, self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale,
                           self.quant.group_size)


# The MoE part of a block (model.MoE.local): router, routed experts, shared experts, their sum, chosen whole so its
# kernels can pass each other what the op boundaries would hide: the route launch sorts the pairs by expert and
# packs x for the GEMV; the shared experts run on a side stream beside the routed launches (in a CUDA graph, two
# branches) and are added in the pass that sums the pairs.
def _moe_fits(self, x) -> bool:
    ex, gate = self.experts, self.gate    # self: the model.MoE, as MoE.local gets it
    return (ex.quant is not None
            and _router_fits(x, gate.weight, gate.e_score_correction_bias, gate.top_k, gate.norm, gate.scale,
                             gate.n_group, gate.topk_group)
            and _int4_weights_fit(x, ex.w13_packed, ex.w13_scale, ex.w2_packed, ex.w2_scale, ex.quant.group_size))


@register("MoE.local", fits=_moe_fits)
@torch.compiler.disable
def moe_local(self, x):
    gate, ex, x = self.gate, self.experts, x.contiguous()
    main = torch.cuda.current_stream(x.device) if x.is_cuda else None      # (the interpreter: one CPU stream)
    side = _side_stream(x.device) if main is not None else None
    if side is not None:
        side.wait_stream(main)                                               # x is ready
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        shared = self.shared_experts(x)
    w, ids, pairs, prep = _route(x, gate.weight, gate.e_score_correction_bias, gate.top_k, gate.norm, gate.scale,
                                 prep=_gemv_wins(x, x.shape[0] * gate.top_k))
    y = _routed(x, ids, w, ex.w13_packed, ex.w13_scale, ex.w2_packed, ex.w2_scale, ex.quant.group_size, pairs, prep)
    if side is not None:
        main.wait_stream(side)
        shared.record_stream(main)                                           # made on the side stream, freed here
    return _sum_pairs(y, x.shape[0], gate.top_k, shared.contiguous())


def _add_norm(x, r, norm):
    """(x + r, norm(x + r)) for a model.RMSNorm `norm`: one add_rms_norm launch where it fits, else the plain ops."""
    if _add_rms_norm_fits(x, r, norm.weight):
        return add_rms_norm(x, r, norm.weight, norm.eps)
    s = x + r.to(x.dtype)
    return s, norm(s)


# The layer stack (model.Transformer.blocks): each block's last residual add waits for the next block's input norm
# (the last block's, for the final norm), so every add meets a norm in one add_rms_norm launch (2 a layer, not 2 adds
# and 2 norms). --debug (a check after each layer) and torch.compile (inductor fuses add and norm itself) run the plain
# stack.
def deferred_block(layer, h, r, cos, sin, cache, start_pos, tree_mask, absorb, slots):
    """model.Block.forward on h + r (r: the previous block's MLP output, not yet added; None in layer 0) -> (h', r'),
    the block's output h' + r'."""
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    h, x = (h, n1(h)) if r is None else _add_norm(h, r, n1)
    h, x = _add_norm(h, layer.self_attn(x, cos, sin, cache, start_pos, tree_mask, absorb, slots), n2)
    return h, layer.mlp(x)


@register("Transformer.blocks", fits=lambda self, h, cos, sin, caches, start_pos, tree_mask, absorb, slots,
          hidden_layers, debug: _glue(h) and not debug)
def blocks(self, h, cos, sin, caches, start_pos, tree_mask, absorb, slots, hidden_layers, debug):
    r, taps = None, []
    for i, (layer, cache) in enumerate(zip(self.layers, caches)):
        h, r = deferred_block(layer, h, r, cos, sin, cache, start_pos, tree_mask, absorb, slots)
        if i in hidden_layers:
            taps.append(h + r.to(h.dtype))
    return _add_norm(h, r, self.norm)[1], taps


# ----------------------------------------------------------------------------------------------------------
# 5. The DFlash drafter's layer (draft.py): its every op is a launch, and a drafter forward is the bigger half of a
# small model's speculative step. Two kernels take the middle of a layer.

# qkv_norm_rope: from the fused q|k|v projection, the block's queries q_norm'ed and rotated, and every row's key
# (k_norm'ed, rotated) and value written to the drafter's cache at its slot. Grid: (token, head of the H q, KV k,
# KV v heads). One launch instead of ~10. Reference: draft.qkv_norm_rope.
@triton.jit
def _norm_rope_head(src, w_ptr, cos_ptr, sin_ptr, n, HD: tl.constexpr, EPS: tl.constexpr, INTERLEAVED: tl.constexpr):
    # one head of token n: RMSNorm then rope, rounded where the references round; the partner columns are loaded
    # again rather than permuted in registers, and normalized with the same statistics
    cols = tl.arange(0, HD)
    cos, sin = tl.load(cos_ptr + n * HD + cols), tl.load(sin_ptr + n * HD + cols)
    pc = _partner(cols, HD, INTERLEAVED)
    x = tl.load(src + cols)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / HD + EPS)
    y = _scale(tl.load(w_ptr + cols), (xf * rstd).to(x.dtype), x.dtype)
    yp = _scale(tl.load(w_ptr + pc), (tl.load(src + pc).to(tl.float32) * rstd).to(x.dtype), x.dtype)
    return _rotate(y, yp, cos, sin)


@triton.jit
def _qkv_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_ptr, v_ptr,
                          T, Q0, H, KV, stride_row, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                          HD: tl.constexpr, EPS: tl.constexpr, INTERLEAVED: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    b, t = n // T, n % T
    src = qkv_ptr + n * stride_row + j * HD
    cols = tl.arange(0, HD)
    slot = tl.load(slots_ptr + n)
    if j < H:                                            # a query head: only the block's rows (t >= Q0) want one
        if t >= Q0:
            y = _norm_rope_head(src, qw_ptr, cos_ptr, sin_ptr, n, HD, EPS, INTERLEAVED)
            tl.store(q_ptr + ((b * (T - Q0) + t - Q0) * H + j) * HD + cols, y)
    elif j < H + KV:                                     # a key head: normalized, rotated, into the cache
        y = _norm_rope_head(src, kw_ptr, cos_ptr, sin_ptr, n, HD, EPS, INTERLEAVED)
        tl.store(k_ptr + b * sk_b + slot * sk_s + (j - H) * sk_h + cols, y)
    else:                                                # a value head: copied into the cache as it is
        tl.store(v_ptr + b * sv_b + slot * sv_s + (j - H - KV) * sv_h + cols, tl.load(src + cols))


@register("qkv_norm_rope", fits=lambda qkv, n_heads, n_kv, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots,
          q_start, interleaved=False: (
    _glue(qkv) and _pow2(q_weight.shape[0], 16) and qkv.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    and qkv.dtype == q_weight.dtype == k_weight.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype))
def qkv_norm_rope(qkv, n_heads, n_kv, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, slots, q_start,
                  interleaved=False):
    (B, T, W), hd = qkv.shape, q_weight.shape[0]
    rows = qkv.reshape(B * T, W)               # a view for qkv contiguous or a row-strided one
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
    q = torch.empty(B, T - q_start, n_heads, hd, dtype=qkv.dtype, device=qkv.device)        # [B, bs, H, hd]
    if B * T:
        _qkv_norm_rope_kernel[(B * T, n_heads + 2 * n_kv)](
            rows, q_weight, k_weight, cos, sin, slots, q, k_cache, v_cache, T, q_start, n_heads, n_kv, rows.stride(0),
            *k_cache.stride()[:3], *v_cache.stride()[:3], HD=hd, EPS=float(eps), INTERLEAVED=interleaved,
            num_warps=1)
    return q


# block_attention: the block's queries over the cached context and the block itself (keys s < prefix_len[b] + T,
# no mask), GQA. Grid (query block, split, b * KV + kv head): the query rows of kv head c are r = t * G + g (head
# h = c * G + g), the G heads that share it for all T block tokens, so each K/V tile is loaded once for all of them.
# Splits and partial outputs (rows t * H + h) as _mla_split_kernel's, merged by _mla_merge_kernel; DIRECT (one
# split): the normalized output is final. Reference: draft.block_attention.
@triton.jit
def _block_attn_kernel(q_ptr, k_ptr, v_ptr, prefix_ptr, o_ptr, lse_ptr, out_ptr, sm_scale, T, H, NUM_SPLITS,
                       sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                       G: tl.constexpr, HD: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_S: tl.constexpr, DIRECT: tl.constexpr):
    KV = H // G
    b, c, split = tl.program_id(2) // KV, tl.program_id(2) % KV, tl.program_id(1)
    L = tl.load(prefix_ptr + b).to(tl.int32) + T
    split_len = _split_len(L, NUM_SPLITS, MIN_SPLIT, BLOCK_S)
    s_start = split * split_len
    if s_start >= L:
        return
    s_end = tl.minimum(s_start + split_len, L)
    r = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_mask = r < T * G
    out_row = (r // G) * H + c * G + r % G                                      # t * H + h
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (b * T * H + out_row)[:, None].to(tl.int64) * HD + d[None, :], mask=row_mask[:, None],
                other=0.0)
    m_i = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, HD), dtype=tl.float32)
    k_b = k_ptr + b.to(tl.int64) * sk_b + c * sk_h
    v_b = v_ptr + b.to(tl.int64) * sv_b + c * sv_h
    for s0 in range(s_start, s_end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < s_end
        k = tl.load(k_b + s[:, None] * sk_s + d[None, :], mask=s_mask[:, None], other=0.0)       # [BS, HD]
        v = tl.load(v_b + s[:, None] * sv_s + d[None, :], mask=s_mask[:, None], other=0.0)
        scores = (tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale).to(tl.float32)   # fp32: see _mla_split
        scores = tl.where(s_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))                 # every split has a key, so m_new is finite
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    o = acc / l_i[:, None]
    if DIRECT:
        tl.store(out_ptr + (b * T * H + out_row)[:, None].to(tl.int64) * HD + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        part = (b * NUM_SPLITS + split) * T * H + out_row
        tl.store(o_ptr + part[:, None].to(tl.int64) * HD + d[None, :], o, mask=row_mask[:, None])
        tl.store(lse_ptr + part, m_i + tl.log(l_i), mask=row_mask)


# one split up to min_split_len slots (a small drafter: one launch, no merge); longer caches split like the target's
DRAFT_ATTN = dict(BLOCK_Q=16, BLOCK_S=64, num_warps=4, min_split_len=512, max_splits=128, waves=1)


@register("block_attention", fits=lambda q, k_cache, v_cache, prefix_len, softmax_scale: (
    _glue(q) and _pow2(q.shape[-1], 16) and q.dtype == k_cache.dtype == v_cache.dtype
    and k_cache.stride(-1) == v_cache.stride(-1) == 1))
def block_attention(q, k_cache, v_cache, prefix_len, softmax_scale):
    (B, T, H, hd), (S, KV) = q.shape, k_cache.shape[1:3]
    q, prefix_len = q.contiguous(), prefix_len.contiguous()
    out = _empty(q.shape, q.dtype, q.device)
    cfg, G = DRAFT_ATTN, H // KV
    n_qblocks = triton.cdiv(T * G, cfg["BLOCK_Q"])
    MIN_SPLIT, BLOCK_S = cfg["min_split_len"], cfg["BLOCK_S"]
    num_splits = _num_splits(S, cfg["max_splits"], MIN_SPLIT, cfg["waves"], B * KV * n_qblocks, q.device)
    o_part, lse_part = out, out                          # one split: the kernel writes out directly, no partials
    if num_splits > 1:
        o_part = _empty((B, num_splits, T * H, hd), torch.float32, q.device)
        lse_part = _empty((B, num_splits, T * H), torch.float32, q.device)
    _block_attn_kernel[(n_qblocks, num_splits, B * KV)](
        q, k_cache, v_cache, prefix_len, o_part, lse_part, out, softmax_scale, T, H, num_splits,
        *k_cache.stride()[:3], *v_cache.stride()[:3], G=G, HD=hd, MIN_SPLIT=MIN_SPLIT, BLOCK_Q=cfg["BLOCK_Q"],
        BLOCK_S=BLOCK_S, DIRECT=num_splits == 1, num_warps=cfg["num_warps"])
    if num_splits > 1:
        _merge_splits(o_part, lse_part, prefix_len, out, T, H, MIN_SPLIT, BLOCK_S)
    return out


# The drafter's layer (draft.Layer.forward) with its middle residual add and norm in one launch.
@register("Layer.forward", fits=lambda self, h, f, cos, sin, mask=None, cache=None: _glue(h))
def draft_layer(self, h, f, cos, sin, mask=None, cache=None):
    attn = self.self_attn(self.input_layernorm(h), f, cos, sin, mask, cache)
    h, x = _add_norm(h, attn, self.post_attention_layernorm)
    return h + self.mlp(x)


# ----------------------------------------------------------------------------------------------------------
# 6. The tree (tree.py).

# rank_topk: per depth row, the top k tokens by (logp desc, token id asc), and their logp, a non-finite logp counting
# as -inf; reference tree.rank_topk.
# Each token gets a unique int64 key that orders like that pair (the logp's bits made order-preserving by _sortable
# in the high word, V-1-token in the low one; the reference builds the same key). No vocabulary sort: grid (row,
# chunk), each program takes the k largest keys of a CHUNK by k rounds of max-and-remove, then one program per row
# does the same over the chunks' winners. lp is read back from logp, so both outputs equal the reference's bits.

RANK_MAX_K = 64          # rounds per program; above it, the reference
# below every real key (a masked vocabulary tail, chunks with fewer than K tokens); a jit global must be constexpr
_KEY_NONE = tl.constexpr(-2**63) if HAS_TRITON else -2**63


@triton.jit
def _sortable(x):
    # float32 -> int32 with the same order (x non-NaN; -0.0 below 0.0): flip the magnitude bits of negative floats
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)

@triton.jit
def _unsortable(m):
    # the inverse of _sortable: int32 -> the float32 it came from, bit for bit
    return (m ^ ((m >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

@triton.jit
def _finite_or_neg_inf(x):
    # a non-finite logp ranks as -inf (NaN's bits would rank it first), as in the reference
    INF: tl.constexpr = float("inf")
    return tl.where(tl.abs(x) < INF, x, -INF)

@triton.jit
def _token_keys(logp_row, v, V):
    # int64 keys of tokens v (masked: _KEY_NONE); + 0.0 turns -0.0 into 0.0, which must tie with it
    x = _finite_or_neg_inf(tl.load(logp_row + v, mask=v < V, other=0.0)) + 0.0
    key = (_sortable(x).to(tl.int64) << 32) | (V - 1 - v).to(tl.int64)
    return tl.where(v < V, key, _KEY_NONE)

@triton.jit
def _store_ranked(key, logp_row, V, lp_out, tok_out):
    # a winning key -> its token (from the low word) and that token's logp, read back from logp
    tok = V - 1 - (key & 0xFFFFFFFF)
    tl.store(tok_out, tok)
    tl.store(lp_out, _finite_or_neg_inf(tl.load(logp_row + tok)))


@triton.jit
def _rank_chunk_kernel(logp_ptr, keys_ptr, lp_ptr, tok_ptr, V, N_CHUNKS, K: tl.constexpr, CHUNK: tl.constexpr,
                       FINAL: tl.constexpr):
    # the chunk's K largest keys in descending order -> keys[row, chunk, :]; FINAL (one chunk a row): to lp / tok
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    key = _token_keys(logp_ptr + row * V, chunk * CHUNK + tl.arange(0, CHUNK), V)
    for j in range(K):
        best = tl.max(key, 0)
        key = tl.where(key == best, _KEY_NONE, key)                  # keys are unique: removes exactly one
        if FINAL:
            _store_ranked(best, logp_ptr + row * V, V, lp_ptr + row * K + j, tok_ptr + row * K + j)
        else:
            tl.store(keys_ptr + (row * N_CHUNKS + chunk) * K + j, best)


@triton.jit
def _rank_merge_kernel(keys_ptr, logp_ptr, lp_ptr, tok_ptr, V, N_CAND, K: tl.constexpr, CAND: tl.constexpr):
    # program row: the K largest of the row's N_CAND chunk winners -> lp / tok
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, CAND)
    key = tl.load(keys_ptr + row * N_CAND + i, mask=i < N_CAND, other=_KEY_NONE)
    for j in range(K):
        best = tl.max(key, 0)
        key = tl.where(key == best, _KEY_NONE, key)
        _store_ranked(best, logp_ptr + row * V, V, lp_ptr + row * K + j, tok_ptr + row * K + j)


@register("rank_topk", fits=lambda logp, k: (_glue(logp) and logp.dtype == torch.float32
                                             and 1 <= k <= min(logp.shape[-1], RANK_MAX_K) and logp.shape[-1] < 2**31))
def rank_topk(logp, k):
    V = logp.shape[-1]
    logp = logp.contiguous()
    rows = logp.numel() // V
    lp = torch.empty(*logp.shape[:-1], k, dtype=torch.float32, device=logp.device)
    tok = torch.empty(*logp.shape[:-1], k, dtype=torch.int64, device=logp.device)
    chunk = min(triton.next_power_of_2(V), 1024 if V <= 16384 else 4096)   # small V: more, shorter programs
    n_chunks = triton.cdiv(V, chunk)
    if rows == 0:
        return lp, tok
    if n_chunks == 1:
        _rank_chunk_kernel[(rows, 1)](logp, lp, lp, tok, V, 1, K=k, CHUNK=chunk, FINAL=True)
        return lp, tok
    keys = torch.empty(rows, n_chunks, k, dtype=torch.int64, device=logp.device)    # [rows, chunks, k] winners
    _rank_chunk_kernel[(rows, n_chunks)](logp, keys, lp, tok, V, n_chunks, K=k, CHUNK=chunk, FINAL=False)
    _rank_merge_kernel[(rows,)](keys, logp, lp, tok, V, n_chunks * k, K=k, CAND=triton.next_power_of_2(n_chunks * k))
    return lp, tok


# ddtree_search: the DDTree best-first search over ranked drafts in one launch (instead of ~65 fixed-shape tensor
# ops). Reference: tree.ddtree_search, bit for bit. Grid: one program per batch row, which runs the paper's
# best-first search with the heap replaced by a pool of 2B candidate slots held in registers:
#   slots     popping node i pushes at most two candidates, its next sibling (slot 2i) and its first child (slot
#             2i+1); the root's first child starts in slot 1
#   order     a pop takes the live candidate with the largest score, ties to the smallest depth, then the smallest
#             rank tuple. Instead of packing whole tuples, each live candidate keeps `pos`, its rank in tuple order
#             among the live ones.
#             Live tuples never contain one another (a candidate's proper prefixes are all popped), so when t at
#             position P is popped, its first child (t, 0) takes P and its next sibling comes right after (P+1):
#             no live tuple lies between t and either of them; every live candidate after P moves up by one.
#   key       one int64 per slot orders the pool like the heap: bits 63..32 the score's float32 bits mapped to an
#             order-preserving int32 (decoded back bit-exactly), bits 31..24 255 - depth, bits 23..16 255 - pos,
#             bits 15..0 parent | rank << 8. Live positions are distinct, so one tl.max pops the unique best and
#             decodes it.
# After i pops the live slots are the heap's entries, so the max key is the (i+1)-th prefix in key order; scores
# add up as in the reference (parent score + logp in float32). No live slot left (tiny vocabulary): padding nodes.

TREE_MAX_BUDGET = MASK_WORD_BITS  # parents are nodes < 64: a parent's mask row fits a word (node 64 is never one)
TREE_MAX_DEPTH = 255    # depth is an 8-bit field of the key


@triton.jit
def _key(score, pos, parent, depth, rank):
    # a candidate's int64 key (see the header above); the int64 casts come before the shifts
    return (tl.cast(_sortable(score), tl.int64) << 32) | (tl.cast(255 - depth, tl.int64) << 24) \
        | tl.cast(((255 - pos) << 16) | parent | (rank << 8), tl.int64)


@triton.jit
def _tree_kernel(lp_ptr, tok_ptr, roots_ptr, tokens_ptr, parents_ptr, depths_ptr, scores_ptr, valid_ptr, mask_ptr,
                 lp_sb, lp_sd, tok_sb, tok_sd, L, K, B,
                 NODES: tl.constexpr, PARENTS: tl.constexpr, SLOTS: tl.constexpr):
    # lp / tok [b, L, K] (f32 / i64, batch and depth strides lp_sb ...), roots [b]; out: the node fields [b, N], mask
    # [b, N, N] (valid and mask as int8 views of bool). L depths, K ranks kept per depth (min(B, V)), B the budget.
    # NODES = next_power_of_2(B + 1) (a mask row), PARENTS = next_power_of_2(B) (nodes 0..B-1, the ones that can be
    # parents), SLOTS = next_power_of_2(2 * B) (the pool)
    NEG_INF: tl.constexpr = float("-inf")
    # a dead slot: below every live key (a score of -inf maps to a larger top word), and with its
    # position field at 255 it never counts as "after" the popped node, so the position shift skips it
    DEAD: tl.constexpr = -(1 << 63) + (255 << 16)
    row = tl.program_id(0).to(tl.int64)
    N = B + 1
    lp_ptr += row * lp_sb
    tok_ptr += row * tok_sb
    out = row * N                                      # node 0 of this row in the [b, N] outputs
    slot = tl.arange(0, SLOTS)                         # [SLOTS]
    col = tl.arange(0, NODES)                          # [NODES] mask column
    node = tl.arange(0, PARENTS)                       # [PARENTS] node index (node B never has children)
    root = tl.load(roots_ptr + row)

    # node 0: the root
    tl.store(tokens_ptr + out, root)
    tl.store(parents_ptr + out, -1)
    tl.store(depths_ptr + out, 0)
    tl.store(scores_ptr + out, 0.0)
    tl.store(valid_ptr + out, 1)
    tl.store(mask_ptr + out * N + col, (col == 0).to(tl.int8), mask=col < N)
    n_score = tl.zeros([PARENTS], tl.float32)                         # [PARENTS] f32 node scores (root: 0.0)
    n_bits = tl.where(node == 0, tl.full([PARENTS], 1, tl.int64), 0)  # [PARENTS] i64 mask rows as bit sets

    # the pool: only slot 1 is live, the root's first child (tuple (0,): position 0, parent 0, depth 1, rank 0)
    lp00 = tl.load(lp_ptr)
    lp00 = tl.where(lp00 == 0.0, 0.0, lp00)          # = 0.0 + lp00 (-0.0 -> 0.0), written so it cannot fold away
    c_key = tl.where(slot == 1, _key(lp00, 0, 0, 1, 0), DEAD)      # [SLOTS] i64

    for i in range(1, B + 1):
        # 1) pop: the max key is node i, and decodes to its score, position, parent, depth and rank
        best = tl.max(c_key, axis=0)
        real = best != DEAD                                        # False: the pool is empty, node i is padding
        c_key = tl.where(c_key == best, DEAD, c_key)               # (keys are unique: exactly node i's slot)
        score = _unsortable((best >> 32).to(tl.int32))
        pos = 255 - ((best >> 16) & 255).to(tl.int32)
        info = (best & 0xFFFF).to(tl.int32)
        parent = tl.where(real, info & 255, -1)
        depth = tl.where(real, 255 - ((best >> 24) & 255).to(tl.int32), 0)
        rank = info >> 8                                           # (meaningless when not real)
        dpos = tl.maximum(depth - 1, 0)                            # row of lp / tok for node i's depth
        # the loads go first: their latency hides behind the two reductions below (and a load placed
        # after this iteration's stores could not be moved above them: the pointers might alias)
        sib_ok = real & (rank + 1 < K)                             # next sibling: rank + 1 at i's depth
        sib_lp = tl.load(lp_ptr + dpos * lp_sd + rank + 1, mask=sib_ok, other=0.0)
        kid_ok = real & (depth < L)                                # first child: rank 0 one depth down
        kid_lp = tl.load(lp_ptr + depth * lp_sd, mask=kid_ok, other=0.0)
        token = tl.load(tok_ptr + dpos * tok_sd + rank, mask=real, other=root)
        is_parent = node == parent                                 # [PARENTS] (none for padding)
        pscore = tl.max(tl.where(is_parent, n_score, NEG_INF), axis=0)
        row_bits = tl.sum(tl.where(is_parent, n_bits, 0), axis=0)  # the parent's row (one nonzero term: exact)
        row_bits |= tl.where(i < 64, tl.full([], 1, tl.int64) << (i & 63), 0)  # | bit i (node 64 is never a parent)

        # 2) emit node i. Padding: root token, parent -1, depth 0, score -inf, mask row = itself.
        score = tl.where(real, score, NEG_INF)
        tl.store(tokens_ptr + out + i, token)
        tl.store(parents_ptr + out + i, parent.to(tl.int64))
        tl.store(depths_ptr + out + i, depth.to(tl.int64))
        tl.store(scores_ptr + out + i, score)
        tl.store(valid_ptr + out + i, real.to(tl.int8))
        in_row = (((row_bits >> (col & 63)) & 1) != 0) & (col < 64)  # [NODES]
        tl.store(mask_ptr + (out + i) * N + col, (in_row | (col == i)).to(tl.int8), mask=col < N)
        n_score = tl.where(node == i, score, n_score)
        n_bits = tl.where(node == i, row_bits, n_bits)

        # 3) push. Live candidates after i's position move up one (their field 255 - pos goes down one);
        # the next sibling (slot 2i) takes position pos+1, the first child (slot 2i+1) takes pos.
        shift = ((c_key >> 16) & 255) < 255 - pos                  # [SLOTS]
        c_key = tl.where(shift, c_key - (1 << 16), c_key)          # (the field is >= 191: no borrow)
        sib = tl.where(sib_ok, _key(pscore + sib_lp, pos + 1, parent, depth, rank + 1), DEAD)
        kid = tl.where(kid_ok, _key(score + kid_lp, pos, i, depth + 1, 0), DEAD)
        c_key = tl.where(slot == 2 * i, sib, tl.where(slot == 2 * i + 1, kid, c_key))


@register("ddtree_search", fits=lambda lp, tok, roots, budget: (
    _gpu(lp) and 1 <= budget <= TREE_MAX_BUDGET and 1 <= lp.shape[1] <= TREE_MAX_DEPTH and lp.shape[2] <= budget
    and lp.dtype == torch.float32 and lp.stride(2) == tok.stride(2) == 1))
@torch.compiler.disable
def ddtree_search(lp, tok, roots, budget):
    """Ranked drafts lp / tok [b, L, K], roots [b] -> the tree's N = budget + 1 nodes: tokens, parents, depths [b, N]
    int64, scores [b, N] float32, valid [b, N] bool, ancestor mask [b, N, N] bool."""
    bsz, L, K = lp.shape
    N, dev = budget + 1, lp.device
    tokens, parents, depths = torch.empty(3, bsz, N, dtype=torch.long, device=dev)     # [b, N] each
    scores = torch.empty(bsz, N, dtype=torch.float32, device=dev)
    valid = torch.empty(bsz, N, dtype=torch.bool, device=dev)
    mask = torch.empty(bsz, N, N, dtype=torch.bool, device=dev)
    # one warp: a pop is two reductions over <= 128 slots, shuffles only
    _tree_kernel[(bsz,)](
        lp, tok, roots, tokens, parents, depths, scores, valid.view(torch.int8), mask.view(torch.int8),
        lp.stride(0), lp.stride(1), tok.stride(0), tok.stride(1), L, K, budget,
        NODES=triton.next_power_of_2(N), PARENTS=triton.next_power_of_2(budget),
        SLOTS=triton.next_power_of_2(2 * budget), num_warps=1)
    return tokens, parents, depths, scores, valid, mask


# ----------------------------------------------------------------------------------------------------------
# 7. Verify (verify.py).

# accept: the accepted path of a tree of N <= ACCEPT_MAX_N nodes. Node i matches when its token is the target's token
# at its parent; i is on the path when every node of its root-to-i path below the root matches: its ancestor-mask row
# (its ancestors and itself) marks no node outside the matching ones, the root (always committed) aside. Grid: one
# program per tree, its mask one [N, N] tile. One launch instead of ~17 ops. Reference: verify.accept.
ACCEPT_MAX_N = 64


@triton.jit
def _tree_accept_kernel(tok_ptr, par_ptr, dep_ptr, valid_ptr, mask_ptr, target_ptr, accepted_ptr, len_ptr, bonus_ptr,
                        N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    i = tl.arange(0, BLOCK)
    m = i < N
    tok = tl.load(tok_ptr + row + i, mask=m, other=0)
    parent = tl.maximum(tl.load(par_ptr + row + i, mask=m, other=0), 0)
    match = (tok == tl.load(target_ptr + row + parent, mask=m, other=0)) & (tl.load(valid_ptr + row + i, mask=m,
                                                                                      other=0) != 0) & m
    anc = tl.load(mask_ptr + (row + i)[:, None] * N + i[None, :], mask=m[:, None] & m[None, :], other=0) != 0
    bad = anc & ~(match | (i == 0))[None, :]                                   # [node i, node j] j breaks i's path
    ok = (tl.sum(bad.to(tl.int32), 1) == 0) & m
    depth = tl.load(dep_ptr + row + i, mask=m, other=0)
    path_len = tl.sum(ok.to(tl.int64), 0)
    deepest = tl.argmax(tl.where(ok, depth, -1), 0)     # the ok nodes form one chain: their depths are distinct
    # accepted[d] = the path's node at depth d, for d < path_len; the deepest node after that
    on_d = ok[None, :] & (depth[None, :] == i[:, None])                                         # [depth d, node j]
    node = tl.sum(tl.where(on_d, i[None, :], 0), 1)
    tl.store(accepted_ptr + row + i, tl.where(i < path_len, node, deepest).to(tl.int64), mask=m)
    tl.store(len_ptr + tl.program_id(0), path_len)
    tl.store(bonus_ptr + tl.program_id(0), tl.load(target_ptr + row + deepest))


@register("accept", fits=lambda tree, target_tokens: _glue(target_tokens) and tree.tokens.shape[-1] <= ACCEPT_MAX_N)
def accept(tree, target_tokens):
    B, N = tree.tokens.shape
    accepted = torch.empty(B, N, dtype=torch.long, device=target_tokens.device)
    path_len, bonus = torch.empty(2, B, dtype=torch.long, device=target_tokens.device)
    fields = [t.contiguous() for t in (tree.tokens, tree.parents, tree.depths, tree.valid.view(torch.int8),
                                       tree.ancestor_mask.view(torch.int8), target_tokens)]
    _tree_accept_kernel[(B,)](*fields, accepted, path_len, bonus, N, BLOCK=max(16, triton.next_power_of_2(N)),
                              num_warps=2)
    return accepted, path_len, bonus


# commit_kv: every layer's accepted-path cache rows kv_cache[layer, b, start + accepted[b, j]] -> slot start + j,
# j ascending, in place: the row read for slot j is start + accepted[j] >= start + j (a node's index is at least its
# depth), so a slot is read before it is overwritten. Grid: (layer, b). Only the rows that move are read and written
# (a contiguous path moves nothing). Reference: verify.commit_kv.
@triton.jit
def _commit_kv_kernel(cache_ptr, start_ptr, accepted_ptr, len_ptr, N, C, stride_l, stride_b, stride_s,
                      BLOCK_C: tl.constexpr):
    layer, b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    base = cache_ptr + layer * stride_l + b * stride_b + tl.load(start_ptr + b) * stride_s
    n = tl.load(len_ptr + b)
    for j in range(1, N):                    # node 0 (the root) is already at slot start
        src = tl.load(accepted_ptr + b * N + j)
        if (j < n) & (src != j):
            for c0 in range(0, C, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C)
                row = tl.load(base + src * stride_s + c, mask=c < C)
                tl.store(base + j * stride_s + c, row, mask=c < C)


@register("commit_kv", fits=lambda kv_cache, start_pos, accepted, path_len: (
    _glue(kv_cache) and isinstance(start_pos, torch.Tensor) and kv_cache.stride(-1) == 1))
def commit_kv(kv_cache, start_pos, accepted, path_len):
    B, N = accepted.shape
    start = start_pos.reshape(-1).expand(B).contiguous()                                     # [B]
    _commit_kv_kernel[(kv_cache.shape[0], B)](kv_cache, start, accepted.contiguous(), path_len.contiguous(), N,
                                              kv_cache.shape[3], *kv_cache.stride()[:3],
                                              BLOCK_C=min(1024, triton.next_power_of_2(kv_cache.shape[3])), num_warps=4)


if __name__ == "__main__":
    print("kernels.py holds the Triton kernels only: run `python bench.py kernels` (GPU self-test and timings)")
