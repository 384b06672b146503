"""
Triton kernels for a Kimi K2.6 decode / tree-verify step: its two hot spots, the per-layer glue between them and
the DDTree search, plus the INT4 format helpers.

    fused_moe_w4a16     routed experts straight from the INT4 pack-quantized checkpoint layout: a bandwidth-bound
                        GEMV for decode / verify (~17 instructions per int32 word of 8 weights; an expert that
                        several tokens chose comes from HBM once), tl.dot tiles for prefill
    mla_tree_attention  absorbed-MLA attention over the compressed cache, with a tree mask for the new tokens; on
                        Hopper, from 64 query rows, a Gluon kernel (wgmma + TMA) that holds 64 rows per program,
                        and from 128 rows at long contexts its warp-specialized "seesaw" form (FlashMLA's schedule)
    rms_norm            RMSNorm in one launch instead of eight; with it the rest of a layer's decode glue (rope, the
                        cache write, add + norm, SwiGLU, routing top-k, the MoE pair sort), one launch each
    router_topk         the fp32 router matmul (split over D, exact products for bf16 inputs) + routing, two launches
    rank_topk           the drafter's top tokens per depth, in the tree search's order, without sorting the vocabulary
    ddtree_search       the DDTree best-first search (tree.py) in one launch; tree_accept and commit_kv, verify's
                        acceptance and KV commit in one launch each
    qkv_norm_rope, block_attention   the DFlash drafter's layer middle: norms, rope, cache writes; its attention
    pack_int4 / unpack_int4 / dequant_int4_ref   the single source of truth for the INT4 bit order

Invariant: every kernel == its *_ref twin. The twin has the same signature, is plain PyTorch, runs anywhere
(it is the CPU path and the test oracle), and the kernel must match it to rounding (ddtree_search's twin is
tree.build_tree_ops, matched bit for bit). model.py asks
use_triton(device) which one to call; `--no-triton` sets FORCE_REF and forces the twins everywhere.

Tests (CPU, kernels run under TRITON_INTERPRET=1 in a subprocess):  python -m pytest -q tests/test_kernels.py
GPU self-test (bf16 at K2.6 shapes, vs the refs, timings):          python kernels.py
Launch-config sweep on a GPU:                                       python kernels.py --sweep
"""
import functools
import itertools
import os
import statistics
import sys
import types

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # the refs still work; the @triton.jit definitions below just stay plain functions
    HAS_TRITON = False
    triton = types.SimpleNamespace(jit=lambda fn: fn)
    tl = types.SimpleNamespace(constexpr=None)

try:  # Gluon: Triton's explicit-layout dialect (wgmma, TMA, mbarriers), for the Hopper attention kernel. Its API moves
    # between releases, so only the version this code was written and tested against (3.6) turns it on.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    HAS_GLUON = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6)
except (ImportError, AttributeError):
    HAS_GLUON = False

# ----------------------------------------------------------------------------------------------------------
# The one switch. A stage file writes an op's math once, in plain PyTorch, and marks it `@kernels.fast`; this file
# registers a Triton launcher under the same name with a `fits(...)` that says when it may take the call (device,
# dtype, shapes, autograd, torch.compile). Launcher, fits and reference take the same arguments.

ENABLED = True          # generate.py --no-triton sets False: every op runs its PyTorch reference
POISON_BUFFERS = False  # tests set this: scratch buffers start as NaN, so an unwritten element shows up
_KERNELS: dict = {}     # reference name -> (fits, launch)


def fast(ref):
    """Decorator for a reference op in a stage file: calls go to the kernel registered under ref's name when the
    switch is on and the kernel fits the arguments, else to ref itself. `op.ref` is the reference (tests use it)."""
    name = ref.__name__

    @functools.wraps(ref)
    def dispatch(*args, **kw):
        k = _KERNELS.get(name)
        if k is not None and ENABLED and k[0](*args, **kw):
            return k[1](*args, **kw)
        return ref(*args, **kw)
    dispatch.ref = ref
    return dispatch


def register(name: str, fits):
    """Decorator for a launcher: the fast path of the reference op `name` wherever fits(*args, **kw) is true."""
    def deco(launch):
        _KERNELS[name] = (fits, launch)
        return launch
    return deco


def use_triton(device) -> bool:
    """A CUDA tensor and Triton installed: the device condition every kernel's fits starts from."""
    return HAS_TRITON and ENABLED and torch.device(device).type == "cuda" and torch.cuda.is_available()


def _empty(shape, dtype, device):
    if POISON_BUFFERS:
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------
# INT4 pack-quantized format (compressed-tensors, kimi_k2.md §2.2).
# W [O, I] -> packed [O, I/8] int32: column j = 8k + i sits in bits 4i..4i+3 of word k (column 8k is the least
# significant nibble), stored as u = q + 8 with q in [-8, 7].
# scale [O, I/group]: W[o, j] = q[o, j] * scale[o, j // group].
# Leading dims (e.g. a stack of experts [E, O, I]) pass through all three helpers.

_SHIFTS = tuple(range(0, 32, 4))  # nibble i of a word sits at bit 4i


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    assert q.dtype == torch.int8 and q.shape[-1] % 8 == 0, f"want int8 [..., I], I % 8 == 0: {q.dtype} {tuple(q.shape)}"
    assert -8 <= q.min() and q.max() <= 7, "int4 values must lie in [-8, 7]"
    u = (q.long() + 8).view(*q.shape[:-1], -1, 8)                  # [..., I/8, 8], nibble values 0..15
    shifts = torch.tensor(_SHIFTS, dtype=torch.long, device=q.device)
    words = (u << shifts).sum(-1)                                    # disjoint bits, so sum == OR; 0 .. 2^32-1
    words = torch.where(words >= 2**31, words - 2**32, words)        # reinterpret as signed int32 (top bit = sign)
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    assert packed.dtype == torch.int32, f"want int32 words, got {packed.dtype}"
    # the words as bytes (little-endian, as on every CPU and GPU torch runs on): byte j of word k holds columns
    # 8k + 2j (low nibble) and 8k + 2j + 1 (high nibble). Two byte-wide ops instead of eight word-wide shifts.
    assert sys.byteorder == "little", "unpack_int4 reads the words' bytes: big-endian hosts are not supported"
    b = packed.contiguous().view(torch.uint8)                        # [..., I/2]
    u = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)           # [..., I] nibble values 0..15
    return u.to(torch.int8) - 8                                      # q = u - 8 in [-8, 7]


def dequant_int4_ref(packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    q = unpack_int4(packed)                                          # [..., O, I]
    assert q.shape[-1] == scale.shape[-1] * group_size, f"{tuple(q.shape)}, scale {tuple(scale.shape)}, group {group_size}"
    w = q.view(*q.shape[:-1], -1, group_size).to(scale.dtype) * scale.unsqueeze(-1)
    return w.flatten(-2)                                             # [..., O, I] in scale's dtype (bf16 in the model)


# ----------------------------------------------------------------------------------------------------------
# Fused MoE, INT4 weights x 16-bit activations (W4A16).
# Both paths group the T*K (token, k) pairs by expert on the GPU with fixed-shape ops (_moe_sort: one program at
# decode / verify sizes, sort + searchsorted + _moe_slots_kernel for prefill; no host sync, CUDA-graph capturable);
# program `slot` of every grid serves the slot-th *used* expert, for all its pairs.
#
# Decode / verify (T <= MOE_GEMV_MAX_T, 16-bit activations): a GEMV, bandwidth-bound, ~1 pair per expert.
#   The whole cost is streaming INT4 words from HBM and turning them into products fast enough to keep up. These
#   got it from 19% to 75-81% of the H200's copy bandwidth at 9-17 tokens (kernels.py self-test, docs/BENCHMARKS.md):
#   - no tl.dot and no [BLOCK_N, BLOCK_K] dequantized tile: each int32 word is reduced against the 8 activations it
#     multiplies, where it was loaded (a tl.dot needs the tile reshaped and moved through shared memory);
#   - row strides passed as arguments, so the compiler proves 16-byte alignment and issues 128-bit loads;
#   - Marlin's dequantization trick in ~20 PTX instructions per word (_DEQUANT_DOT_PTX): `lop3` ORs two nibbles into
#     the mantissas of two fp16 1024.0s at once, one f16x2 subtract / fma turns them into q = u - 8 exactly, and
#     four f16x2 fmas form the 8 products. No int->float conversion instruction (quarter rate) is left;
#   - the products of a run of 4 words (one scale group) summed in f16x2 and converted to fp32 once, and no load
#     masks when the tiles cover the weight (EVEN): ~21 -> ~17 SASS instructions per word;
#   - a program takes its expert's pairs one after another over the same weight slice: HBM once, L2 for the
#     repeats (a tree's tokens share experts: siblings route alike; 117 experts for 136 pairs at 17 random tokens),
#     and stage 1 split at least MOE_GEMV_MIN_SPLIT_K ways over D: more, shorter programs. This beat streaming two
#     pairs at once in half-width tiles at every shape measured, shared routing included (docs/BENCHMARKS.md).
#   The activations are packed for that dot by _moe_prep_f16: plane p holds f16x2 (x[8w+p], x[8w+p+4]) - the nibble
#   order the lop3 masks produce - scaled by a power of two per row so that max |x| is in [1, 2): fp16 cannot
#   overflow (an activation of 1e5 is fine) and the scale is undone exactly on the fp32 output. fp16 keeps 11 bits,
#   more than the bf16 activations carry, so the only rounding is the f16x2 accumulation of 16 products per half
#   (|sum| <= 256; max error 2.3-3.0e-3 of the largest output against the reference, 2.2-2.7e-3 with 4, H200).
#   Stage 1 (gate/up) sums SPLIT_K slices of D when too few experts are live to fill the GPU (TP8 decode);
#   _moe_prep_f16 then sums the slices, applies SwiGLU and packs h for stage 2 (down), which also applies the routing
#   weight. Per-pair buffers instead of atomics: deterministic, the same bits every run.
# Prefill (T > MOE_GEMV_MAX_T) and fp32 activations: tiles of BLOCK_M pairs x BLOCK_N rows dequantized in registers
#   and fed to tl.dot (vLLM's fused_moe_kernel_gptq_awq idea): weights read once per 16 pairs instead of once per pair.
# The interpreter (CPU tests) cannot run PTX: there the GEMV uses _dequant_dot_portable, the same data in plain Triton.

MOE_GEMV_MAX_T = 64
MOE_GEMV_BLOCKS = dict(gate_up=dict(BLOCK_N=16, BLOCK_W=128, num_warps=4, num_stages=2),    # BLOCK_W int32 words
                       down=dict(BLOCK_N=64, BLOCK_W=64, num_warps=4, num_stages=2))        # = 8 * BLOCK_W columns
# Launch configs (BLOCK_N output rows, BLOCK_K input columns, a multiple of the group) of the tl.dot path.
MOE_BLOCKS = dict(gate_up=dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3),
                  down=dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2))
MOE_MAX_SPLIT_K = 8
# stage 1's least split over D at T > 1 (H200, I = 2048 / 256, T = 9: 481.0 -> 478.1 / 96.2 -> 89.3 us against 1;
# docs/BENCHMARKS.md). Decode (T = 1) keeps _split_k's choice: 73.0 against 75.9 us at I = 2048, equal at 256.
MOE_GEMV_MIN_SPLIT_K = 2
# Token rows per tile of the tl.dot path: the smallest tl.dot tile. An expert with more pairs loops over them.
MOE_BLOCK_M = 16
# PTX only on NVIDIA hardware: not under the interpreter, not on ROCm
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"   # kernels run on CPU tensors, in numpy
MOE_PTX = not INTERPRETED and torch.version.hip is None


@triton.jit
def _expert_of_slot(bounds_ptr, slot, E, E_POW2: tl.constexpr):
    # Expert e owns sorted pairs bounds[e] .. bounds[e+1]. Returns the slot-th used expert (in id order), its first
    # sorted pair and its pair count; count is 0 when fewer than slot+1 experts are used (the programs then exit).
    offs = tl.arange(0, E_POW2)
    lo = tl.load(bounds_ptr + offs, mask=offs < E, other=0)
    hi = tl.load(bounds_ptr + offs + 1, mask=offs < E, other=0)
    used = hi > lo
    mine = used & (tl.cumsum(used.to(tl.int32), 0) == slot + 1)
    return tl.sum(tl.where(mine, offs, 0), 0), tl.sum(tl.where(mine, lo, 0), 0), tl.sum(tl.where(mine, hi - lo, 0), 0)


@triton.jit
def _moe_slots_kernel(bounds_ptr, slots_ptr, E, E_POW2: tl.constexpr):
    # slots[slot] = (expert, first sorted pair, pair count): one scan over the E experts per slot, done once here
    # rather than in each of the hundreds of programs per expert of the stages below
    e, start, count = _expert_of_slot(bounds_ptr, tl.program_id(0), E, E_POW2)
    tl.store(slots_ptr + tl.program_id(0) * 3, e)
    tl.store(slots_ptr + tl.program_id(0) * 3 + 1, start)
    tl.store(slots_ptr + tl.program_id(0) * 3 + 2, count)


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
    mov.b32 m_lo, 0x000F000F;
    mov.b32 m_hi, 0x00F000F0;
    mov.b32 magic, 0x64006400;
    mov.b32 bias, 0x64086408;
    mov.b32 sc, 0x2C002C00;
    mov.b32 off, 0xD480D480;
    shr.u32 w2, $1, 8;
    lop3.b32 t0, $1, m_lo, magic, 0xEA;
    lop3.b32 t1, $1, m_hi, magic, 0xEA;
    lop3.b32 t2, w2, m_lo, magic, 0xEA;
    lop3.b32 t3, w2, m_hi, magic, 0xEA;
    sub.f16x2 t0, t0, bias;
    fma.rn.f16x2 t1, t1, sc, off;
    sub.f16x2 t2, t2, bias;
    fma.rn.f16x2 t3, t3, sc, off;
    fma.rn.f16x2 s, t0, $2, $6;
    fma.rn.f16x2 s, t1, $3, s;
    fma.rn.f16x2 s, t2, $4, s;
    fma.rn.f16x2 s, t3, $5, s;
    mov.b32 $0, s;
}"""
# the two fp16 halves of an f16x2 sum, added in fp32
_F16X2_SUM_PTX = """{
    .reg .b16 lo, hi;
    .reg .f32 f0, f1;
    mov.b32 {lo, hi}, $1;
    cvt.f32.f16 f0, lo;
    cvt.f32.f16 f1, hi;
    add.f32 $0, f0, f1;
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
def _dequant_dot_portable(words, x04, x15, x26, x37):
    # the PTX's data in plain Triton (fp32 products and sums): what the interpreter runs. [BN, BW] one sum per word
    acc = tl.zeros(words.shape, dtype=tl.float32)
    for p in tl.static_range(4):
        if p == 0:
            xp = x04
        elif p == 1:
            xp = x15
        elif p == 2:
            xp = x26
        else:
            xp = x37
        q_lo = ((words >> (4 * p)) & 0xF) - 8
        q_hi = ((words >> (4 * p + 16)) & 0xF) - 8
        acc += q_lo.to(tl.float32) * _f16_half(xp, False) + q_hi.to(tl.float32) * _f16_half(xp, True)
    return acc


@triton.jit
def _dequant_dot_word(words, x04, x15, x26, x37, acc, FIRST: tl.constexpr):
    # acc + this word's 8 products (f16x2); FIRST: no acc yet (a mul instead of zeroing a register per run)
    if FIRST:
        s = tl.inline_asm_elementwise(_DEQUANT_MUL_PTX, "=r,r,r,r,r,r", [words, x04, x15, x26, x37],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = tl.inline_asm_elementwise(_DEQUANT_DOT_PTX, "=r,r,r,r,r,r,r", [words, x04, x15, x26, x37, acc],
                                      dtype=tl.int32, is_pure=True, pack=1)
    return s


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
    # f16x2 and converted once: one conversion per run instead of per word saves ~3 of ~21 instructions per word
    # (sm_90 SASS). |sum| <= 16 RUN * 8 * 2 (|q| <= 8, |x| < 2 after the row's power-of-two scale): no overflow.
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
    # [BN, BW // GW] fp32 group scales). EVEN: whole tiles only (the caller checked), so no masks: a masked load
    # zeroes its registers first (~5% of the loop's instructions).
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
                  SWIGLU: tl.constexpr, N_POW2: tl.constexpr, BLOCK_W: tl.constexpr):
    # Program (row, block): words block*BLOCK_W.. of one activation row of N -> xk[row] [4, N/8] int32 f16x2 planes
    # (plane p, word w = (x[8w+p], x[8w+p+4])), scaled by 2^-e with e = floor(log2 max |x|); xs[row] = 2^e.
    # Every program of a row reads the whole row for the max (a few KB, from L2): one parallel pass instead of a
    # long serial one per row.
    row = tl.program_id(0)
    cols = tl.arange(0, N_POW2)
    m = tl.max(tl.abs(_prep_values(src_ptr, row, P, N, SPLIT_K, cols, cols < N, SWIGLU)), 0)
    e = tl.where(m > 0, tl.floor(tl.log2(tl.where(m > 0, m, 1.0))), 0.0)
    if tl.program_id(1) == 0:
        tl.store(xs_ptr + row, tl.exp2(e))
    scale = tl.exp2(-e)                                                      # a power of two: exact
    NW = N // 8
    ww = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    wm = ww < NW
    for p in tl.static_range(4):
        lo = (_prep_values(src_ptr, row, P, N, SPLIT_K, ww * 8 + p, wm, SWIGLU) * scale).to(tl.float16)
        hi = (_prep_values(src_ptr, row, P, N, SPLIT_K, ww * 8 + p + 4, wm, SWIGLU) * scale).to(tl.float16)
        packed = (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)
        tl.store(xk_ptr + row * (4 * NW) + p * NW + ww, packed, mask=wm)


def _prep_f16(src, rows: int, N: int, split_k: int, swiglu: bool):
    """src: x [rows, N] or gu [split_k, rows, 2N] -> (packed planes [rows, 4, N/8] int32, scales [rows] fp32)."""
    xk = _empty((rows, 4, N // 8), torch.int32, src.device)
    xs = _empty((rows,), torch.float32, src.device)
    block_w = 128
    _moe_prep_f16[(rows, triton.cdiv(N // 8, block_w))](src, xk, xs, rows, N, split_k, SWIGLU=swiglu,
                                                         N_POW2=triton.next_power_of_2(N), BLOCK_W=block_w)
    return xk, xs


@triton.jit
def _gate_up_pass(w_gate, s_gate, xk_row, I, DW, DG, w_start, w_end, n_mask, GW: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PTX: tl.constexpr, EVEN: tl.constexpr):
    # gate and up rows over words w_start .. w_end for one activation row -> (gate, up) summed over the groups, [BN]
    acc_g = tl.zeros((BLOCK_N, BLOCK_W // GW), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_W // GW), dtype=tl.float32)
    for w0 in range(w_start, w_end, BLOCK_W):                                 # empty slice: zeros
        wg, sg = _weight_tile(w_gate, s_gate, DW, w0, n_mask, GW, BLOCK_W, EVEN)
        wu, su = _weight_tile(w_gate + I * DW, s_gate + I * DG, DW, w0, n_mask, GW, BLOCK_W, EVEN)
        acc_g += _tile_dot(wg, sg, xk_row, DW, w0, GW, BLOCK_W, PTX, EVEN)
        acc_u += _tile_dot(wu, su, xk_row, DW, w0, GW, BLOCK_W, PTX, EVEN)
    return tl.sum(acc_g, 1), tl.sum(acc_u, 1)


@triton.jit
def _moe_gate_up_gemv(xk_ptr, xs_ptr, w_ptr, s_ptr, gu_ptr, pair_ptr, slots_ptr, I, K, P, DW, DG,
                      GROUP: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                      PTX: tl.constexpr, EVEN: tl.constexpr):
    # Program (slot, pid_n, split): rows pid_n*BLOCK_N.. of gate and of up of the slot-th used expert, over the
    # split-th slice of the DW words of a row, for each of its pairs in turn -> gu[split, pair] (gate 0..I-1, up
    # I..2I-1). An expert that several tokens chose comes from HBM once: the program streams the same slice again
    # right after, from L2. (Reading it once for two pairs at a time, in half-width tiles, was slower at every
    # shape measured, shared routing included: H200, 2026-11-30.)
    # DW = D/8 and DG = D/group are arguments (not D // 8 here) so the compiler sees them divisible by 16.
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
        g, u = _gate_up_pass(w_gate, s_gate, xk_ptr + (pair // K) * 4 * DW, I, DW, DG, w_start, w_end, n_mask, GW,
                             BLOCK_N, BLOCK_W, PTX, EVEN)
        xs = tl.load(xs_ptr + pair // K)                                     # undo the activation scale
        out = gu_ptr + (split * P + pair) * (2 * I) + offs_n
        tl.store(out, g * xs, mask=n_mask)
        tl.store(out + I, u * xs, mask=n_mask)


@triton.jit
def _moe_down_gemv(hk_ptr, hs_ptr, w_ptr, s_ptr, topk_w_ptr, y_ptr, pair_ptr, slots_ptr, D, IW, IG,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, PTX: tl.constexpr,
                   EVEN: tl.constexpr):
    # Program (slot, pid_n): output columns pid_n*BLOCK_N.. of down_proj for the slot-th used expert's pairs, times
    # each pair's routing weight -> y[pair]
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


# --- prefill path (and fp32 activations): tl.dot on dequantized tiles ---

@triton.jit
def _int4_tile(w_rows, s_rows, k0, n_mask, n_cols, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    # [BLOCK_N, BLOCK_K] tile of W (input columns k0 .. k0+BLOCK_K), dequantized in registers. w_rows / s_rows:
    # [BLOCK_N, 1] pointers to the start of rows n of the packed weight and of its scales; n_cols: I of W [O, I].
    # Loads run along the rows (contiguous words, coalesced); each word then fans out into its 8 columns.
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    word = tl.load(w_rows + offs_w[None, :], mask=n_mask[:, None] & (offs_w < n_cols // 8)[None, :], other=0)
    q = (word[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF         # [BLOCK_N, BLOCK_K/8, 8]
    q = tl.reshape(q - 8, (q.shape[0], BLOCK_K // GROUP, GROUP))                  # column 8k+i -> (k, i) row-major
    offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    s = tl.load(s_rows + offs_g[None, :], mask=n_mask[:, None] & (offs_g < n_cols // GROUP)[None, :], other=0.0)
    w = (q.to(tl.float32) * s.to(tl.float32)[:, :, None]).to(s.dtype)           # exact product, one rounding (= ref)
    return tl.reshape(w, (q.shape[0], BLOCK_K))                                   # masked tail: scale 0 -> w 0


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, s_ptr, gu_ptr, pair_ptr, slots_ptr, D, I, K, P,
                        GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (slot, pid_n, split): rows pid_n*BLOCK_N.. of gate and of up for the slot-th used expert, summed over
    # the split-th slice of D, stored to gu[split, pair] (gate in columns 0..I-1, up in I..2I-1).
    e, start, count = _load_slot(slots_ptr)
    if count == 0:
        return
    split = tl.program_id(2)
    k_len = tl.cdiv(tl.cdiv(D, BLOCK_K), SPLIT_K) * BLOCK_K                  # a whole number of tiles per split
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + e * (2 * I * (D // 8)) + offs_n[:, None] * (D // 8)   # gate rows 0..I-1, up rows I..2I-1
    s_gate = s_ptr + e * (2 * I * (D // GROUP)) + offs_n[:, None] * (D // GROUP)
    w_up = w_gate + I * (D // 8)
    s_up = s_gate + I * (D // GROUP)
    for m0 in range(0, count, BLOCK_M):  # usually one pass: few pairs per expert
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        pair = tl.load(pair_ptr + start + offs_m, mask=m_mask, other=0)    # pair = t*K + k
        tok = pair // K
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(split * k_len, tl.minimum(split * k_len + k_len, D), BLOCK_K):  # empty slice: zeros
            kk = k0 + offs_k
            x = tl.load(x_ptr + tok[:, None] * D + kk[None, :], mask=m_mask[:, None] & (kk < D)[None, :], other=0.0)
            wg = _int4_tile(w_gate, s_gate, k0, n_mask, D, GROUP, BLOCK_K)            # [BLOCK_N, BLOCK_K]
            wu = _int4_tile(w_up, s_up, k0, n_mask, D, GROUP, BLOCK_K)
            acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision="ieee")  # "ieee" only matters for fp32 inputs
            acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision="ieee")
        gu_rows = gu_ptr + (split * P + pair)[:, None] * (2 * I) + offs_n[None, :]
        tl.store(gu_rows, acc_g, mask=m_mask[:, None] & n_mask[None, :])
        tl.store(gu_rows + I, acc_u, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, s_ptr, topk_w_ptr, y_ptr, pair_ptr, slots_ptr, D, I,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (slot, pid_n): output columns pid_n*BLOCK_N.. of down_proj for the slot-th used expert.
    e, start, count = _load_slot(slots_ptr)
    if count == 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + e * (D * (I // 8)) + offs_n[:, None] * (I // 8)
    s_rows = s_ptr + e * (D * (I // GROUP)) + offs_n[:, None] * (I // GROUP)
    for m0 in range(0, count, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        pair = tl.load(pair_ptr + start + offs_m, mask=m_mask, other=0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + offs_k
            w = _int4_tile(w_rows, s_rows, k0, n_mask, I, GROUP, BLOCK_K)             # [BLOCK_N, BLOCK_K]
            # h goes in at the activation dtype (the "A16"), as the bf16 expert MLP of the reference model does
            h = tl.load(h_ptr + pair[:, None] * I + kk[None, :], mask=m_mask[:, None] & (kk < I)[None, :], other=0.0)
            acc = tl.dot(h.to(w.dtype), tl.trans(w), acc, input_precision="ieee")
        acc = acc * tl.load(topk_w_ptr + pair, mask=m_mask, other=0.0)[:, None]
        tl.store(y_ptr + pair[:, None] * D + offs_n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


_EXPERT_IDS: dict = {}   # (n, device) -> arange(n) int32, made once: one kernel less per MoE layer step (never
                         # evicted: captured CUDA graphs keep reading it)


def _expert_ids(n: int, device) -> torch.Tensor:
    if (n, device) not in _EXPERT_IDS:
        _EXPERT_IDS[n, device] = torch.arange(n, device=device, dtype=torch.int32)
    return _EXPERT_IDS[n, device]


def _sm_count(device) -> int:
    # SMs a grid is sized for. On CPU only the interpreter runs the kernels: pretend to have 16, so tests exercise
    # several splits.
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16


def _split_k(n_units: int, n_programs: int, device) -> int:
    # slices of the reduction dim so that ~2 waves of programs fill the GPU
    return max(1, min(MOE_MAX_SPLIT_K, n_units, triton.cdiv(2 * _sm_count(device), n_programs)))


def _even(n_rows: int, n_words: int, cfg: dict) -> bool:
    # the GEMV tiles cover the weight exactly (K2.6 at any TP), so its loads need no masks
    return n_rows % cfg["BLOCK_N"] == 0 and n_words % cfg["BLOCK_W"] == 0


def _moe_gemv(x, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size, pair_ids, slots, y):
    T, D = x.shape
    P, K = y.shape[0], y.shape[0] // T
    n_slots, I = slots.shape[0], w13_packed.shape[1] // 2
    xk, xs = _prep_f16(x, T, D, 1, swiglu=False)                            # packed f16x2 planes, their scales
    cfg = MOE_GEMV_BLOCKS["gate_up"]
    n_blocks = triton.cdiv(I, cfg["BLOCK_N"])
    n_tiles = triton.cdiv(D // 8, cfg["BLOCK_W"])
    split_min = MOE_GEMV_MIN_SPLIT_K if T > 1 else 1                         # verify steps (see the constant)
    split_k = max(min(split_min, n_tiles), _split_k(n_tiles, n_slots * n_blocks, x.device))
    gu = _empty((split_k, P, 2 * I), torch.float32, x.device)
    _moe_gate_up_gemv[(n_slots, n_blocks, split_k)](
        xk, xs, w13_packed, w13_scale, gu, pair_ids, slots, I, K, P, D // 8, D // group_size,
        GROUP=group_size, SPLIT_K=split_k, PTX=MOE_PTX, EVEN=_even(I, D // 8, cfg), **cfg)
    hk, hs = _prep_f16(gu, P, I, split_k, swiglu=True)                      # h = SwiGLU, packed the same way
    cfg = dict(MOE_GEMV_BLOCKS["down"])
    cfg["BLOCK_W"] = min(cfg["BLOCK_W"], triton.next_power_of_2(I // 8))   # no wider than a row (TP8: 32 words)
    _moe_down_gemv[(n_slots, triton.cdiv(D, cfg["BLOCK_N"]))](
        hk, hs, w2_packed, w2_scale, topk_weights, y, pair_ids, slots, D, I // 8, I // group_size,
        GROUP=group_size, PTX=MOE_PTX, EVEN=_even(D, I // 8, cfg), **cfg)


def _moe_dot(x, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size, pair_ids, slots, y):
    T, D = x.shape
    P, K = y.shape[0], y.shape[0] // T
    n_slots, I = slots.shape[0], w13_packed.shape[1] // 2
    cfg = MOE_BLOCKS["gate_up"]
    n_blocks = triton.cdiv(I, cfg["BLOCK_N"])
    split_k = _split_k(triton.cdiv(D, cfg["BLOCK_K"]), n_slots * n_blocks, x.device)
    gu = _empty((split_k, P, 2 * I), torch.float32, x.device)
    _moe_gate_up_kernel[(n_slots, n_blocks, split_k)](
        x, w13_packed, w13_scale, gu, pair_ids, slots, D, I, K, P,
        GROUP=group_size, SPLIT_K=split_k, BLOCK_M=MOE_BLOCK_M, **cfg)
    gate, up = gu.sum(0).chunk(2, dim=-1)
    h = F.silu(gate) * up                                                     # [P, I] fp32
    cfg = MOE_BLOCKS["down"]
    _moe_down_kernel[(n_slots, triton.cdiv(D, cfg["BLOCK_N"]))](
        h, w2_packed, w2_scale, topk_weights, y, pair_ids, slots, D, I, GROUP=group_size, BLOCK_M=MOE_BLOCK_M, **cfg)


MOE_SORT_MAX_PAIRS = 1024   # up to here the pairs are sorted by one program (_moe_sort_kernel); prefill: torch.sort


@triton.jit
def _moe_sort_kernel(ids_ptr, pair_ids_ptr, slots_ptr, P, E, N_SLOTS,
                     P_POW2: tl.constexpr, E_POW2: tl.constexpr, S_POW2: tl.constexpr):
    # One program: the (token, k) pairs sorted by expert (keys expert * P_POW2 + pair: unique, so the order within an
    # expert is the pair order), per-expert counts by histogram, and the slot table of the used experts in id order.
    p = tl.arange(0, P_POW2)
    ids = tl.load(ids_ptr + p, mask=p < P, other=E).to(tl.int32)      # padding pairs go to bin E, past the experts
    key = tl.sort(ids * P_POW2 + p)
    tl.store(pair_ids_ptr + p, (key % P_POW2).to(tl.int64), mask=p < P)
    e = tl.arange(0, E_POW2)
    count = tl.histogram(ids, E_POW2)                                  # E_POW2 > E: the padding bin exists
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


def _moe_sort(topk_ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> pair_ids [T*K] (pairs t*K + k grouped by expert, in expert id order) and slots
    [min(E, T*K), 3] int64 = (expert, first index into pair_ids, pair count) of the used experts in id order, then
    count-0 rows. One launch at decode / verify sizes; prefill: sort + searchsorted + _moe_slots_kernel."""
    P = topk_ids.numel()
    slots = _empty((min(E, P), 3), torch.int64, topk_ids.device)
    if P <= MOE_SORT_MAX_PAIRS:
        pair_ids = _empty((P,), torch.int64, topk_ids.device)
        _moe_sort_kernel[(1,)](topk_ids, pair_ids, slots, P, E, slots.shape[0], P_POW2=triton.next_power_of_2(P),
                               E_POW2=triton.next_power_of_2(E + 1), S_POW2=triton.next_power_of_2(slots.shape[0]),
                               num_warps=4)
        return pair_ids, slots
    sorted_ids, pair_ids = torch.sort(topk_ids.view(-1).to(torch.int32))                        # [P], [P]
    bounds = torch.searchsorted(sorted_ids, _expert_ids(E + 1, topk_ids.device))                 # [E+1]
    _moe_slots_kernel[(slots.shape[0],)](bounds, slots, E, E_POW2=triton.next_power_of_2(E))
    return pair_ids, slots


@triton.jit
def _moe_sum_kernel(y_ptr, shared_ptr, out_ptr, D, K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr):
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


# torch.compile leaves this call opaque (a graph break): inductor re-generates user Triton kernels from their
# source, and that failed for _moe_gate_up_gemv on the H200 (2026-11-29). Under CUDA graphs nothing changes.
@torch.compiler.disable
def fused_moe_w4a16(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32, out=None,
                    shared=None):
    """x [T, D], topk_ids / topk_weights [T, K] -> [T, D] fp32 = sum_k weight * SwiGLU expert_k(x), the experts read
    from the INT4 layout (see experts_ref), + shared [T, D] (the shared experts' output, any float dtype) if given:
    added in the pass that sums the pairs, instead of a cast and an add after it. GEMV path for T <= MOE_GEMV_MAX_T
    with 16-bit x, tl.dot path else."""
    T, D = x.shape
    K = topk_ids.shape[1]
    E, I2, _ = w13_packed.shape
    I = I2 // 2
    assert HAS_TRITON, "triton is not installed; call fused_moe_w4a16_ref"
    assert topk_ids.shape == (T, K) and topk_ids.dtype == torch.int64, f"topk_ids: want int64 [{T}, K], got {topk_ids.dtype}"
    assert topk_weights.shape == (T, K) and topk_weights.dtype == torch.float32, "topk_weights: want float32 [T, K]"
    assert D % group_size == 0 and I % group_size == 0 and group_size % 8 == 0, f"D={D}, I={I}, group {group_size}"
    for cfg in MOE_BLOCKS.values():
        assert cfg["BLOCK_K"] % group_size == 0 and cfg["BLOCK_N"] >= 16, f"MOE_BLOCKS {cfg}: BLOCK_K % group, BLOCK_N >= 16"
    for cfg in MOE_GEMV_BLOCKS.values():
        assert (8 * cfg["BLOCK_W"]) % group_size == 0, f"MOE_GEMV_BLOCKS {cfg}: 8 * BLOCK_W must be a multiple of the group"
    assert w13_packed.shape == (E, 2 * I, D // 8) and w13_packed.dtype == torch.int32, f"w13 {tuple(w13_packed.shape)}"
    assert w13_scale.shape == (E, 2 * I, D // group_size), f"w13_scale {tuple(w13_scale.shape)}"
    assert w2_packed.shape == (E, D, I // 8) and w2_packed.dtype == torch.int32, f"w2_packed {tuple(w2_packed.shape)}"
    assert w2_scale.shape == (E, D, I // group_size), f"w2_scale {tuple(w2_scale.shape)}"
    assert x.dtype == w13_scale.dtype == w2_scale.dtype, f"x, scales: one dtype, got {x.dtype} {w13_scale.dtype} {w2_scale.dtype}"
    for name, t in dict(x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13_packed=w13_packed, w13_scale=w13_scale,
                        w2_packed=w2_packed, w2_scale=w2_scale).items():
        assert t.is_contiguous(), f"{name} must be contiguous"
    if out is None:
        out = torch.empty(T, D, dtype=torch.float32, device=x.device)
    assert out.shape == (T, D) and out.dtype == torch.float32 and out.is_contiguous(), "out: contiguous float32 [T, D]"
    assert shared is None or (shared.shape == (T, D) and shared.is_contiguous()), f"shared: contiguous [{T}, {D}]"

    P = T * K
    pair_ids, slots = _moe_sort(topk_ids, E)
    y = _empty((P, D), torch.float32, x.device)                              # per pair, weighted by topk_weights
    path = _moe_gemv if T <= MOE_GEMV_MAX_T and x.dtype != torch.float32 else _moe_dot
    path(x, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size, pair_ids, slots, y)
    if T:
        BLOCK = 256                                                          # enough programs for T = 9 x 7168
        _moe_sum_kernel[(T, triton.cdiv(D, BLOCK))](y, y if shared is None else shared, out, D, K=K,
                                                    HAS_SHARED=shared is not None, BLOCK=BLOCK)
    return out


def experts_ref(x, topk_ids, topk_weights, expert, experts=None, y=None) -> torch.Tensor:
    """Σ_k topk_weights[t, k] * SwiGLU expert topk_ids[t, k] of x [T, D], one expert at a time over the tokens
    that chose it; expert(e) -> (w13 [2I, D] gate rows then up rows, w2 [D, I]), computed in w13's dtype and
    accumulated in fp32 into y (a new [T, D] fp32 zeros when None). experts: the expert ids to visit (default:
    every id in topk_ids), in increasing order. The host sync (which experts are used) is fine for a reference,
    not for CUDA graphs."""
    if y is None:
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)                # [T, D]
    for e in topk_ids.unique().tolist() if experts is None else experts:
        t, k = (topk_ids == e).nonzero(as_tuple=True)
        w13, w2 = expert(e)
        gate, up = F.linear(x[t].to(w13.dtype), w13).chunk(2, dim=-1)                 # [n, I] each
        y.index_add_(0, t, F.linear(F.silu(gate) * up, w2).float() * topk_weights[t, k, None])
    return y


def experts_dense_ref(x, topk_ids, topk_weights, experts, w13, w2, y) -> torch.Tensor:
    """experts_ref for a group of experts held dequantized together (ids `experts` [g], w13 [g, 2I, D], w2
    [g, D, I]): each applied to every token, its output weighted by the token's routing weight for it (0 when the
    token did not choose it) and added to y [T, D] fp32. More FLOPs than pair by pair, a fixed handful of ops:
    what a CPU running a small model pays for."""
    h = torch.matmul(x.to(w13.dtype), w13.transpose(1, 2))                            # [g, T, 2I]
    gate, up = h.chunk(2, dim=-1)
    o = torch.matmul(F.silu(gate) * up, w2.transpose(1, 2)).float()                   # [g, T, D]
    chose = topk_ids[:, :, None] == experts                                           # [T, K, g]
    w = (topk_weights[:, :, None] * chose).sum(1)                                     # [T, g]
    return y.add_(torch.einsum("tg,gtd->td", w, o))


# The INT4 reference dequantizes the used experts a group at a time, each group in one chain of tensor ops, and
# applies a group with experts_dense_ref: on a CPU the per-op overhead of ~12 ops per expert was most of a tiny
# model's MoE step (9 tokens, 8 experts: 1.58 -> 0.63 ms per layer, 2 cores). Groups stay under this many fp32
# bytes, so at K2.6 size (176 MB per expert) it is one expert at a time over the tokens that chose it, as before.
MOE_REF_GROUP_BYTES = 256 * 2**20


def fused_moe_w4a16_ref(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32, out=None,
                        shared=None):
    used = topk_ids.unique()                                                            # [n] increasing ids
    per_expert = (w13_packed[0].numel() + w2_packed[0].numel()) * 8 * 4                 # fp32 bytes, dequantized
    n = max(1, MOE_REF_GROUP_BYTES // per_expert)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)                      # [T, D]
    for i in range(0, used.numel(), n):
        group = used[i:i + n]                                                           # [g]
        w13 = dequant_int4_ref(w13_packed[group], w13_scale[group], group_size).float()  # [g, 2I, D]
        w2 = dequant_int4_ref(w2_packed[group], w2_scale[group], group_size).float()     # [g, D, I]
        if group.numel() > 1:
            experts_dense_ref(x, topk_ids, topk_weights, group, w13, w2, y)
        else:
            experts_ref(x, topk_ids, topk_weights, lambda e: (w13[0], w2[0]), group.tolist(), y)
    if shared is not None:
        y += shared.float()
    if out is not None:
        return out.copy_(y)
    return y


# ----------------------------------------------------------------------------------------------------------
# MLA tree attention over the compressed cache (absorbed form, kimi_k2.md §4.2).
# Idea: flash-decoding / SGLang's two-stage grouped-head MLA decode kernel, plus a tree-mask predicate (the "cascade"
# of sglang PR #29706 folded into one pass). Stage 1: grid (b, split, block of query rows). All T*H query rows of a
# row b share the same K and V (the 512-dim latent is both), so a program loads each cache tile once for BLOCK_Q rows
# (t, h), runs an online softmax over its split of keys, and writes a normalized partial output and its log-sum-exp.
# Stage 2 merges the splits with the log-sum-exp rule. Split length is computed in the kernel from prefix_len, so the
# grid depends only on shapes (graph capturable) and splits past prefix_len + T exit at once.
# Visibility: slot s < prefix_len[b] (committed prefix), or s = prefix_len[b] + j with bit j of the row's mask word.

# BLOCK_Q query rows (t, h) x BLOCK_S keys per tile. Splits: enough for ~`waves` waves of programs, each at least
# MIN_SPLIT keys long so the fp32 partial outputs (T*H*R*4 B per split) stay small next to the keys they summarize.
# Sweep on an H200 (scratch, 2026-11-30, us at H/T/prefix 8/1/32k, 8/9/32k, 8/17/32k, 64/9/4096, 64/17/4096):
# 2 waves 25.0 53.0 82.2 48.3 98.2 against 4 waves 24.8 57.4 84.8 55.8 86.7 (1 wave: 23.4 75.0 114.6 64.7 114.9).
# 64-row query blocks (wgmma-sized; 8 warps) were slower at every shape: 47.3 77.3 105.6 69.9 94.1 at best (with
# 2 waves of splits and 64-column merges; with one wave and ATTN_MERGE they win from 512 rows: ATTN_WIDE).
ATTN_BLOCKS = dict(BLOCK_Q=16, BLOCK_S=64, num_warps=4, num_stages=2)
ATTN_SPLITS = dict(max_splits=256, min_split_len=128, waves=2)
# From min_rows query rows (T x local heads) on: 64-row blocks (warpgroup MMAs, 8 warps) and splits for `waves`
# waves, so fewer blocks re-read the cache through L2 when many rows share it. H200 (2026-11-30, fourth session), us
# at H/T/prefix 8/1/32k, 8/9/32k, 8/17/32k, 64/9/4096, 64/17/4096: 16-row blocks only 18.7 46.4 73.9 42.9 91.0;
# 64-row blocks from 256 rows, waves 1: 18.9 46.3 73.4 40.9 63.5 (waves 2: 52.7 76.7 at 64 heads). From 256 rows,
# though, 8/33/32k (264 rows) went 128 -> 190 us, while 8/64/32k went 340 -> 174 and 64/9/32k 357 -> 214: hence 512.
ATTN_WIDE = dict(min_rows=512, BLOCK_Q=64, BLOCK_S=64, num_warps=8, num_stages=2, waves=1)
# The merge's programs: one query row x BLOCK_R latent columns x every split, BLOCK_R as wide as ~`elements` values
# per program allow (wider was 42.8 -> 36.3 us at 64 heads, 8 splits; at 256 splits, 512 columns was 19 -> 92 us)
ATTN_MERGE = dict(elements=16384, num_warps=4)


MASK_WORD_BITS = 64     # tree slots per packed mask row (one int64 word): the widest verify the kernel takes


def tree_mask_bits(tree_mask: torch.Tensor) -> torch.Tensor:
    # [B, T, T] bool -> [B, T] int64 with bit j set iff tree_mask[b, t, j]: the packed form both attention twins
    # also accept, so a model packs its mask once per forward, not once per layer. Disjoint bits, so sum == OR, and the
    # two's complement wrap puts j = 63 in the sign bit, which is what the kernel's shift-and-mask expects.
    T = tree_mask.shape[-1]
    assert T <= MASK_WORD_BITS, f"one int64 word per row holds at most {MASK_WORD_BITS} tree slots, got T={T}"
    return (tree_mask.long() << torch.arange(T, device=tree_mask.device)).sum(-1)


def tree_mask_unpack(bits: torch.Tensor) -> torch.Tensor:
    # tree_mask_bits' inverse: [B, T] int64 -> [B, T, T] bool
    T = bits.shape[-1]
    return (bits[..., None] >> torch.arange(T, device=bits.device)) & 1 == 1


@triton.jit
def _split_len(L, NUM_SPLITS, MIN_SPLIT: tl.constexpr, BLOCK_S: tl.constexpr):
    # keys per split for a row with L visible-or-not keys: even split, at least MIN_SPLIT, a whole number of tiles
    n = tl.maximum(tl.cdiv(L, NUM_SPLITS), MIN_SPLIT)
    return tl.cdiv(n, BLOCK_S) * BLOCK_S


@triton.jit
def _mla_split_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, prefix_ptr, bits_ptr, o_ptr, lse_ptr,
                      sm_scale, T, H, NUM_SPLITS, stride_cb, stride_cs, stride_qb, stride_qt, stride_qh,
                      R: tl.constexpr, P: tl.constexpr, MIN_SPLIT: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr):
    # grid (q block, split, b): the q blocks of one split are launched next to each other, so the cache tiles that
    # the first one reads are still in L2 for the others (the cache is read from HBM about once, not once per block)
    b = tl.program_id(2)
    split = tl.program_id(1)
    prefix = tl.load(prefix_ptr + b).to(tl.int32)
    L = prefix + T                                   # keys of row b: the prefix, then the T tree slots
    split_len = _split_len(L, NUM_SPLITS, MIN_SPLIT, BLOCK_S)
    s_start = split * split_len
    if s_start >= L:                                 # beyond this row's keys; the merge never reads it
        return
    s_end = tl.minimum(s_start + split_len, L)

    # query rows r = t*H + h of row b (q_pe is [B, T, H, P] contiguous, so [B, T*H, P]; q_lat may be strided: it is
    # the absorbed-query einsum's output, read in place)
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_mask = rows < T * H
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, P)
    q_rows = q_lat_ptr + b * stride_qb + (rows // H) * stride_qt + (rows % H) * stride_qh
    q_lat = tl.load(q_rows[:, None] + offs_r[None, :], mask=row_mask[:, None], other=0.0)
    q_pe = tl.load(q_pe_ptr + (b * T * H + rows)[:, None] * P + offs_p[None, :], mask=row_mask[:, None], other=0.0)
    bits = tl.load(bits_ptr + b * T + rows // H, mask=row_mask, other=0)       # [BLOCK_Q] int64 tree-mask words

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
        # fp32 on purpose: under torch.compile, inductor passes the Python float sm_scale as fp64, which made the
        # whole softmax fp64 and the PV tl.dot reject its accumulator (H200, 2026-11-29)
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
def _mla_merge_kernel(o_part_ptr, lse_ptr, prefix_ptr, out_ptr, T, H, NUM_SPLITS,
                      R: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_S: tl.constexpr,
                      SPLITS: tl.constexpr, BLOCK_R: tl.constexpr):
    # Program (b, row, r-block): out = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M), M = max_i lse_i, over the
    # splits i that stage 1 wrote (all of them loaded at once: SPLITS = next power of two >= NUM_SPLITS).
    b = tl.program_id(0)
    row = tl.program_id(1)
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


# Hopper variant of stage 1 (Gluon): one program holds 64 query rows and all 512 latent columns, which Triton's
# layouts cannot (see ATTN_WIDE's note: its 8 warps all sit on the rows, so both warpgroups compute the same scores).
# Here the layouts are explicit: the score tile [64, BLOCK_S] is split across the two warpgroups by key columns,
# the fp32 output [64, R] by latent columns (128 registers a thread), so each cache tile is read once per 64 rows
# (the 16-row kernel reads it once per 16) and the scores are computed once. Cache tiles arrive by TMA into a
# 2-stage ring (the 64 x 576 tiles and the 64-row query use ~225 KB of shared memory: no room for a third), the
# scores and P @ V are warpgroup MMAs (wgmma) with Q and the tile in shared memory, P goes through shared memory
# because each warpgroup's half of the output needs every key's weight. Same splits, mask rule, online softmax and
# partial outputs as _mla_split_kernel; _mla_merge_kernel merges them.
ATTN_WGMMA = dict(min_rows=64, min_work=2**20, max_split_len=1024, BLOCK_Q=64, BLOCK_S=64, STAGES=2, num_warps=8)
# Used from min_rows query rows (one full block) and min_work = rows x cache slots (below it the longer ramp of a
# 64-row program loses); splits for one wave unless that makes them longer than max_split_len keys, then two.
# H200 (2026-11-30, fifth session), us, 16-row kernel -> this one, at H/T/slots: 8/9/32k 46.2 -> 35.9, 8/17/32k
# 71.7 -> 49.3, 8/33/32k 124.1 -> 82.9, 64/9/4096 34.2 -> 26.5, 64/17/4096 50.6 -> 37.1, 64/9/32k 213.5 -> 121.7;
# slower where the work is small: 8/9/1000 10.6 -> 14.3, 8/9/4096 15.0 -> 15.8, 64/1/4096 12.0 -> 15.4.
# BLOCK_S = 32 with 3-4 stages was slower everywhere (8/9/32k 44.7: the 16-key score MMAs re-read Q from shared
# memory for half the work each); issuing the next tile's score MMAs before waiting for P @ V changed nothing (+-1%).
# What bounds it now: one program per SM (255 registers a thread, ~225 KB of shared memory) with one tile in flight
# while it computes, ~2.5-2.8 us a tile, plus ~8 us of ramp, partial outputs and merge per call. A tile's MMAs read
# ~301 KB of operands from shared memory (each warpgroup re-reads Q for its 32 keys), ~1.2 us of it at 128 B a cycle;
# the rest is the tile's scores, softmax and P @ V waiting on each other. docs/BENCHMARKS.md (2026-11-30, eighth
# session) has the roofline and the redesigns this points to.
ATTN_SEESAW = dict(min_rows=128, min_work=2**19, max_split_len=1024, BLOCK_Q=64, BLOCK_S=32, STAGES=4,
                   maxnreg=168, regs=240)
# The warp-specialized "seesaw" variant (_mla_seesaw_kernel, below), used from two 64-row blocks (min_rows) and
# min_work = rows x cache slots; its 32-key tiles in a 4-stage ring (~225 KB of shared memory with the 64-row query;
# 64-key tiles leave room for 2 stages only and were slower: T = 17 / 33 at 32k 62.1 / 99.5 us cold).
# H200 (2026-11-30, ninth session), cold-L2 us, wgmma kernel -> this one, B = 2 (prefixes S and S / 3), H/T/S:
# 8/17/4096 27.2 -> 21.7, 8/17/8192 31.5 -> 29.2, 8/17/32k 71.5 -> 64.8, 8/33/8192 41.4 -> 35.3, 8/33/32k
# 132.5 -> 107.2, 8/64/32k 146.2 -> 138.7, 64/9/4096 39.6 -> 35.4, 64/33/32k 467.6 -> 372.3; 8/16/4096 24.7 -> 24.8
# and 64/9/32k 150.4 -> 155.3 (even); slower below min_work (8/17/1000 14.4 -> 17.4, 8/33/1000 18.8 -> 19.9) and at
# 64 rows (64/1/4096 17.4 -> 20.8), so the plain wgmma kernel keeps those. B = 1, 8 heads, 32k: T = 9 (72 rows,
# not used) 39.4 -> 38.1, T = 16 42.3 -> 39.7, T = 17 51.2 -> 43.7, T = 33 85.0 -> 72.9.


def _hopper_fits(c: dict, q_lat, cache, rows: int) -> bool:
    # a Gluon stage-1 kernel with settings c runs here: Hopper (wgmma + TMA), 16-bit inputs, enough rows and work,
    # the output half as one wgmma (N <= 256), and its query block, ring and P tile in 227 KB of shared memory
    R, P = q_lat.shape[-1], cache.shape[-1] - q_lat.shape[-1]
    smem = 2 * ((c["BLOCK_Q"] + c["STAGES"] * c["BLOCK_S"]) * (R + P) + c["BLOCK_Q"] * c["BLOCK_S"])
    return (HAS_GLUON and not INTERPRETED and q_lat.is_cuda and q_lat.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_properties(q_lat.device).major == 9
            and rows >= c["min_rows"] and rows * cache.shape[1] >= c["min_work"]
            and R // 2 <= 256 and smem <= 227 * 1024)


def _use_wgmma_attention(q_lat, cache, rows: int) -> bool:
    return _hopper_fits(ATTN_WGMMA, q_lat, cache, rows)


def _use_seesaw_attention(q_lat, cache, rows: int) -> bool:
    # the output halves are column slices of a cache tile in shared memory: whole 128-byte swizzle rows (R % 128)
    return _hopper_fits(ATTN_SEESAW, q_lat, cache, rows) and q_lat.shape[-1] % 128 == 0


def _attention_path(q_lat, cache, rows: int) -> tuple[dict | None, bool, dict]:
    """mla_tree_attention's stage 1 for these shapes: (the Hopper kernel's settings, ATTN_SEESAW or ATTN_WGMMA, or
    None for the Triton kernel; wide: the Triton kernel's 64-row tiles (ATTN_WIDE) instead of ATTN_BLOCKS' 16;
    the block settings that run). The self-test counts the compute floor in the same blocks."""
    hopper = (ATTN_SEESAW if _use_seesaw_attention(q_lat, cache, rows) else
              ATTN_WGMMA if _use_wgmma_attention(q_lat, cache, rows) else None)
    wide = hopper is None and rows >= ATTN_WIDE["min_rows"]
    return hopper, wide, hopper or ({k: ATTN_WIDE[k] for k in ATTN_BLOCKS} if wide else ATTN_BLOCKS)


if HAS_GLUON:
    @gluon.jit
    def _mla_wgmma_kernel(q_lat_ptr, q_pe_ptr, kv_desc, pe_desc, prefix_ptr, bits_ptr, o_ptr, lse_ptr,
                          sm_scale, T, H, NUM_SPLITS, S_SLOTS, stride_qb, stride_qt, stride_qh,
                          R: gl.constexpr, P: gl.constexpr, MIN_SPLIT: gl.constexpr,
                          BLOCK_Q: gl.constexpr, BLOCK_S: gl.constexpr, STAGES: gl.constexpr):
        # grid (q block, split, b) as _mla_split_kernel; 8 warps = 2 warpgroups
        b = gl.program_id(2)
        split = gl.program_id(1)
        prefix, L, s_start, s_end = _mla_split_range(prefix_ptr, b, split, T, NUM_SPLITS, MIN_SPLIT, BLOCK_S)
        if s_start < L:                                   # else beyond this row's keys; the merge never reads it
            n_tiles = gl.cdiv(s_end - s_start, BLOCK_S)
            dtype: gl.constexpr = q_lat_ptr.dtype.element_ty
            # scores [BLOCK_Q, BLOCK_S]: warpgroup w takes key columns w*BLOCK_S/2.. ; output [BLOCK_Q, R]: latent
            # columns w*R/2.. ; both MMAs are [4, 2] warps over (rows, columns)
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                               instr_shape=[16, BLOCK_S // 2, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                               instr_shape=[16, R // 2, 16])
            q_smem, qpe_smem = _mla_query_smem(q_lat_ptr, q_pe_ptr, b, gl.program_id(0) * BLOCK_Q, T, H, stride_qb,
                                               stride_qt, stride_qh, R, P, BLOCK_Q, R, 8)
            p_smem = gl.allocate_shared_memory(dtype, [BLOCK_Q, BLOCK_S],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_Q, BLOCK_S], dtype))

            # 2-stage ring of cache tiles (latent [BLOCK_S, R] and rope [BLOCK_S, P]), one mbarrier per stage
            kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_S, R], kv_desc.layout)
            pe_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_S, P], pe_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            row0 = b * S_SLOTS + s_start                  # the cache as [B * S_SLOTS, R + P] rows
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
                _mla_tile_load(kv_desc, pe_desc, ready.index(i), kv_smem.index(i), pe_smem.index(i),
                               row0 + i * BLOCK_S, i < n_tiles, R)
            fence_async_shared()
            gl.thread_barrier()                           # the query rows are in shared memory for every warp

            rows = gl.program_id(0) * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, s_layout))
            bits = gl.load(bits_ptr + b * T + rows // H, mask=rows < T * H, other=0)   # [BLOCK_Q] tree-mask words
            cols = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(0, s_layout))
            m_i = gl.full([BLOCK_Q], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([BLOCK_Q], gl.float32, layout=gl.SliceLayout(1, s_layout))
            acc = gl.zeros([BLOCK_Q, R], gl.float32, layout=o_layout)
            s_zero = gl.zeros([BLOCK_Q, BLOCK_S], gl.float32, layout=s_layout)
            for i in range(n_tiles):
                stage = i % STAGES
                mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
                kv = kv_smem.index(stage)
                pe = pe_smem.index(stage)
                sc = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                sc = warpgroup_mma(qpe_smem, pe.permute((1, 0)), sc, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
                scores = _mla_masked_scores(sc, s_start + i * BLOCK_S + cols, prefix, bits, s_end, sm_scale)
                m_new = gl.maximum(m_i, gl.max(scores, 1))                      # a reduction across warpgroups
                acc, l_i, m_safe = _mla_rescale(acc, l_i, m_i, m_new, o_layout)
                p = gl.exp(scores - m_safe[:, None])
                l_i = l_i + gl.sum(p, 1)
                m_i = m_new
                p_smem.store(p.to(dtype))
                fence_async_shared()
                gl.thread_barrier()                       # both halves of P written before either MMA reads it
                acc = warpgroup_mma(p_smem, kv, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                gl.thread_barrier()                       # both warpgroups are done with this stage (and with P)
                _mla_tile_load(kv_desc, pe_desc, ready.index(stage), kv, pe, row0 + (i + STAGES) * BLOCK_S,
                               i + STAGES < n_tiles, R)
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(i))

            _mla_store_partial(acc, l_i, m_i, o_ptr, lse_ptr, (b * NUM_SPLITS + split) * T * H,
                               gl.program_id(0) * BLOCK_Q, T * H, 0, True, R, BLOCK_Q, R, o_layout)

    @gluon.jit
    def _mla_tile_load(kv_desc, pe_desc, bar, kv, pe, row, pred, R: gl.constexpr):
        # one cache tile (latent and rope parts) by TMA into a ring stage; bar completes when its bytes landed.
        # Rows past this b's slots come from the next b or TMA's zero fill: the visibility mask drops them.
        mbarrier.expect(bar, kv_desc.block_type.nbytes + pe_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, kv, pred=pred)
        tma.async_copy_global_to_shared(pe_desc, [row, R], bar, pe, pred=pred)

    @gluon.jit
    def _mla_split_range(prefix_ptr, b, split, T, NUM_SPLITS, MIN_SPLIT: gl.constexpr, BLOCK_S: gl.constexpr):
        # this program's keys [s_start, s_end) of row b, split as _split_len does (s_start >= L: none)
        prefix = gl.load(prefix_ptr + b).to(gl.int32)
        L = prefix + T
        split_len = gl.cdiv(gl.maximum(gl.cdiv(L, NUM_SPLITS), MIN_SPLIT), BLOCK_S) * BLOCK_S
        s_start = split * split_len
        return prefix, L, s_start, gl.minimum(s_start + split_len, L)

    @gluon.jit
    def _mla_query_smem(q_lat_ptr, q_pe_ptr, b, q0, T, H, stride_qb, stride_qt, stride_qh, R: gl.constexpr,
                        P: gl.constexpr, BLOCK_Q: gl.constexpr, CHUNK: gl.constexpr, WARPS: gl.constexpr):
        # the block's query rows r = q0 + t*H + h into shared memory as wgmma operands, CHUNK latent columns at a
        # time through the registers of WARPS warps (q_lat may be strided: the absorbed-query einsum's output)
        dtype: gl.constexpr = q_lat_ptr.dtype.element_ty
        ld_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
        rows = q0 + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, ld_layout))
        rmask = (rows < T * H)[:, None]
        q_rows = q_lat_ptr + b * stride_qb + (rows // H) * stride_qt + (rows % H) * stride_qh
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_Q, R],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_Q, R], dtype))
        for c in gl.static_range(R // CHUNK):
            cols = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, ld_layout))
            q = gl.load(q_rows[:, None] + cols[None, :], mask=rmask, other=0.0)           # [BLOCK_Q, CHUNK]
            q_smem.slice(c * CHUNK, CHUNK, dim=1).store(q)
        qpe = gl.load(q_pe_ptr + (b * T * H + rows)[:, None] * P
                      + gl.arange(0, P, layout=gl.SliceLayout(0, ld_layout))[None, :], mask=rmask, other=0.0)
        qpe_smem = gl.allocate_shared_memory(dtype, [BLOCK_Q, P],
                                             gl.NVMMASharedLayout.get_default_for([BLOCK_Q, P], dtype), qpe)
        return q_smem, qpe_smem

    @gluon.jit
    def _mla_masked_scores(sc, s, prefix, bits, s_end, sm_scale):
        # the mask rule of _mla_split_kernel: the prefix, plus tree slot j = s - prefix where bit j of the row's word
        # is set, and nothing at or past s_end
        j = s - prefix
        in_tree = ((bits[:, None] >> gl.maximum(j, 0)[None, :]) & 1) != 0
        visible = ((s < prefix)[None, :] | ((j >= 0)[None, :] & in_tree)) & (s < s_end)[None, :]
        return gl.where(visible, sc * sm_scale, float("-inf"))

    @gluon.jit
    def _mla_rescale(acc, l_i, m_run, m_new, o_layout: gl.constexpr):
        # online softmax: move the output (or its half) and the row sums from max m_run to m_new; returns m_safe,
        # the max to subtract from the new scores (0 for a row with nothing visible yet, which so stays 0)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp(m_run - m_safe)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        return acc, l_i * alpha, m_safe

    @gluon.jit
    def _mla_store_partial(acc, l_i, m_i, o_ptr, lse_ptr, part0, q0, ROWS, col0, STORE_LSE: gl.constexpr,
                           R: gl.constexpr, BLOCK_Q: gl.constexpr, NCOLS: gl.constexpr, o_layout: gl.constexpr):
        # a split's partial result for query rows q0.. (of ROWS): the output columns [col0, col0 + NCOLS) normalised,
        # o_part [B, NS, T*H, R] at row part0 + q0.., and (STORE_LSE) its log-sum-exp, lse_part [B, NS, T*H]
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        seen = l_o > 0
        o = gl.where(seen[:, None], acc / gl.where(seen, l_o, 1.0)[:, None], 0.0)
        rows_o = q0 + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, o_layout))
        part = part0 + rows_o
        offs_r = col0 + gl.arange(0, NCOLS, layout=gl.SliceLayout(0, o_layout))
        gl.store(o_ptr + part[:, None].to(gl.int64) * R + offs_r[None, :], o, mask=(rows_o < ROWS)[:, None])
        if STORE_LSE:
            m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_layout))
            lse = gl.where(seen, m_o + gl.log(gl.where(seen, l_o, 1.0)), float("-inf"))
            gl.store(lse_ptr + part, lse, mask=rows_o < ROWS)

    # ------------------------------------------------------------------------------------------------------
    # The "seesaw" variant of stage 1 (FlashMLA's schedule, in Gluon's warp specialization). Two math warpgroups
    # own the two halves of the latent output, [64, R/2] fp32 each, as in _mla_wgmma_kernel; but a key tile's
    # scores are computed whole by one of them, alternately (warpgroup w takes tiles w, w+2, ...), so neither
    # waits on a cross-warpgroup row reduction and one's softmax runs while the other's MMAs do. The running max is
    # one sequence for both halves: the owner of tile i computes m_i = max(m_{i-1}, rowmax S_i) from the m_{i-1} the
    # other handed over with P_{i-1}, and hands P_i (through shared memory) and m_i on. Each warpgroup multiplies
    # every tile's P into its half: its own P from registers, the other's from shared memory. A 1-warp partition
    # keeps a 4-stage ring of 32-key cache tiles loading by TMA. The row sums, kept per warpgroup against the same
    # max sequence, add at the end.

    @gluon.jit
    def _mla_seesaw_loader(kv_desc, pe_desc, kv_smem, pe_smem, ready, empty, row0, n_tiles,
                           R: gl.constexpr, BLOCK_S: gl.constexpr, STAGES: gl.constexpr):
        for i in range(n_tiles):
            stage = i % STAGES
            mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)   # both warpgroups done with tile i - STAGES
            _mla_tile_load(kv_desc, pe_desc, ready.index(stage), kv_smem.index(stage), pe_smem.index(stage),
                           row0 + i * BLOCK_S, True, R)

    @gluon.jit
    def _mla_seesaw_other(j, acc, l_own, m_run, kv_smem, p_smem, m_smem, ready, p_ready,
                          W: gl.constexpr, HALF: gl.constexpr, STAGES: gl.constexpr, o_layout: gl.constexpr,
                          row_l: gl.constexpr):
        # the other warpgroup's tile j into our half: wait for its P and max, rescale, issue P @ V (left in flight)
        stage = j % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        mbarrier.wait(p_ready.index(1 - W), (j // 2) & 1)
        m_new = m_smem.load(row_l)
        acc, l_own, _ = _mla_rescale(acc, l_own, m_run, m_new, o_layout)
        acc = warpgroup_mma(p_smem, kv_smem.index(stage).slice(W * HALF, HALF, dim=1), acc, is_async=True)
        return acc, l_own, m_new

    @gluon.jit
    def _mla_seesaw_own(i, HAS_OTHER: gl.constexpr, acc, l_own, m_run, q_smem, qpe_smem, kv_smem, pe_smem, p_smem,
                        m_smem, ready, empty, p_ready, bits, cols, s_zero, sm_scale, prefix, s_start, s_end,
                        W: gl.constexpr, HALF: gl.constexpr, BLOCK_S: gl.constexpr, STAGES: gl.constexpr,
                        o_layout: gl.constexpr, row_l: gl.constexpr):
        # our tile i: (1) its score MMAs, issued first; (2) the other's tile i - 1 into our half, whose P @ V runs
        # under (3) our softmax; (4) P_i and m_i handed over (the one P buffer is ours to write once our P @ V of
        # P_{i-1} is done: the other writes it next only after reading P_i); (5) our P_i @ V_i, P from registers
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        kv = kv_smem.index(stage)
        sc = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma(qpe_smem, pe_smem.index(stage).permute((1, 0)), sc, is_async=True)
        if HAS_OTHER:
            acc, l_own, m_run = _mla_seesaw_other(i - 1, acc, l_own, m_run, kv_smem, p_smem, m_smem, ready, p_ready,
                                                  W, HALF, STAGES, o_layout, row_l)
            sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
        else:
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
        scores = _mla_masked_scores(sc, s_start + i * BLOCK_S + cols, prefix, bits, s_end, sm_scale)
        m_new = gl.maximum(m_run, gl.max(scores, 1))
        if HAS_OTHER:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((i - 1) % STAGES))
        acc, l_own, m_safe = _mla_rescale(acc, l_own, m_run, m_new, o_layout)
        p32 = gl.exp(scores - m_safe[:, None])                                            # [BLOCK_Q, BLOCK_S]
        l_own = l_own + gl.sum(p32, 1)
        p = p32.to(p_smem.dtype)
        p_smem.store(p)
        m_smem.store(m_new)
        fence_async_shared()                     # the other's wgmma reads P through the async proxy
        gl.thread_barrier()                      # every thread's part of P and m written before the one arrive
        mbarrier.arrive(p_ready.index(W))
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        acc = warpgroup_mma(gl.convert_layout(p, a_layout), kv.slice(W * HALF, HALF, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(stage))
        return acc, l_own, m_new

    @gluon.jit
    def _mla_seesaw_math(W: gl.constexpr, q_smem, qpe_smem, kv_smem, pe_smem, p_smem, m_smem, l_smem, ready, empty,
                         p_ready, l_ready, bits_ptr, o_ptr, lse_ptr, sm_scale, prefix, s_start, s_end, n_tiles, q0,
                         b, split, T, H, NUM_SPLITS, R: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_S: gl.constexpr,
                         STAGES: gl.constexpr):
        # math warpgroup W (4 warps): the tiles W, W + 2, ... and output columns [W * R/2, (W + 1) * R/2)
        HALF: gl.constexpr = R // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_S, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        rows = q0 + gl.arange(0, BLOCK_Q, layout=row_l)
        bits = gl.load(bits_ptr + b * T + rows // H, mask=rows < T * H, other=0)      # [BLOCK_Q] tree-mask words
        cols = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(0, s_layout))
        m_run = gl.full([BLOCK_Q], float("-inf"), gl.float32, layout=row_l)            # max after the last tile
        l_own = gl.zeros([BLOCK_Q], gl.float32, layout=row_l)                          # sum of our tiles' P
        acc = gl.zeros([BLOCK_Q, HALF], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_Q, BLOCK_S], gl.float32, layout=s_layout)
        if W == 0:                               # tile 0: no tile of the other warpgroup before it
            acc, l_own, m_run = _mla_seesaw_own(0, False, acc, l_own, m_run, q_smem, qpe_smem, kv_smem, pe_smem,
                                                p_smem, m_smem, ready, empty, p_ready, bits, cols, s_zero, sm_scale,
                                                prefix, s_start, s_end, W, HALF, BLOCK_S, STAGES, o_layout, row_l)
        for i in range(2 - W, n_tiles, 2):
            acc, l_own, m_run = _mla_seesaw_own(i, True, acc, l_own, m_run, q_smem, qpe_smem, kv_smem, pe_smem,
                                                p_smem, m_smem, ready, empty, p_ready, bits, cols, s_zero, sm_scale,
                                                prefix, s_start, s_end, W, HALF, BLOCK_S, STAGES, o_layout, row_l)
        last = n_tiles - 1
        if last % 2 != W:                        # the split ends on the other's tile
            acc, l_own, m_run = _mla_seesaw_other(last, acc, l_own, m_run, kv_smem, p_smem, m_smem, ready, p_ready,
                                                  W, HALF, STAGES, o_layout, row_l)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(last % STAGES))

        # both halves followed the same max sequence: the row sums add
        l_smem.slice(W * BLOCK_Q, BLOCK_Q).store(l_own)
        gl.thread_barrier()
        mbarrier.arrive(l_ready)
        mbarrier.wait(l_ready, 0)
        l_tot = l_smem.slice(0, BLOCK_Q).load(row_l) + l_smem.slice(BLOCK_Q, BLOCK_Q).load(row_l)
        _mla_store_partial(acc, l_tot, m_run, o_ptr, lse_ptr, (b * NUM_SPLITS + split) * T * H, q0, T * H, W * HALF,
                           W == 0, R, BLOCK_Q, HALF, o_layout)

    @gluon.jit
    def _mla_seesaw_kernel(q_lat_ptr, q_pe_ptr, kv_desc, pe_desc, prefix_ptr, bits_ptr, o_ptr, lse_ptr,
                           sm_scale, T, H, NUM_SPLITS, S_SLOTS, stride_qb, stride_qt, stride_qh,
                           R: gl.constexpr, P: gl.constexpr, MIN_SPLIT: gl.constexpr, BLOCK_Q: gl.constexpr,
                           BLOCK_S: gl.constexpr, STAGES: gl.constexpr, REGS: gl.constexpr):
        # grid (q block, split, b) as _mla_split_kernel; 4 warps here (math warpgroup 0), + 4 (math warpgroup 1)
        # + 1 (loads) in the warp-specialized part
        b = gl.program_id(2)
        split = gl.program_id(1)
        prefix, L, s_start, s_end = _mla_split_range(prefix_ptr, b, split, T, NUM_SPLITS, MIN_SPLIT, BLOCK_S)
        if s_start < L:
            n_tiles = gl.cdiv(s_end - s_start, BLOCK_S)
            dtype: gl.constexpr = q_lat_ptr.dtype.element_ty
            q0 = gl.program_id(0) * BLOCK_Q
            q_smem, qpe_smem = _mla_query_smem(q_lat_ptr, q_pe_ptr, b, q0, T, H, stride_qb, stride_qt, stride_qh,
                                               R, P, BLOCK_Q, 64, 4)
            p_smem = gl.allocate_shared_memory(dtype, [BLOCK_Q, BLOCK_S],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_Q, BLOCK_S], dtype))
            flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
            m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_Q], flat)            # the max handed over
            l_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_Q], flat)        # both row sums, at the end
            kv_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_S, R], kv_desc.layout)
            pe_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_S, P], pe_desc.layout)
            bar: gl.constexpr = mbarrier.MBarrierLayout()
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)      # tile landed (TMA bytes)
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)      # both warpgroups done with it
            p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar)         # warpgroup w's P and max written
            l_ready = gl.allocate_shared_memory(gl.int64, [1], bar)            # both row sums written
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
                mbarrier.init(empty.index(i), count=2)
            for i in gl.static_range(2):
                mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(l_ready, count=2)
            fence_async_shared()
            gl.thread_barrier()
            gl.warp_specialize([  # (a tuple built by `+` would lose its constexprs: each argument list in full)
                (_mla_seesaw_math, (0, q_smem, qpe_smem, kv_smem, pe_smem, p_smem, m_smem, l_smem, ready, empty,
                                    p_ready, l_ready, bits_ptr, o_ptr, lse_ptr, sm_scale, prefix, s_start, s_end,
                                    n_tiles, q0, b, split, T, H, NUM_SPLITS, R, BLOCK_Q, BLOCK_S, STAGES)),
                (_mla_seesaw_math, (1, q_smem, qpe_smem, kv_smem, pe_smem, p_smem, m_smem, l_smem, ready, empty,
                                    p_ready, l_ready, bits_ptr, o_ptr, lse_ptr, sm_scale, prefix, s_start, s_end,
                                    n_tiles, q0, b, split, T, H, NUM_SPLITS, R, BLOCK_Q, BLOCK_S, STAGES)),
                (_mla_seesaw_loader, (kv_desc, pe_desc, kv_smem, pe_smem, ready, empty, b * S_SLOTS + s_start,
                                      n_tiles, R, BLOCK_S, STAGES)),
            ], [4, 1], [REGS, 24])


@torch.compiler.disable
def _mla_hopper_split(c: dict, q_lat, q_pe, cache, prefix_len, bits, softmax_scale, o_part, lse_part, grid):
    # stage 1 on Hopper, grid (q blocks, splits, B) as sized by mla_tree_attention; c: ATTN_WGMMA or ATTN_SEESAW.
    # Opaque to torch.compile, as fused_moe_w4a16 is: dynamo would take a Gluon kernel for a Triton one to rebuild
    _, T, H, R = q_lat.shape
    P = q_pe.shape[-1]
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[cache.dtype]
    rows2d = cache.view(-1, R + P)                                       # [B * S, R + P]: one TMA descriptor each
    descs = [TensorDescriptor(rows2d, list(rows2d.shape), list(rows2d.stride()), [c["BLOCK_S"], n],
                              gl.NVMMASharedLayout.get_default_for([c["BLOCK_S"], n], gdt)) for n in (R, P)]
    args = (q_lat, q_pe, *descs, prefix_len, bits, o_part, lse_part, softmax_scale, T, H, grid[1], cache.shape[1],
            *q_lat.stride()[:3])
    blocks = dict(R=R, P=P, MIN_SPLIT=ATTN_SPLITS["min_split_len"], BLOCK_Q=c["BLOCK_Q"], BLOCK_S=c["BLOCK_S"],
                  STAGES=c["STAGES"])
    if c is ATTN_SEESAW:   # maxnreg: 12 warps' registers, which the partitions then re-divide (REGS, 24, the rest)
        _mla_seesaw_kernel[grid](*args, **blocks, REGS=c["regs"], num_warps=4, maxnreg=c["maxnreg"])
    else:
        _mla_wgmma_kernel[grid](*args, **blocks, num_warps=c["num_warps"])


def _num_splits(S: int, max_splits: int, min_split_len: int, waves: float, programs: int, device) -> int:
    # the grid depends on shapes only (no sync): splits of S cache keys for ~`waves` waves of `programs` programs per
    # split, at most one split per min_split_len keys
    return max(1, min(max_splits, triton.cdiv(S, min_split_len), triton.cdiv(int(waves * _sm_count(device)), programs)))


def _merge_splits(o_part, lse_part, prefix_len, out, T: int, H: int, MIN_SPLIT: int, BLOCK_S: int) -> None:
    # stage 2 of the split attentions: o_part [B, NS, T*H, R] fp32 and lse_part [B, NS, T*H] -> out [B, T, H, R]
    B, num_splits, _, R = o_part.shape
    SPLITS = triton.next_power_of_2(num_splits)
    BLOCK_R = min(R, max(16, 1 << (ATTN_MERGE["elements"] // SPLITS).bit_length() - 1))     # a power of two
    _mla_merge_kernel[(B, T * H, R // BLOCK_R)](
        o_part, lse_part, prefix_len, out, T, H, num_splits, R=R, MIN_SPLIT=MIN_SPLIT, BLOCK_S=BLOCK_S,
        SPLITS=SPLITS, BLOCK_R=BLOCK_R, num_warps=ATTN_MERGE["num_warps"])


def mla_tree_attention(q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale: float, out=None):
    B, T, H, R = q_lat.shape
    P = q_pe.shape[-1]
    assert HAS_TRITON, "triton is not installed; call mla_tree_attention_ref"
    assert q_pe.shape == (B, T, H, P), f"q_pe {tuple(q_pe.shape)} vs q_lat {tuple(q_lat.shape)}"
    assert cache.dim() == 3 and cache.shape[0] == B and cache.shape[2] == R + P, f"cache {tuple(cache.shape)}: [B, S, R+P]"
    assert prefix_len.shape == (B,) and prefix_len.dtype == torch.int64, "prefix_len: want int64 [B]"
    packed = tree_mask.dtype == torch.int64
    assert tree_mask.shape == ((B, T) if packed else (B, T, T)) and tree_mask.dtype in (torch.bool, torch.int64), \
        f"tree_mask: want bool [B, T, T] or its packed rows int64 [B, T] (tree_mask_bits), got {tree_mask.dtype} " \
        f"{tuple(tree_mask.shape)}"
    assert T <= MASK_WORD_BITS, f"tree part is a {MASK_WORD_BITS}-bit mask per row: T={T} > {MASK_WORD_BITS}"
    assert q_lat.dtype == q_pe.dtype == cache.dtype, f"dtypes differ: {q_lat.dtype}, {q_pe.dtype}, {cache.dtype}"
    for n in (R, P):
        assert n >= 16 and n & (n - 1) == 0, f"R={R} and P={P} must be powers of two >= 16 (tl.arange, tl.dot)"
    for name, t in dict(q_pe=q_pe, cache=cache, prefix_len=prefix_len).items():
        assert t.is_contiguous(), f"{name} must be contiguous"
    assert q_lat.stride(-1) == 1, "q_lat: the latent (last) dim must be contiguous"
    if out is None:
        out = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    assert out.shape == q_lat.shape and out.dtype == q_lat.dtype and out.is_contiguous(), "out: like q_lat, contiguous"

    rows = T * H
    hopper, wide, cfg = _attention_path(q_lat, cache, rows)
    BLOCK_Q, BLOCK_S, MIN_SPLIT = cfg["BLOCK_Q"], cfg["BLOCK_S"], ATTN_SPLITS["min_split_len"]
    assert MIN_SPLIT % BLOCK_S == 0, "min_split_len must be a multiple of BLOCK_S"
    n_qblocks = triton.cdiv(rows, BLOCK_Q)

    def splits(waves: float) -> int:
        return _num_splits(cache.shape[1], ATTN_SPLITS["max_splits"], MIN_SPLIT, waves, B * n_qblocks, q_lat.device)
    if hopper:  # one wave, or two where one would make the splits longer than max_split_len
        num_splits = splits(1)
        if triton.cdiv(cache.shape[1], num_splits) > hopper["max_split_len"]:
            num_splits = splits(2)
    else:
        num_splits = splits(ATTN_WIDE["waves"] if wide else ATTN_SPLITS["waves"])

    bits = tree_mask.contiguous() if packed else tree_mask_bits(tree_mask)       # [B, T] int64
    o_part = _empty((B, num_splits, T * H, R), torch.float32, q_lat.device)
    lse_part = _empty((B, num_splits, T * H), torch.float32, q_lat.device)
    if hopper:
        _mla_hopper_split(hopper, q_lat, q_pe, cache, prefix_len, bits, softmax_scale, o_part, lse_part,
                          (n_qblocks, num_splits, B))
    else:
        _mla_split_kernel[(n_qblocks, num_splits, B)](
            q_lat, q_pe, cache, prefix_len, bits, o_part, lse_part,
            softmax_scale, T, H, num_splits, cache.stride(0), cache.stride(1), *q_lat.stride()[:3],
            R=R, P=P, MIN_SPLIT=MIN_SPLIT, **cfg)
    _merge_splits(o_part, lse_part, prefix_len, out, T, H, MIN_SPLIT, BLOCK_S)
    return out


def mla_tree_attention_ref(q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale: float, out=None):
    B, T, H, R = q_lat.shape
    S = cache.shape[1]
    if tree_mask.dtype == torch.int64:                                          # packed rows -> [B, T, T] bool
        tree_mask = tree_mask_unpack(tree_mask)
    kv, k_pe = cache[..., :R].float(), cache[..., R:].float()                  # [B, S, R], [B, S, P]
    scores = torch.einsum("bthr,bsr->bths", q_lat.float(), kv) + torch.einsum("bthp,bsp->bths", q_pe.float(), k_pe)
    scores = scores * softmax_scale                                             # [B, T, H, S]

    # visibility [B, T, S]: the committed prefix, plus tree slot j = s - prefix_len where tree_mask[b, t, j]
    s = torch.arange(S, device=cache.device)
    j = s[None, :] - prefix_len[:, None]                                        # [B, S]
    in_tree = torch.gather(tree_mask, 2, j.clamp(0, T - 1)[:, None, :].expand(B, T, S))
    visible = (j < 0)[:, None, :] | (((j >= 0) & (j < T))[:, None, :] & in_tree)

    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).masked_fill(~visible.any(-1)[:, :, None, None], 0.0)  # no visible key -> zeros
    o = torch.einsum("bths,bsr->bthr", p, kv).to(q_lat.dtype)
    if out is not None:
        return out.copy_(o)
    return o


# ----------------------------------------------------------------------------------------------------------
# Fused glue of a decode / verify step. At T <= 64 tokens every elementwise PyTorch op is a launch of ~2 µs plus
# ~1 µs of gap even inside a CUDA graph (RMSNorm alone is 7-8 ops: cast, pow, mean, add, rsqrt, mul, cast, mul),
# and this glue was most of a K2.6 layer step's ~70 launches (H200, bench.py layers, 2026-11-30; 34-36 after).
# Each kernel replaces a run of ops and rounds where its twin's ops round (every PyTorch op rounds its result to
# the tensor's dtype): the residual add is bit-exact, rope within one rounding (the compiled kernel differed in the
# last bit of some elements on the H200), norms and sigmoids differ only in reduction order and exp.


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
    # x * cos + partner * sin, each product rounded to x's dtype before the sum, as rope_ref's four ops round
    a = (x.to(tl.float32) * cos.to(tl.float32)).to(x.dtype)
    b = (partner.to(tl.float32) * sin.to(tl.float32)).to(x.dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)


@triton.jit
def _partner(cols, P: tl.constexpr, INTERLEAVED: tl.constexpr):
    # the column a rope pair rotates against: adjacent (x[2i], x[2i+1]) for DeepSeek/K2, halves (x[i], x[i+P/2]) for
    # Qwen3 (the drafter)
    if INTERLEAVED:
        return cols ^ 1
    else:
        return (cols + P // 2) % P


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_row, N, EPS: tl.constexpr, BLOCK: tl.constexpr):
    # program row: y[row] = w * (x[row] / sqrt(mean(x[row]^2) + eps)); EPS is a constexpr so it stays fp32
    # (a Python float argument becomes fp64 when inductor relaunches a kernel)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    y = _normalize(tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0), N, EPS)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * N + cols, _scale(w, y, y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    assert HAS_TRITON, "triton is not installed; call rms_norm_ref"
    assert weight.shape == (N,) and weight.is_contiguous(), f"weight: want contiguous [{N}], got {tuple(weight.shape)}"
    rows = x.reshape(-1, N)                      # a view for contiguous x and for a last-dim slice of a contiguous one
    assert rows.stride(-1) == 1, "x: the normalized (last) dim must be contiguous"
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0] == 0:                       # e.g. no new context rows for the drafter this step
        return out
    BLOCK = triton.next_power_of_2(N)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), N, EPS=float(eps), BLOCK=BLOCK,
                                       num_warps=_row_warps(BLOCK))
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics, cast back, then scale (the transformers order; it matters in bf16)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _row_warps(block: int) -> int:
    return min(8, max(1, block // 512))


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, N, EPS: tl.constexpr, BLOCK: tl.constexpr):
    # s = x + r (the residual stream, rounded like the PyTorch add), y = RMSNorm(s): one read of each input
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    s = (x.to(tl.float32) + tl.load(r_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    tl.store(s_ptr + row * N + cols, s, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * N + cols, _scale(w, _normalize(s, N, EPS), y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    """(x + r, rms_norm(x + r)): a residual add and the next norm in one launch. x, r: [..., N], one dtype."""
    N = x.shape[-1]
    assert HAS_TRITON, "triton is not installed; call add_rms_norm_ref"
    assert r.shape == x.shape and r.dtype == x.dtype, f"r {r.dtype} {tuple(r.shape)} vs x {x.dtype} {tuple(x.shape)}"
    assert weight.shape == (N,) and weight.is_contiguous(), f"weight: want contiguous [{N}], got {tuple(weight.shape)}"
    x, r = x.contiguous(), r.contiguous()
    s = torch.empty_like(x)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    n_rows = x.numel() // N if N else 0
    if n_rows:
        BLOCK = triton.next_power_of_2(N)
        _add_rms_norm_kernel[(n_rows,)](x, r, weight, s, y, N, EPS=float(eps), BLOCK=BLOCK, num_warps=_row_warps(BLOCK))
    return s, y


def add_rms_norm_ref(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    s = x + r
    return s, rms_norm_ref(s, weight, eps)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, H, sx_b, sx_t, sx_h, sc_b, sc_t,
                 P: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr):
    # program (n, head block): token n = (b, t), BLOCK_H of its H heads x P rope columns; y is contiguous [B, T, H, P]
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


# heads per program: one program per token left a 64-head step with 9 programs (H200, TP1, T = 9: 3.8 -> 1.4 us)
ROPE_BLOCK_H = 8


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """x [B, T, H, P] or [B, T, P], cos / sin [B, T, P] (the rope_cos_sin layouts; any strides with a contiguous
    last dim, e.g. the q_pe slice of q) -> rotated x, contiguous. interleaved: pairs (x[2i], x[2i+1]) (DeepSeek /
    K2); else (x[i], x[i + P/2]) (Qwen3, the drafter)."""
    assert HAS_TRITON, "triton is not installed; call rope_ref"
    B, T, P = x.shape[0], x.shape[1], x.shape[-1]
    x4 = x if x.dim() == 4 else x.unsqueeze(2)                                       # [B, T, H, P]
    assert cos.shape == sin.shape == (B, T, P) and cos.stride() == sin.stride(), \
        f"cos / sin: want [{B}, {T}, {P}] with one layout, got {tuple(cos.shape)} {tuple(sin.shape)}"
    assert cos.dtype == sin.dtype == x.dtype, f"x, cos, sin: one dtype, got {x.dtype} {cos.dtype} {sin.dtype}"
    assert P >= 2 and P & (P - 1) == 0, f"rope dim {P} must be a power of two"
    assert x4.stride(-1) == 1 and cos.stride(-1) == 1, "x, cos, sin: the rope dim must be contiguous"
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        H = x4.shape[2]
        BLOCK_H = min(ROPE_BLOCK_H, triton.next_power_of_2(H))
        _rope_kernel[(B * T, triton.cdiv(H, BLOCK_H))](x4, cos, sin, y, T, H, *x4.stride()[:3], *cos.stride()[:2], P=P,
                                                      BLOCK_H=BLOCK_H, INTERLEAVED=interleaved)
    return y


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """x * cos + partner(x) * sin in four elementwise ops; the sign of the rotation sits in sin (see rope)."""
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleaved:
        partner = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)                     # (x2, x1) per adjacent pair
    else:
        x1, x2 = x.chunk(2, dim=-1)
        partner = torch.cat([x2, x1], dim=-1)                                        # rotate_half without the sign
    return x * cos + partner * sin


@triton.jit
def _mla_latent_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, slots_ptr, cache_ptr, T, stride_kv, stride_cb, stride_cs,
                       R: tl.constexpr, P: tl.constexpr, EPS: tl.constexpr):
    # program n = token (b, t): cache[b, slots[n]] = (kv_a_layernorm(kv[n, :R]), rope(kv[n, R:]))
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


def mla_latent_to_cache(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                        cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The new tokens' compressed-cache rows, written in place: kv [B, T, R+P] (kv_a_proj_with_mqa's output, rows
    may be strided) -> cache[b, slots[b, t]] = (RMSNorm(kv[..., :R]) * weight, rope(kv[..., R:])), one launch
    instead of the norm, rope, cat and scatter (~8). cache [Bmax, S, R+P], slots [B, T] int64, cos / sin [B, T, P]."""
    assert HAS_TRITON, "triton is not installed; call mla_latent_to_cache_ref"
    B, T, C = kv.shape
    R = weight.shape[0]
    P = C - R
    assert cache.dim() == 3 and cache.shape[0] >= B and cache.shape[2] == C and cache.stride(2) == 1, \
        f"cache {tuple(cache.shape)}: want [>= {B}, S, {C}] with a contiguous last dim"
    assert slots.shape == (B, T) and slots.dtype == torch.int64 and slots.is_contiguous(), "slots: contiguous int64 [B, T]"
    assert cos.shape == sin.shape == (B, T, P) and cos.is_contiguous() and sin.is_contiguous(), f"cos / sin: [{B}, {T}, {P}]"
    assert kv.dtype == weight.dtype == cache.dtype == cos.dtype, \
        f"kv, weight, cache, cos: one dtype, got {kv.dtype} {weight.dtype} {cache.dtype} {cos.dtype}"
    for n in (R, P):
        assert n >= 2 and n & (n - 1) == 0, f"R={R} and P={P} must be powers of two"
    rows = kv.reshape(B * T, C)        # a view for kv contiguous or a last-dim slice of one (model.linear_rows)
    assert rows.stride(-1) == 1 and weight.is_contiguous(), "kv: contiguous last dim; weight: contiguous"
    if B * T:
        _mla_latent_kernel[(B * T,)](rows, weight, cos, sin, slots, cache, T, rows.stride(0), cache.stride(0), cache.stride(1),
                                     R=R, P=P, EPS=float(eps), num_warps=_row_warps(R))


def mla_latent_to_cache_ref(kv, weight, eps: float, cos, sin, cache, slots) -> None:
    R = weight.shape[0]
    latent = torch.cat([rms_norm_ref(kv[..., :R], weight, eps), rope_ref(kv[..., R:], cos, sin)], dim=-1)
    B, T, C = latent.shape
    cache[:B].scatter_(1, slots[:, :, None].expand(B, T, C), latent.to(cache.dtype))


# ----------------------------------------------------------------------------------------------------------
# The DFlash drafter's layer (draft.py). A drafter forward is the bigger half of a small model's speculative step: its
# every op is a launch (~2 us in a CUDA graph), and per layer it had ~30 (H200, bundled pair: 96 PyTorch kernels per
# draft against 58 for a whole target step). Two kernels take the middle of a layer: qkv_norm_rope (the q / k norms,
# rope, and the context and block K/V written to the drafter's cache: ~10 ops) and block_attention (the block's
# queries over the cached context and the block itself: ~8 ops, no mask tensor, no concatenation).


@triton.jit
def _norm_rope_head(src, w_ptr, cos, sin, HD: tl.constexpr, EPS: tl.constexpr, INTERLEAVED: tl.constexpr):
    # one head's RMSNorm (weight w) then rope, rounded where rms_norm_ref and rope_ref round; the partner columns are
    # loaded again rather than permuted in registers, and normalized with the same statistics
    cols = tl.arange(0, HD)
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
    # program (token n = (b, t), head j of the H q heads, KV k heads, KV v heads of qkv's row n)
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    b, t = n // T, n % T
    src = qkv_ptr + n * stride_row + j * HD
    cols = tl.arange(0, HD)
    slot = tl.load(slots_ptr + n)
    if j < H:                                            # a query head: only the block's rows (t >= Q0) want one
        if t >= Q0:
            y = _norm_rope_head(src, qw_ptr, tl.load(cos_ptr + n * HD + cols), tl.load(sin_ptr + n * HD + cols),
                                HD, EPS, INTERLEAVED)
            tl.store(q_ptr + ((b * (T - Q0) + t - Q0) * H + j) * HD + cols, y)
    elif j < H + KV:                                     # a key head: normalized, rotated, into the cache
        y = _norm_rope_head(src, kw_ptr, tl.load(cos_ptr + n * HD + cols), tl.load(sin_ptr + n * HD + cols),
                            HD, EPS, INTERLEAVED)
        tl.store(k_ptr + b * sk_b + slot * sk_s + (j - H) * sk_h + cols, y)
    else:                                                # a value head: copied into the cache as it is
        tl.store(v_ptr + b * sv_b + slot * sv_s + (j - H - KV) * sv_h + cols, tl.load(src + cols))


def _check_qkv(qkv, n_heads, n_kv, q_weight, k_weight, cos, sin, k_cache, v_cache, slots, q_start):
    B, T, W = qkv.shape
    hd = q_weight.shape[0]
    assert W == (n_heads + 2 * n_kv) * hd, f"qkv width {W}: want (n_heads {n_heads} + 2 n_kv {n_kv}) x head_dim {hd}"
    assert k_weight.shape == (hd,), f"k_weight {tuple(k_weight.shape)}: want [{hd}]"
    assert cos.shape == sin.shape == (B, T, hd), f"cos / sin {tuple(cos.shape)}: want [{B}, {T}, {hd}]"
    for name, c in dict(k_cache=k_cache, v_cache=v_cache).items():
        assert c.dim() == 4 and c.shape[0] >= B and c.shape[2:] == (n_kv, hd), \
            f"{name} {tuple(c.shape)}: want [>= {B}, S, {n_kv}, {hd}]"
    assert slots.shape == (B, T) and slots.dtype == torch.int64, f"slots: want int64 [{B}, {T}]"
    assert 0 <= q_start <= T, f"q_start {q_start} outside [0, {T}]"


def qkv_norm_rope(qkv, n_heads: int, n_kv: int, q_weight, k_weight, eps: float, cos, sin, k_cache, v_cache, slots,
                  q_start: int, interleaved: bool = False) -> torch.Tensor:
    """A drafter layer's fused q|k|v projection output qkv [B, T, (H + 2 KV) * hd] (rows may be strided) -> the
    queries of rows t >= q_start, q_norm'ed and rotated, [B, T - q_start, H, hd] contiguous; every row's k_norm'ed,
    rotated key and its value are written in place to k_cache / v_cache [Bmax, S, KV, hd] at (b, slots[b, t]).
    cos / sin [B, T, hd] (rope_cos_sin, halves layout unless interleaved). One launch."""
    assert HAS_TRITON, "triton is not installed; call qkv_norm_rope_ref"
    _check_qkv(qkv, n_heads, n_kv, q_weight, k_weight, cos, sin, k_cache, v_cache, slots, q_start)
    B, T, W = qkv.shape
    hd = q_weight.shape[0]
    assert hd >= 2 and hd & (hd - 1) == 0, f"head_dim {hd} must be a power of two (the reference takes any)"
    assert qkv.dtype == q_weight.dtype == k_weight.dtype == cos.dtype == k_cache.dtype == v_cache.dtype, \
        f"one dtype: qkv {qkv.dtype}, weights {q_weight.dtype}, cos {cos.dtype}, caches {k_cache.dtype}"
    rows = qkv.reshape(B * T, W)               # a view for qkv contiguous or a row-strided one
    assert rows.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous() and slots.is_contiguous(), \
        "qkv: contiguous last dim; cos, sin, slots: contiguous"
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1, "k_cache / v_cache: contiguous head_dim"
    q = torch.empty(B, T - q_start, n_heads, hd, dtype=qkv.dtype, device=qkv.device)        # [B, bs, H, hd]
    if B * T:
        _qkv_norm_rope_kernel[(B * T, n_heads + 2 * n_kv)](
            rows, q_weight, k_weight, cos, sin, slots, q, k_cache, v_cache, T, q_start, n_heads, n_kv, rows.stride(0),
            *k_cache.stride()[:3], *v_cache.stride()[:3], HD=hd, EPS=float(eps), INTERLEAVED=interleaved,
            num_warps=1)
    return q


def qkv_norm_rope_ref(qkv, n_heads: int, n_kv: int, q_weight, k_weight, eps: float, cos, sin, k_cache, v_cache,
                      slots, q_start: int, interleaved: bool = False) -> torch.Tensor:
    _check_qkv(qkv, n_heads, n_kv, q_weight, k_weight, cos, sin, k_cache, v_cache, slots, q_start)
    B = qkv.shape[0]
    q, k, v = qkv.unflatten(-1, (n_heads + 2 * n_kv, -1)).split([n_heads, n_kv, n_kv], dim=2)  # [B, T, heads, hd]
    rows = torch.arange(B, device=qkv.device)[:, None]                                          # [B, 1]
    k_cache[rows, slots] = rope_ref(rms_norm_ref(k, k_weight, eps), cos, sin, interleaved)
    v_cache[rows, slots] = v
    return rope_ref(rms_norm_ref(q[:, q_start:], q_weight, eps), cos[:, q_start:], sin[:, q_start:], interleaved)


@triton.jit
def _block_attn_kernel(q_ptr, k_ptr, v_ptr, prefix_ptr, o_ptr, lse_ptr, out_ptr, sm_scale, T, H, NUM_SPLITS,
                       sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                       G: tl.constexpr, HD: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_S: tl.constexpr, DIRECT: tl.constexpr):
    # grid (q block, split, b * KV + kv head). The query rows of kv head c are r = t * G + g (head h = c * G + g): the
    # G heads that share it, for all T block tokens, so each K/V tile is loaded once for all of them. Keys s < L =
    # prefix + T are visible (the context, then the block). The splits are _mla_split_kernel's; so are the partial
    # outputs (rows t * H + h), which _mla_merge_kernel merges. DIRECT (one split): the normalized output is final.
    KV = H // G
    b = tl.program_id(2) // KV
    c = tl.program_id(2) % KV
    split = tl.program_id(1)
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


# One split up to min_split_len cache slots, so the bundled drafter's attention (a few hundred slots) is one launch
# with no merge; longer caches (the K2.6 drafter at 4k-32k) split for ~`waves` waves like the target's attention.
DRAFT_ATTN = dict(BLOCK_Q=16, BLOCK_S=64, num_warps=4, min_split_len=512, max_splits=128, waves=1)


def block_attention(q, k_cache, v_cache, prefix_len, softmax_scale: float, out=None) -> torch.Tensor:
    """The DFlash block's attention: q [B, T, H, hd] (the T block tokens' queries, contiguous), k_cache / v_cache
    [B, S, KV, hd] (any row strides, head_dim contiguous; GQA: query head h reads kv head h // (H / KV)); row b
    sees its keys s < prefix_len[b] + T, the context then the block itself, with no mask. -> [B, T, H, hd]."""
    assert HAS_TRITON, "triton is not installed; call block_attention_ref"
    B, T, H, hd = q.shape
    S, KV = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape == v_cache.shape == (B, S, KV, hd), f"k/v_cache {tuple(k_cache.shape)}: want [{B}, S, KV, {hd}]"
    assert H % KV == 0, f"{H} query heads do not share {KV} kv heads evenly"
    assert hd >= 16 and hd & (hd - 1) == 0, f"head_dim {hd} must be a power of two >= 16 (tl.dot)"
    assert q.is_contiguous() and k_cache.stride(-1) == v_cache.stride(-1) == 1, "q contiguous; caches: contiguous hd"
    assert prefix_len.shape == (B,) and prefix_len.dtype == torch.int64, "prefix_len: want int64 [B]"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes differ: {q.dtype} {k_cache.dtype} {v_cache.dtype}"
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous(), "out: like q, contiguous"
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


def block_attention_ref(q, k_cache, v_cache, prefix_len, softmax_scale: float, out=None) -> torch.Tensor:
    """softmax(q k^T * scale) v in fp32 (as the kernel, and flash attention, compute it), cast back to q's dtype: two
    matmuls, the G = H / KV query heads of a kv head stacked as the rows of one. Why not
    F.scaled_dot_product_attention: with a mask and 8 query rows per head it picked cuDNN, which spread that little
    work over few blocks (H200, bf16: 94.8 vs 19.6 us at the K2.6 drafter's TP8 shapes and 4096 slots)."""
    B, T, H, hd = q.shape
    S, KV = k_cache.shape[1], k_cache.shape[2]
    qg = q.float().transpose(1, 2).reshape(B, KV, H // KV * T, hd)                       # [B, KV, G*T, hd]
    s = torch.matmul(qg, k_cache.float().transpose(1, 2).transpose(-1, -2)) * softmax_scale   # [B, KV, G*T, S]
    visible = torch.arange(S, device=q.device) < (prefix_len + T)[:, None]             # [B, S]
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    o = torch.matmul(s.softmax(-1), v_cache.float().transpose(1, 2)).view(B, H, T, hd).transpose(1, 2)
    o = o.to(q.dtype)                                                                   # [B, T, H, hd]
    return o if out is None else out.copy_(o)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr):
    # program (row, column block); g and u may be row-strided views, e.g. the two halves of one gate/up GEMM's output
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)                                       # F.silu, rounded
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * N + cols, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(g) * u in one launch (g, u: one shape and dtype, last dim contiguous; rows may be strided, as
    the halves of model.linear_rows' gate/up output are) -> contiguous."""
    assert HAS_TRITON, "triton is not installed; call silu_mul_ref"
    assert g.shape == u.shape and g.dtype == u.dtype, f"g {g.dtype} {tuple(g.shape)} vs u {u.dtype} {tuple(u.shape)}"
    N = g.shape[-1]
    g2, u2 = g.reshape(-1, N), u.reshape(-1, N)               # views when only the rows are strided
    assert g2.stride(-1) == 1 and u2.stride(-1) == 1, "g, u: the last dim must be contiguous"
    y = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if g.numel():
        BLOCK = min(1024, triton.next_power_of_2(N))
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(N, BLOCK))](g2, u2, y, N, g2.stride(0), u2.stride(0), BLOCK=BLOCK)
    return y


def silu_mul_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


@triton.jit
def _split_bf16(v):
    # v (fp32) = hi + lo + O(2^-16 |v|), hi and lo bf16: exactly v when v is a bf16 or fp16 value (8 + 8 mantissa bits)
    hi = v.to(tl.bfloat16)
    return hi, (v - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _router_kernel(x_ptr, w_ptr, part_ptr, N, E, D, D_SPLIT,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_BF16: tl.constexpr):
    # Program (e block, split): partial router logits over columns split*D_SPLIT.. of D -> part[split, t, e], for all
    # N <= BLOCK_T tokens. x [N, D] 16- or 32-bit, w [E, D] fp32 (a bf16 checkpoint upcast at load).
    # SPLIT_BF16 (GPU): each operand as hi + lo bf16 and three tensor-core dots with fp32 accumulation (lo x lo is
    # below fp32 rounding); for bf16 x and a bf16 checkpoint weight the lo parts are 0 and every product is exact,
    # so only the summation order differs from F.linear in fp32. Else (the interpreter, whose bf16 dot is wrong):
    # one fp32 dot. A plain fp32 tl.dot on the GPU took ~35 us here (FMA lowering), slower than cuBLAS.
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    e_mask, t_mask = offs_e < E, offs_t < N
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
    tl.store(part_ptr + (split * N + offs_t[:, None]) * E + offs_e[None, :], acc, mask=t_mask[:, None] & e_mask[None, :])


@triton.jit
def _moe_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, N, E, SPLITS, K: tl.constexpr, K_POW2: tl.constexpr,
                     NORM: tl.constexpr, SCALE: tl.constexpr, E_POW2: tl.constexpr):
    # program n = token: logits = the sum of the SPLITS partial logits [SPLITS, N, E] (in split order), sigmoid
    # scores, top-K of score + bias by repeated argmax (ties: lowest expert id), weights = the chosen scores (without
    # the bias), renormalized, times the routed scaling factor
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_POW2)
    logits = tl.zeros([E_POW2], dtype=tl.float32)
    for s in range(0, SPLITS):
        logits += tl.load(logits_ptr + (s * N + n) * E + e, mask=e < E, other=0.0)
    score = tl.sigmoid(logits)
    choice = tl.where(e < E, score + tl.load(bias_ptr + e, mask=e < E, other=0.0), float("-inf"))
    k = tl.arange(0, K_POW2)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    w = tl.zeros([K_POW2], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.min(tl.where(choice == tl.max(choice, 0), e, E_POW2), 0)
        ids = tl.where(k == j, best, ids)
        w = tl.where(k == j, tl.sum(tl.where(e == best, score, 0.0), 0), w)
        choice = tl.where(e == best, float("-inf"), choice)
    if NORM:
        w = w / (tl.sum(w, 0) + 1e-20)
    tl.store(w_ptr + n * K + k, w * SCALE, mask=k < K)
    tl.store(ids_ptr + n * K + k, ids.to(tl.int64), mask=k < K)


def _topk_launch(partial_logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm: bool, scale: float):
    S, N, E = partial_logits.shape
    w = torch.empty(N, top_k, dtype=torch.float32, device=partial_logits.device)
    ids = torch.empty(N, top_k, dtype=torch.int64, device=partial_logits.device)
    if N:
        _moe_topk_kernel[(N,)](partial_logits, bias, w, ids, N, E, S, K=top_k, K_POW2=triton.next_power_of_2(top_k),
                               NORM=norm, SCALE=float(scale), E_POW2=triton.next_power_of_2(E))
    return w, ids


def moe_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm: bool, scale: float,
             n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing after the router matmul: logits [N, E] fp32, bias [E] fp32 -> (weights [N, k] fp32, expert
    ids [N, k] int64), ids in descending order of score + bias. One launch instead of ~9 ops. Group-limited routing
    (n_group > 1, DeepSeek-V3) is left to moe_topk_ref: K2 / K2.6 use one group."""
    assert HAS_TRITON, "triton is not installed; call moe_topk_ref"
    assert n_group == 1, "moe_topk: group-limited routing (n_group > 1) runs in moe_topk_ref"
    N, E = logits.shape
    assert logits.dtype == bias.dtype == torch.float32 and bias.shape == (E,), "logits [N, E], bias [E]: float32"
    assert 1 <= top_k <= E and logits.is_contiguous() and bias.is_contiguous(), f"top_k {top_k}, E {E}; contiguous"
    return _topk_launch(logits[None], bias, top_k, norm, scale)


# Router matmul for decode / verify: the K2.6 router weight is [384, 7168] fp32 (11 MB, 2.6 us at 4.2 TB/s), and
# cuBLAS's fp32 GEMM plus moe_topk took 26 us per layer for T = 9 on an H200 (an sm80 SIMT tile + a split-K
# reduction). Programs of BLOCK_E experts x one slice of D stream the weight once; moe_topk's kernel sums the
# slices, in a fixed order.
ROUTER_MAX_T = 64       # more tokens (prefill): F.linear, where cuBLAS's tiles are full
# Sweep (H200, CUDA graphs, router + routing, us at N = 1 / 9 / 17 / 64 tokens): this config 10.0 / 10.2 / 14.5 /
# 13.2; BLOCK_E=16, BLOCK_D=128: 13.9 / 14.3 / 13.2 / 14.1; against 12.3 / 26.1 / 24.9 / 41.3 for cuBLAS fp32 + moe_topk.
ROUTER_BLOCKS = dict(BLOCK_E=32, BLOCK_D=64, num_warps=4, num_stages=3)


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, norm: bool, scale: float,
                n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole noaux_tc router: x [N, D], weight [E, D] fp32, bias [E] fp32 -> (weights [N, k] fp32, expert ids
    [N, k] int64) = moe_topk(x @ weight^T in fp32). Two launches for N <= ROUTER_MAX_T."""
    assert HAS_TRITON, "triton is not installed; call router_topk_ref"
    assert n_group == 1, "router_topk: group-limited routing (n_group > 1) runs in router_topk_ref"
    N, D = x.shape
    E = weight.shape[0]
    assert weight.shape == (E, D) and weight.dtype == torch.float32, f"weight: want float32 [E, {D}], got " \
        f"{weight.dtype} {tuple(weight.shape)}"
    assert bias.shape == (E,) and bias.dtype == torch.float32, "bias: want float32 [E]"
    assert x.is_contiguous() and weight.is_contiguous() and bias.is_contiguous(), "x, weight, bias: contiguous"
    assert 1 <= top_k <= E, f"top_k {top_k}, E {E}"
    if N > ROUTER_MAX_T:
        return _topk_launch(F.linear(x.float(), weight)[None], bias, top_k, norm, scale)
    cfg = ROUTER_BLOCKS
    block_t = max(16, triton.next_power_of_2(N))                            # tl.dot's smallest tile is 16
    n_eb = triton.cdiv(E, cfg["BLOCK_E"])
    want_splits = triton.cdiv(2 * _sm_count(x.device), n_eb)               # slices of D for ~2 waves of programs
    d_split = triton.cdiv(triton.cdiv(D, want_splits), cfg["BLOCK_D"]) * cfg["BLOCK_D"]   # whole BLOCK_D tiles
    n_split = triton.cdiv(D, d_split)                                       # no empty slice
    part = _empty((n_split, N, E), torch.float32, x.device)                 # [splits, N, E] partial logits
    if N:
        _router_kernel[(n_eb, n_split)](x, weight, part, N, E, D, d_split, BLOCK_T=block_t, SPLIT_BF16=not INTERPRETED,
                                        **cfg)
    return _topk_launch(part, bias, top_k, norm, scale)


def router_topk_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, norm: bool, scale: float,
                    n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_topk_ref(F.linear(x.float(), weight.float()), bias, top_k, norm, scale, n_group, topk_group)


def moe_topk_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int, norm: bool, scale: float,
                 n_group: int = 1, topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.sigmoid()                                                           # [N, E]
    choice = scores + bias                  # the bias steers the choice only; the weights are the plain scores
    if n_group > 1:
        grouped = choice.view(logits.shape[0], n_group, -1)                             # [N, G, E/G]
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)                               # [N, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1)[1], True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
    ids = choice.topk(top_k, dim=-1)[1]                                                 # [N, k]
    w = scores.gather(1, ids)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


# ----------------------------------------------------------------------------------------------------------
# DDTree search in one launch (tree.py builds the same tree in ~65 ops: per-depth sorts, gathers, a radix sort of
# packed rank tuples; ~250 us per step on an H200 with a 4352-token vocabulary, launch-bound). Definitions (ranks,
# scores, keys, padding): tree.py's module docstring. One program per batch row runs the best-first search of
# tree.build_tree_ref with the heap replaced by a pool of 2B candidate slots held in registers:
#   slots     popping node i pushes at most two candidates, its next sibling (slot 2i) and its first child (slot
#             2i+1); the root's first child starts in slot 1
#   order     a pop takes the live candidate with the largest score, ties to the smallest rank tuple. Instead of
#             packing whole tuples, each live candidate keeps `pos`, its rank in tuple order among the live ones.
#             Live tuples never contain one another (a candidate's proper prefixes are all popped), so when t at
#             position P is popped, its first child (t, 0) takes P and its next sibling comes right after (P+1):
#             no live tuple lies between t and either of them; every live candidate after P moves up by one.
#   key       one int64 per slot orders the pool like the heap: bits 63..32 the score's float32 bits mapped to an
#             order-preserving int32 (decoded back bit-exactly), bits 31..24 255 - pos, bits 23..0 parent | depth
#             << 8 | rank << 16. Live positions are distinct, so one tl.max pops the unique best and decodes it.
# Invariant (the heap's): after i pops the live slots are exactly the heap's entries, so the max key is the
# (i+1)-th prefix in key order; scores are accumulated like the reference (parent score + logp in float32, from
# the root's 0.0). When no slot is live (V tiny) the remaining nodes are padding. Twin: tree.build_tree_ops.

TREE_MAX_BUDGET = 64    # parents are nodes < 64, so a parent's mask row fits one int64 (node 64 is never a parent)
TREE_MAX_DEPTH = 255    # depth is an 8-bit field of the key's payload


@triton.jit
def _sortable(x):
    # float32 -> int32 with the same order (x non-NaN; -0.0 sorts below 0.0, scores are never -0.0).
    # An involution on the int32 bits: flip the magnitude bits of negative floats.
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _unsortable(m):
    # the inverse of _sortable: int32 -> the float32 it came from, bit for bit
    return (m ^ ((m >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _key(score, pos, parent, depth, rank):
    # a candidate's int64 key (see the module doc); the int64 casts come before the shifts
    return (tl.cast(_sortable(score), tl.int64) << 32) | (tl.cast(255 - pos, tl.int64) << 24) \
        | tl.cast(parent | (depth << 8) | (rank << 16), tl.int64)


@triton.jit
def _tree_kernel(lp_ptr, tok_ptr, roots_ptr,          # [b, L, K] f32, [b, L, K] i64 (last stride 1), [b] i64
                 tokens_ptr, parents_ptr, depths_ptr,  # [b, N] i64 each
                 scores_ptr, valid_ptr, bits_ptr,      # [b, N] f32, [b, N] i8 (a bool view), [b, N] i64
                 mask_ptr,                             # [b, N, N] i8 (a bool view)
                 lp_sb, lp_sd, tok_sb, tok_sd,         # batch / depth strides of lp and tok
                 L, K, B,                              # depths, ranks kept per depth (min(B, V)), budget
                 NODES: tl.constexpr,                  # next_power_of_2(B + 1): mask row width
                 PARENTS: tl.constexpr,                # next_power_of_2(B): nodes 0..B-1, the ones that can be parents
                 SLOTS: tl.constexpr):                 # next_power_of_2(2 * B): the pool
    NEG_INF: tl.constexpr = float("-inf")
    # a dead slot: below every live key (a score of -inf maps to a larger top word), and with its
    # position field at 255 it never counts as "after" the popped node, so the position shift skips it
    DEAD: tl.constexpr = -(1 << 63) + (255 << 24)
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
    tl.store(bits_ptr + out, 1)
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
        pos = 255 - ((best >> 24) & 255).to(tl.int32)
        info = (best & 0xFFFFFF).to(tl.int32)
        parent = tl.where(real, info & 255, -1)
        depth = tl.where(real, (info >> 8) & 255, 0)
        rank = info >> 16                                          # (meaningless when not real)
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
        tl.store(bits_ptr + out + i, row_bits)
        in_row = (((row_bits >> (col & 63)) & 1) != 0) & (col < 64)  # [NODES]
        tl.store(mask_ptr + (out + i) * N + col, (in_row | (col == i)).to(tl.int8), mask=col < N)
        n_score = tl.where(node == i, score, n_score)
        n_bits = tl.where(node == i, row_bits, n_bits)

        # 3) push. Live candidates after i's position move up one (their field 255 - pos goes down one);
        # the next sibling (slot 2i) takes position pos+1, the first child (slot 2i+1) takes pos.
        shift = ((c_key >> 24) & 255) < 255 - pos                  # [SLOTS]
        c_key = tl.where(shift, c_key - (1 << 24), c_key)          # (the field is >= 191: no borrow)
        sib = tl.where(sib_ok, _key(pscore + sib_lp, pos + 1, parent, depth, rank + 1), DEAD)
        kid = tl.where(kid_ok, _key(score + kid_lp, pos, i, depth + 1, 0), DEAD)
        c_key = tl.where(slot == 2 * i, sib, tl.where(slot == 2 * i + 1, kid, c_key))


# torch.compile leaves this call opaque (like fused_moe_w4a16): the kernel is used as written in every step mode
@torch.compiler.disable
def ddtree_search(lp: torch.Tensor, tok: torch.Tensor, roots: torch.Tensor, budget: int) -> tuple:
    """Ranked drafts lp / tok [b, L, K] (tree._rank_tokens: logp desc, last dim contiguous), roots [b] int64 ->
    the tree's node fields for N = budget + 1 nodes: tokens, parents, depths [b, N] int64, scores [b, N] float32,
    valid [b, N] bool, ancestor mask [b, N, N] bool, and its rows packed [b, N] int64 (tree_mask_bits' format;
    None when N > 64). No host sync, fixed shapes."""
    assert HAS_TRITON, "triton is not installed; call tree.build_tree_ops"
    bsz, L, K = lp.shape
    B = budget
    assert 1 <= B <= TREE_MAX_BUDGET and 1 <= L <= TREE_MAX_DEPTH and 1 <= K <= B, \
        f"ddtree_search: budget {B} in [1, {TREE_MAX_BUDGET}], depth {L} in [1, {TREE_MAX_DEPTH}], K {K} in [1, B]"
    assert tok.shape == lp.shape and lp.dtype == torch.float32 and tok.dtype == torch.int64, \
        f"lp float32 / tok int64, one shape: got {lp.dtype} {tuple(lp.shape)}, {tok.dtype} {tuple(tok.shape)}"
    assert lp.stride(2) == 1 and tok.stride(2) == 1, "lp, tok: the rank dim must be contiguous"
    assert roots.shape == (bsz,) and roots.dtype == torch.int64, f"roots: int64 [{bsz}], got {tuple(roots.shape)}"
    N, dev = B + 1, lp.device
    tokens, parents, depths, bits = torch.empty(4, bsz, N, dtype=torch.long, device=dev)     # [b, N] each
    scores = torch.empty(bsz, N, dtype=torch.float32, device=dev)
    valid = torch.empty(bsz, N, dtype=torch.bool, device=dev)
    mask = torch.empty(bsz, N, N, dtype=torch.bool, device=dev)
    # one warp: a pop is two reductions over <= 128 slots, shuffles only (2 or 4 warps were no faster at B <= 16 and
    # slower at B = 64 on an H200)
    _tree_kernel[(bsz,)](
        lp, tok, roots, tokens, parents, depths, scores, valid.view(torch.int8), bits, mask.view(torch.int8),
        lp.stride(0), lp.stride(1), tok.stride(0), tok.stride(1), L, K, B,
        NODES=triton.next_power_of_2(N), PARENTS=triton.next_power_of_2(B), SLOTS=triton.next_power_of_2(2 * B),
        num_warps=1)
    return tokens, parents, depths, scores, valid, mask, (bits if N <= MASK_WORD_BITS else None)


@triton.jit
def _tree_accept_kernel(tok_ptr, par_ptr, dep_ptr, valid_ptr, bits_ptr, target_ptr, accepted_ptr, len_ptr, bonus_ptr,
                        N, BLOCK: tl.constexpr):
    # program b: one tree of N <= 64 nodes. Node i matches when its token is the target's token at its parent; i is on
    # the accepted path when every node of its root-to-i path below the root matches: its mask word (its ancestors
    # and itself) has no bit outside the matching nodes, bit 0 (the root, always committed) aside.
    row = tl.program_id(0).to(tl.int64) * N
    i = tl.arange(0, BLOCK)
    m = i < N
    tok = tl.load(tok_ptr + row + i, mask=m, other=0)
    parent = tl.maximum(tl.load(par_ptr + row + i, mask=m, other=0), 0)
    match = (tok == tl.load(target_ptr + row + parent, mask=m, other=0)) & (tl.load(valid_ptr + row + i, mask=m,
                                                                                      other=0) != 0) & m
    # the matching nodes as one word (disjoint bits: the sum is their OR, node 63 wraps into the sign bit)
    match_bits = tl.sum(tl.where(match, tl.full([BLOCK], 1, tl.int64) << i.to(tl.int64), 0), 0) | 1
    ok = ((tl.load(bits_ptr + row + i, mask=m, other=0) & (match_bits ^ -1)) == 0) & m
    depth = tl.load(dep_ptr + row + i, mask=m, other=0)
    accept_len = tl.sum(ok.to(tl.int64), 0)
    deepest = tl.argmax(tl.where(ok, depth, -1), 0)     # the ok nodes form one chain: their depths are distinct
    # accepted[d] = the path's node at depth d, for d < accept_len; the deepest node after that
    on_d = ok[None, :] & (depth[None, :] == i[:, None])                                         # [depth d, node j]
    node = tl.sum(tl.where(on_d, i[None, :], 0), 1)
    tl.store(accepted_ptr + row + i, tl.where(i < accept_len, node, deepest).to(tl.int64), mask=m)
    tl.store(len_ptr + tl.program_id(0), accept_len)
    tl.store(bonus_ptr + tl.program_id(0), tl.load(target_ptr + row + deepest))


def tree_accept(tokens, parents, depths, valid, mask_bits, target_tokens) -> tuple:
    """verify.accept_ref in one launch, for trees with packed mask rows (ddtree_search's, N <= 64): the tree's
    tokens / parents / depths [B, N] int64, valid [B, N] bool, mask_bits [B, N] int64, the target's token after
    each node target_tokens [B, N] int64 -> (accepted [B, N], accept_len [B], bonus [B]), the same values."""
    assert HAS_TRITON, "triton is not installed; call verify.accept_ref"
    B, N = tokens.shape
    assert N <= MASK_WORD_BITS, f"one mask word per node: N={N} > {MASK_WORD_BITS}"
    for name, t in dict(tokens=tokens, parents=parents, depths=depths, mask_bits=mask_bits,
                        target_tokens=target_tokens).items():
        assert t.shape == (B, N) and t.dtype == torch.int64 and t.is_contiguous(), f"{name}: contiguous int64 [{B}, {N}]"
    assert valid.shape == (B, N) and valid.dtype == torch.bool and valid.is_contiguous(), f"valid: bool [{B}, {N}]"
    accepted = torch.empty(B, N, dtype=torch.long, device=tokens.device)
    accept_len, bonus = torch.empty(2, B, dtype=torch.long, device=tokens.device)
    _tree_accept_kernel[(B,)](tokens, parents, depths, valid.view(torch.int8), mask_bits, target_tokens, accepted,
                              accept_len, bonus, N, BLOCK=max(16, triton.next_power_of_2(N)), num_warps=2)
    return accepted, accept_len, bonus


@triton.jit
def _commit_kv_kernel(cache_ptr, start_ptr, accepted_ptr, len_ptr, N, C, stride_l, stride_b, stride_s,
                      BLOCK_C: tl.constexpr):
    # program (layer, b): the path's rows to slots start + j, j ascending. Safe in place: the row read for slot j is
    # slot start + accepted[j] >= start + j (a node's index is at least its depth), so a slot is read (by some j' <= j)
    # before it is overwritten. Slots where accepted[j] == j stay: a contiguous path moves nothing.
    layer = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    base = cache_ptr + layer * stride_l + b * stride_b + tl.load(start_ptr + b) * stride_s
    n = tl.load(len_ptr + b)
    for j in range(1, N):                    # node 0 (the root) is already at slot start
        src = tl.load(accepted_ptr + b * N + j)
        if (j < n) & (src != j):
            for c0 in range(0, C, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C)
                row = tl.load(base + src * stride_s + c, mask=c < C)
                tl.store(base + j * stride_s + c, row, mask=c < C)


def commit_kv(kv_cache: torch.Tensor, start: torch.Tensor, accepted: torch.Tensor, accept_len: torch.Tensor) -> None:
    """verify.commit_kv_ref in one launch: every layer's accepted-path rows kv_cache[layer, b, start[b] + accepted[b, j]]
    -> slot start[b] + j for j < accept_len[b]. kv_cache [n_layers, Bmax, S, C] (contiguous rows), start [B] int64,
    accepted [B, N] int64, accept_len [B] int64. Reads and writes only the rows that move."""
    assert HAS_TRITON, "triton is not installed; call verify.commit_kv_ref"
    B, N = accepted.shape
    L_, Bmax, S, C = kv_cache.shape
    assert Bmax >= B and kv_cache.stride(-1) == 1, f"kv_cache {tuple(kv_cache.shape)}: [n_layers, >= {B}, S, C], rows contiguous"
    for name, t, shape in (("start", start, (B,)), ("accepted", accepted, (B, N)), ("accept_len", accept_len, (B,))):
        assert t.shape == shape and t.dtype == torch.int64 and t.is_contiguous(), f"{name}: contiguous int64 {list(shape)}"
    _commit_kv_kernel[(L_, B)](kv_cache, start, accepted, accept_len, N, C, *kv_cache.stride()[:3],
                               BLOCK_C=min(1024, triton.next_power_of_2(C)), num_warps=4)


# ----------------------------------------------------------------------------------------------------------
# Ranking the drafter's tokens for the tree search: per depth row, the top K of (logp desc, token id asc) over the
# vocabulary. A stable sort of the whole vocabulary did it in ~66 us at V = 4352 and 166-249 us at V = 163840 on an
# H200, most of a step's tree stage. Here every token gets a unique int64 key that orders like that pair (the
# float's bits made order-preserving by _sortable in the high word, V-1-token in the low one; rank_topk_ref builds
# the same key),
# and the top K keys are found in two launches: each program takes the K largest keys of a CHUNK of one row by
# K rounds of max-and-remove; a second program per row does the same over the chunks' winners. lp is read back
# from logp at the chosen tokens, so both outputs equal the twin's bit for bit.

RANK_MAX_K = 64          # rounds per program; above it, rank_topk_ref
_KEY_NONE = -2**63       # below every real key: masked vocabulary tail, chunks with fewer than K tokens
_KEY_NONE = tl.constexpr(_KEY_NONE) if HAS_TRITON else _KEY_NONE   # a jit global must be constexpr


@triton.jit
def _token_keys(logp_row, v, V):
    # int64 keys of tokens v (masked: _KEY_NONE); + 0.0 turns -0.0 into 0.0, which must tie with it
    x = tl.load(logp_row + v, mask=v < V, other=0.0) + 0.0
    key = (_sortable(x).to(tl.int64) << 32) | (V - 1 - v).to(tl.int64)
    return tl.where(v < V, key, _KEY_NONE)


@triton.jit
def _store_ranked(key, logp_row, V, lp_out, tok_out):
    # a winning key -> its token (from the low word) and that token's logp, read back from logp
    tok = V - 1 - (key & 0xFFFFFFFF)
    tl.store(tok_out, tok)
    tl.store(lp_out, tl.load(logp_row + tok))


@triton.jit
def _rank_chunk_kernel(logp_ptr, keys_ptr, lp_ptr, tok_ptr, V, N_CHUNKS, K: tl.constexpr, CHUNK: tl.constexpr,
                       FINAL: tl.constexpr):
    # program (row, chunk): the chunk's K largest keys in descending order -> keys[row, chunk, :]; FINAL (one
    # chunk per row): straight to lp / tok
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
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


def rank_topk(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logp [..., V] float32 (log_softmax of the draft logits) -> (lp [..., k] float32, tok [..., k] int64): the k
    best tokens of each row by (logp desc, token id asc) and their logp. Two launches (one when V <= CHUNK)."""
    assert HAS_TRITON, "triton is not installed; call rank_topk_ref"
    V = logp.shape[-1]
    assert logp.dtype == torch.float32 and logp.is_contiguous(), f"logp: contiguous float32, got {logp.dtype}"
    assert 1 <= k <= min(V, RANK_MAX_K), f"rank_topk: k={k} must be in [1, min(V={V}, {RANK_MAX_K})]"
    assert V < 2**31, f"V={V}: token ids live in the key's low 32 bits"
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


def rank_topk_ref(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # the same keys, then torch.topk: unique keys leave no tie for topk to order arbitrarily. On 2 CPU cores 0.10 ms
    # instead of a stable sort's 1.8 ms for [7, 4352].
    V = logp.shape[-1]
    bits = (logp + 0.0).view(torch.int32).long()
    keys = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) << 32) | (V - 1 - torch.arange(V, device=logp.device))
    tok = keys.topk(k, dim=-1).indices                                   # [..., k]
    return logp.gather(-1, tok), tok


# ----------------------------------------------------------------------------------------------------------
# GPU self-test: bf16 at K2.6 shapes, kernel vs ref, eager and CUDA-graph timings (median).

def _rand_experts(E, D, I, group_size, dtype, device):
    # random INT4 words straight away (every nibble 0..15 equally likely), small positive scales
    w13_packed = torch.randint(-2**31, 2**31, (E, 2 * I, D // 8), dtype=torch.int32, device=device)
    w2_packed = torch.randint(-2**31, 2**31, (E, D, I // 8), dtype=torch.int32, device=device)
    w13_scale = (torch.rand(E, 2 * I, D // group_size, device=device) * 0.5 + 0.5).mul(1 / (7 * D**0.5)).to(dtype)
    w2_scale = (torch.rand(E, D, I // group_size, device=device) * 0.5 + 0.5).mul(1 / (7 * I**0.5)).to(dtype)
    return w13_packed, w13_scale, w2_packed, w2_scale


def _compare(a, b):
    a, b = a.float(), b.float()
    err = (a - b).abs().max().item()
    return err, err / max(b.abs().max().item(), 1e-30)


def _time(fn):
    eager = triton.testing.do_bench(fn, return_mode="median") * 1e3
    try:
        graph = triton.testing.do_bench_cudagraph(fn, return_mode="median") * 1e3
    except Exception as exc:  # a host sync inside fn makes capture fail: report it, don't stop
        print(f"    cuda graph capture failed: {type(exc).__name__}: {str(exc)[:120]}")
        graph = float("nan")
    return eager, graph


def event_median_us(fn, n: int = 25, before=lambda: None) -> float:
    """Median us of fn() between two CUDA events, over n runs; before() runs untimed ahead of each (bench.py uses
    it to restore a step's state)."""
    times = []
    for _ in range(n):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def capture_graph(fn, warmup: int = 1, reset=None) -> "torch.cuda.CUDAGraph":
    """fn captured in a CUDA graph, after `warmup` calls on a side stream (kernels compiled and the allocator
    settled off the capture stream, as torch's CUDA-graph notes ask); reset() runs between the two (StaticStep
    restores the step's inputs the warm-up advanced)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    if reset is not None:
        reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _graph_replay_us(fn, n: int = 25) -> float:
    """Median us of replaying fn captured in a CUDA graph, one replay at a time between CUDA events."""
    return event_median_us(capture_graph(fn).replay, n)


def _time_cold(fn) -> float:
    """us of fn with a cold L2, as in a model step (each layer's cache and experts come from HBM once): a graph of
    [write a buffer twice the L2's size, fn] minus a graph of the write alone. do_bench_cudagraph replays fn back
    to back, so inputs smaller than the L2 (a 32k-slot cache is 37.7 MB; the H200's L2 is 60 MiB) stay in it."""
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    flush = torch.empty(2 * l2_bytes // 4, dtype=torch.int32, device="cuda")                  # twice the L2
    return _graph_replay_us(lambda: (flush.fill_(1), fn())) - _graph_replay_us(lambda: flush.fill_(1))


def _copy_bandwidth(nbytes: int = 2**30) -> float:
    """GB/s of a device-to-device copy (bytes read + written), the yardstick of the bandwidth columns."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e9


def mla_attention_work(T: int, H: int, keys: int, R: int, P: int, block_rows: int = 64) -> dict:
    """What one mla_tree_attention call over `keys` cache slots must read and multiply: the cache bytes (bf16),
    the MMA flops of the scores (R + P per key) and of P @ V (R per key) for the T*H query rows, and the same
    flops for the rows as the Hopper kernel runs them (whole `block_rows` wgmma blocks: 72 rows cost 128)."""
    rows, per_row = T * H, 2 * keys * (2 * R + P)
    padded = -(-rows // block_rows) * block_rows
    return dict(bytes=keys * (R + P) * 2, flops=rows * per_row, flops_executed=padded * per_row)


def _mma_peak(n: int = 8192) -> float:
    """TFLOP/s of a large bf16 matmul (cuBLAS): the tensor-core yardstick of the attention's compute floor."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / (triton.testing.do_bench(lambda: a @ b, return_mode="median") * 1e-3) / 1e12


@triton.jit
def _read_sum_kernel(x_ptr, out_ptr, N, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # the self-test's read yardstick: each program sums one contiguous chunk of x, so every byte is read once
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, CHUNK, BLOCK):
        offs = pid * CHUNK + i + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def _plain_read_us(x: torch.Tensor) -> float:
    """Cold-L2 us of the fastest plain read of x found over a few grids (4-16 programs an SM, 4096-8192 elements a
    step; 2026-11-30 sweep: fewer programs were slower): the pace a memory-bound kernel reading x could at best keep."""
    n, best, total = x.numel(), float("inf"), x.float().sum()
    for per_sm, BLOCK in itertools.product((4, 8, 16), (4096, 8192)):
        chunk = triton.cdiv(triton.cdiv(n, per_sm * _sm_count(x.device)), BLOCK) * BLOCK
        out = torch.empty(triton.cdiv(n, chunk), device=x.device, dtype=torch.float32)
        fn = lambda: _read_sum_kernel[(out.numel(),)](x, out, n, CHUNK=chunk, BLOCK=BLOCK, num_warps=8)
        fn()
        torch.testing.assert_close(out.sum(), total, rtol=1e-3, atol=1.0)   # it did read all of x
        best = min(best, _time_cold(fn))
    return best


def _selftest_row(label: str, case, kernel, ref, tol: float, bw: float) -> bool:
    """One self-test row: case() -> (args, bytes read, extra columns: a string, or a function of the time);
    kernel vs ref error, eager, graph (L2 warm) and cold-L2 graph times, GB/s (of the cold time) and its fraction
    of the copy bandwidth bw. An exception is reported on the row (and fails the test) instead of stopping the
    table."""
    try:
        args, nbytes, extra = case()
        _, rel = _compare(kernel(*args), ref(*args))
        eager, graph = _time(lambda: kernel(*args))
        cold = _time_cold(lambda: kernel(*args)) if graph == graph else eager
        gbps = nbytes / cold / 1e3
        flag = "" if rel < tol else "  FAIL"
        head, tail = ("", extra(cold)) if callable(extra) else (extra, "")  # a callable: columns of the time
        print(f"{label}{head} {rel:>9.2e} {eager:>9.1f} {graph:>9.1f} {cold:>8.1f} {gbps:>7.0f} "
              f"{100 * gbps / bw:>5.1f}%{tail}{flag}")
        return rel < tol
    except Exception as exc:
        print(f"{label}  ERROR {type(exc).__name__}: {str(exc)[:200]}")
        return False


def gpu_selftest(tol=2e-2) -> bool:
    from tree import ancestor_mask     # the verify mask, built as tree.py builds it
    assert torch.cuda.is_available() and HAS_TRITON, "the GPU self-test needs CUDA and triton"
    dev, dtype, ok = torch.device("cuda"), torch.bfloat16, True
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | bf16, tol {tol}")
    bw = _copy_bandwidth()
    print(f"copy bandwidth (1 GiB device-to-device, read + written): {bw:.0f} GB/s; '% bw' = GB/s / that")
    print("graph us: CUDA graph replayed back to back (inputs that fit stay in L2); cold us: after writing twice the "
          "L2, as in a model step; GB/s, % bw and TF/s from the cold time")

    print("\nfused_moe_w4a16: E=384, D=7168, top-8, group 32; GB/s = INT4 weights + scales of the used experts / time;"
          f" T <= {MOE_GEMV_MAX_T}: GEMV path, above: tl.dot path")
    print(f"{'I':>5} {'T':>3} {'experts':>7} {'rel err':>9} {'eager us':>9} {'graph us':>9} {'cold us':>8} "
          f"{'GB/s':>7} {'% bw':>6}")
    E, D, K, G = 384, 7168, 8, 32
    for I in (256, 2048):  # TP8 slice, whole expert
        weights = _rand_experts(E, D, I, G, dtype, dev)
        expert_bytes = sum(w[0].numel() * w.element_size() for w in weights)
        for T in (1, 9, 17, 33, 64, 128):
            def case():
                x = torch.randn(T, D, device=dev, dtype=dtype)
                x[0, 5] = 1e4 if T == 1 else x[0, 5]     # an outlier: fp16 activations must be scaled, not overflow
                topk_weights, topk_ids = torch.rand(T, E, device=dev).topk(K, dim=-1)
                topk_weights = (topk_weights / topk_weights.sum(-1, keepdim=True)).float()
                n_exp = topk_ids.unique().numel()
                return (x, topk_ids, topk_weights, *weights), n_exp * expert_bytes, f" {n_exp:>7}"
            ok &= _selftest_row(f"{I:>5} {T:>3}", case, fused_moe_w4a16, fused_moe_w4a16_ref, tol, bw)
        del weights
        torch.cuda.empty_cache()

    peak = _mma_peak()
    print("\nmla_tree_attention: R=512, P=64, B=1, random tree (packed mask rows, as the model passes them); GB/s = cache bytes read (prefix+T) * 576 * 2 / time")
    print(f"MMA TF/s = flops as run (T*H rows in whole query blocks, as the call runs them: 64 or 16) / time; floor = "
          f"max(bytes / copy bandwidth, flops of the T*H rows / {peak:.0f} TF/s, a bf16 8192^3 matmul in this run)")
    print(f"{'H':>3} {'T':>3} {'prefix':>7} {'rel err':>9} {'eager us':>9} {'graph us':>9} {'cold us':>8} "
          f"{'GB/s':>7} {'% bw':>6} {'MMA TF/s':>8} {'floor us':>8} {'% floor':>7}")
    R, P, scale = 512, 64, 0.14468
    for H in (8, 64):  # TP8 heads per rank, all heads
        for T in (1, 9, 17, 33, 64):
            for prefix in (0, 1, 1000, 32768):
                def case():
                    q_lat = torch.randn(1, T, H, R, device=dev, dtype=dtype)
                    q_pe = torch.randn(1, T, H, P, device=dev, dtype=dtype)
                    cache = torch.randn(1, prefix + T + 5, R + P, device=dev, dtype=dtype)
                    prefix_len = torch.tensor([prefix], device=dev)
                    parents = torch.tensor([-1] + [int(torch.randint(0, t, ())) for t in range(1, T)])
                    tree_mask = tree_mask_bits(ancestor_mask(parents)[None].to(dev))   # packed, as the model
                    block = _attention_path(q_lat, cache, T * H)[2]["BLOCK_Q"]          # as the call runs it
                    work = mla_attention_work(T, H, prefix + T, R, P, block)
                    floor = max(work["bytes"] / bw / 1e3, work["flops"] / peak / 1e6)                  # us

                    def columns(us):
                        return f" {work['flops_executed'] / us / 1e6:>8.0f} {floor:>8.1f} {100 * floor / us:>6.1f}%"
                    return (q_lat, q_pe, cache, prefix_len, tree_mask, scale), work["bytes"], columns
                ok &= _selftest_row(f"{H:>3} {T:>3} {prefix:>7}", case, mla_tree_attention, mla_tree_attention_ref,
                                    tol, bw)
    cache = torch.randn(1, 32768 + 17, R + P, device=dev, dtype=dtype)
    us = _plain_read_us(cache)
    print(f"a plain read of a 32k-slot cache ({cache.numel() * 2 / 1e6:.1f} MB; the fastest grid of _plain_read_us): "
          f"{us:.1f} us cold, {100 * cache.numel() * 2 / us / 1e3 / bw:.1f}% of the copy bandwidth")
    print("\nself-test", "PASSED" if ok else "FAILED")
    return ok


def sweep():
    # Launch-config sweep at K2.6 TP8 shapes (CUDA-graph median, us): change one config at a time from the defaults.
    dev, dtype = torch.device("cuda"), torch.bfloat16
    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3

    def run(table, key, options, cases):
        default = dict(table[key])
        for opt in options:
            table[key] = dict(default, **opt)
            try:
                times = [f"{bench(fn):8.1f}" for fn in cases.values()]
            except Exception as exc:
                times = [f"ERROR {type(exc).__name__}: {str(exc)[:80]}"]
            print(f"  {key:11} {str(opt):64} " + " ".join(times))
        table[key] = default

    E, D, K = 384, 7168, 8
    moe = {}
    for I, Ts in ((256, (1, 9)), (2048, (9, 17))):     # TP8 slice (latency regime), whole experts on one GPU
        weights = _rand_experts(E, D, I, 32, dtype, dev)
        for T in Ts:
            x = torch.randn(T, D, device=dev, dtype=dtype)
            w, ids = torch.rand(T, E, device=dev).topk(K, dim=-1)
            moe[(I, T)] = (lambda a: lambda: fused_moe_w4a16(*a))((x, ids, w.float().contiguous(), *weights))
    print(f"fused_moe_w4a16 (GEMV path), us at (I, T) = {list(moe)}; defaults {MOE_GEMV_BLOCKS}")
    grid = [dict(BLOCK_N=n, BLOCK_W=w, num_warps=nw, num_stages=st)
            for n, w, nw, st in itertools.product((8, 16, 32, 64), (32, 64, 128), (4, 8), (2, 3))]
    run(MOE_GEMV_BLOCKS, "gate_up", grid, moe)
    run(MOE_GEMV_BLOCKS, "down", grid, moe)
    del weights, moe
    torch.cuda.empty_cache()

    R, P = 512, 64
    attn = {}
    for H, T, prefix in ((8, 1, 32768), (8, 9, 32768), (8, 17, 32768), (8, 33, 32768), (64, 9, 4096)):
        cache = torch.randn(1, prefix + T, R + P, device=dev, dtype=dtype)
        a = (torch.randn(1, T, H, R, device=dev, dtype=dtype), torch.randn(1, T, H, P, device=dev, dtype=dtype), cache,
             torch.tensor([prefix], device=dev),
             tree_mask_bits(torch.ones(1, T, T, dtype=torch.bool, device=dev).tril()), 0.14468)
        attn[(H, T, prefix)] = (lambda a: lambda: mla_tree_attention(*a))(a)
    print(f"mla_tree_attention, us at (H, T, prefix) = {list(attn)}; defaults {ATTN_BLOCKS} {ATTN_SPLITS} "
          f"{ATTN_WGMMA} {ATTN_SEESAW}")
    g = globals()                               # the wrappers read these module globals at call time
    hopper = {name: g[name] for name in ("ATTN_WGMMA", "ATTN_SEESAW")}
    for name, c in hopper.items():              # the Triton kernel's tiles, at every shape
        g[name] = dict(c, min_rows=float("inf"))
    grid = [dict(BLOCK_Q=q, BLOCK_S=bs, num_warps=nw, num_stages=st)
            for q, bs, nw, st in itertools.product((16, 32), (16, 32, 64), (4, 8), (1, 2, 3))]
    run(g, "ATTN_BLOCKS", grid, attn)
    g.update(hopper)
    splits = [dict(max_splits=m, min_split_len=n, waves=w) for m in (64, 256) for n in (64, 128, 256) for w in (1, 2, 4)]
    run(g, "ATTN_SPLITS", splits, attn)
    if HAS_GLUON and torch.cuda.get_device_properties(dev).major == 9:
        # the Hopper kernels' rings (the configurations that fit 227 KB)
        ring = [dict(BLOCK_S=bs, STAGES=st, max_split_len=m) for bs, st in ((64, 2), (32, 3), (32, 4))
                for m in (512, 1024, 4096)]
        run(g, "ATTN_WGMMA", ring, attn)
        ring = [dict(STAGES=st, max_split_len=m, min_work=w) for st in (3, 4) for m in (512, 1024, 4096)
                for w in (2**19, 2**21)]
        run(g, "ATTN_SEESAW", ring, attn)


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        sweep()
    else:
        sys.exit(0 if gpu_selftest() else 1)
