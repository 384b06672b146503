"""
Triton kernels for the two hot spots of a Kimi K2.6 decode / tree-verify step, plus the INT4 format helpers.

    fused_moe_w4a16     routed experts straight from the INT4 pack-quantized checkpoint layout
    mla_tree_attention  absorbed-MLA attention over the compressed cache, with a tree mask for the new tokens
    pack_int4 / unpack_int4 / dequant_int4_ref   the single source of truth for the INT4 bit order

Invariant: every kernel == its *_ref twin. The twin has the same signature, is plain PyTorch, runs anywhere
(it is the CPU path and the test oracle), and the kernel must match it to rounding. model.py asks
use_triton(device) which one to call; `--no-triton` sets FORCE_REF and forces the twins everywhere.

Tests (CPU, kernels run under TRITON_INTERPRET=1 in a subprocess):  python -m pytest -q tests/test_kernels.py
GPU self-test (bf16 at K2.6 shapes, vs the refs, timings):          python kernels.py
"""
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

FORCE_REF = False      # generate.py --no-triton sets this: use the *_ref twins even on CUDA
POISON_BUFFERS = False  # tests set this: scratch buffers start as NaN, so an unwritten element shows up


def use_triton(device) -> bool:
    return HAS_TRITON and not FORCE_REF and torch.device(device).type == "cuda" and torch.cuda.is_available()


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
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    u = (packed.unsqueeze(-1) >> shifts) & 0xF                       # [..., I/8, 8]; & 0xF makes the sign irrelevant
    return (u - 8).to(torch.int8).flatten(-2)                        # [..., I]


def dequant_int4_ref(packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    q = unpack_int4(packed)                                          # [..., O, I]
    assert q.shape[-1] == scale.shape[-1] * group_size, f"{tuple(q.shape)}, scale {tuple(scale.shape)}, group {group_size}"
    w = q.view(*q.shape[:-1], -1, group_size).to(scale.dtype) * scale.unsqueeze(-1)
    return w.flatten(-2)                                             # [..., O, I] in scale's dtype (bf16 in the model)


# ----------------------------------------------------------------------------------------------------------
# Fused MoE, INT4 weights x 16-bit activations (W4A16).
# Idea: vLLM's fused_moe_kernel_gptq_awq (dequantize INT4 tiles in registers, feed tl.dot), grouped by expert like
# DeepSeek's MoE loop, but with fixed shapes: (token, k) pairs are sorted by expert on the GPU, program `slot` of
# the grid serves the slot-th *used* expert and streams that expert's weights once for all its tokens.
# Two Triton launches (plus a few small torch ops around them):
#   1. gate/up: partial sums over SPLIT_K slices of D -> gu [SPLIT_K, T*K, 2I] fp32. At decode only 8 experts are
#      live, and splitting D is what gives the GPU enough programs to pull the weights at full bandwidth.
#      Then h = silu(sum gate) * (sum up) [T*K, I] fp32 in torch (SwiGLU needs the complete sums).
#   2. down: down proj * routing weight -> y [T*K, D] fp32, then summed over k in torch.
# Per-pair and per-split buffers instead of fp32 atomics: the result is deterministic (same bits every run, which
# greedy-spec == greedy-AR tests rely on), and the extra traffic (y: T*K*D*4 B, 230 KB at T=1) is small next to
# the expert weights (~3 MB per expert at TP8).

# Launch configs (BLOCK_N output rows, BLOCK_K input columns, a multiple of the group): the best of
# `python kernels.py --sweep` on an H200 at K2.6 TP8 shapes (I=256), T = 1, 8, 16 (before split-K was added).
MOE_BLOCKS = dict(gate_up=dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3),
                  down=dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2))
MOE_MAX_SPLIT_K = 8
# Token rows per tile: the smallest tl.dot tile. Tree verify spreads T*K pairs over many experts (~1-3 per expert);
# on the H200, 16 beat 32/64 at T = 32, 64 even with half the tokens repeating the others' experts (1.5x faster).
# An expert with more pairs loops over them, re-reading its weights (mostly from L2).
MOE_BLOCK_M = 16


@triton.jit
def _expert_of_slot(bounds_ptr, slot, E, E_POW2: tl.constexpr):
    # Expert e owns sorted pairs bounds[e] .. bounds[e+1]. Returns the slot-th used expert (in id order), its first
    # sorted pair and its pair count; count is 0 when fewer than slot+1 experts are used (the program then exits).
    # A scan over all E experts: stage 1 does it and leaves the answer in `slots` for stage 2, which has far more
    # programs per expert (D / BLOCK_N = 112) and would pay for it on each.
    offs = tl.arange(0, E_POW2)
    lo = tl.load(bounds_ptr + offs, mask=offs < E, other=0)
    hi = tl.load(bounds_ptr + offs + 1, mask=offs < E, other=0)
    used = hi > lo
    mine = used & (tl.cumsum(used.to(tl.int32), 0) == slot + 1)
    return tl.sum(tl.where(mine, offs, 0), 0), tl.sum(tl.where(mine, lo, 0), 0), tl.sum(tl.where(mine, hi - lo, 0), 0)


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
def _moe_gate_up_kernel(x_ptr, w_ptr, s_ptr, gu_ptr, pair_ptr, bounds_ptr, slots_ptr, E, D, I, K, P,
                        GROUP: tl.constexpr, E_POW2: tl.constexpr, SPLIT_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (slot, pid_n, split): rows pid_n*BLOCK_N.. of gate and of up for the slot-th used expert, summed over
    # the split-th slice of D, stored to gu[split, pair] (gate in columns 0..I-1, up in I..2I-1).
    e, start, count = _expert_of_slot(bounds_ptr, tl.program_id(0), E, E_POW2)
    split = tl.program_id(2)
    if (tl.program_id(1) == 0) & (split == 0):  # hand (e, start, count) of this slot to stage 2
        tl.store(slots_ptr + tl.program_id(0) * 3, e)
        tl.store(slots_ptr + tl.program_id(0) * 3 + 1, start)
        tl.store(slots_ptr + tl.program_id(0) * 3 + 2, count)
    if count == 0:
        return
    k_len = tl.cdiv(tl.cdiv(D, BLOCK_K), SPLIT_K) * BLOCK_K                  # a whole number of tiles per split
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    e = e.to(tl.int64)
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
    e = tl.load(slots_ptr + tl.program_id(0) * 3)
    start = tl.load(slots_ptr + tl.program_id(0) * 3 + 1)
    count = tl.load(slots_ptr + tl.program_id(0) * 3 + 2)
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


def fused_moe_w4a16(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32, out=None):
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

    # Group the T*K (token, k) pairs by expert with fixed-shape ops only (no host sync, CUDA-graph capturable):
    # expert e owns pair_ids[bounds[e]:bounds[e+1]]. The grid has one slot per possible used expert, min(E, T*K).
    P = T * K
    sorted_ids, pair_ids = torch.sort(topk_ids.view(-1).to(torch.int32))                        # [P], [P]
    bounds = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=x.device, dtype=torch.int32))  # [E+1]
    n_slots = min(E, P)

    cfg = MOE_BLOCKS["gate_up"]
    n_blocks = triton.cdiv(I, cfg["BLOCK_N"])
    # split D when there are too few programs for ~2 waves (on CPU: the interpreter, i.e. tests; exercise splits)
    n_sm = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 16
    split_k = max(1, min(MOE_MAX_SPLIT_K, triton.cdiv(D, cfg["BLOCK_K"]), triton.cdiv(2 * n_sm, n_slots * n_blocks)))
    gu = _empty((split_k, P, 2 * I), torch.float32, x.device)
    slots = _empty((n_slots, 3), torch.int64, x.device)                       # (expert, first sorted pair, count)
    _moe_gate_up_kernel[(n_slots, n_blocks, split_k)](
        x, w13_packed, w13_scale, gu, pair_ids, bounds, slots, E, D, I, K, P,
        GROUP=group_size, E_POW2=triton.next_power_of_2(E), SPLIT_K=split_k, BLOCK_M=MOE_BLOCK_M, **cfg)
    gate, up = gu.sum(0).chunk(2, dim=-1)
    h = F.silu(gate) * up                                                     # [P, I] fp32
    y = _empty((P, D), torch.float32, x.device)
    cfg = MOE_BLOCKS["down"]
    _moe_down_kernel[(n_slots, triton.cdiv(D, cfg["BLOCK_N"]))](
        h, w2_packed, w2_scale, topk_weights, y, pair_ids, slots, D, I, GROUP=group_size, BLOCK_M=MOE_BLOCK_M, **cfg)
    return torch.sum(y.view(T, K, D), dim=1, out=out)


def experts_ref(x, topk_ids, topk_weights, expert) -> torch.Tensor:
    """Σ_k topk_weights[t, k] * SwiGLU expert topk_ids[t, k] of x [T, D], one expert at a time over the tokens
    that chose it; expert(e) -> (w13 [2I, D] gate rows then up rows, w2 [D, I]), computed in w13's dtype and
    accumulated in fp32. The host sync (which experts are used) is fine for a reference, not for CUDA graphs."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)                    # [T, D]
    for e in topk_ids.unique().tolist():
        t, k = (topk_ids == e).nonzero(as_tuple=True)
        w13, w2 = expert(e)
        gate, up = F.linear(x[t].to(w13.dtype), w13).chunk(2, dim=-1)                 # [n, I] each
        y.index_add_(0, t, F.linear(F.silu(gate) * up, w2).float() * topk_weights[t, k, None])
    return y


def fused_moe_w4a16_ref(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32, out=None):
    deq = lambda p, s: dequant_int4_ref(p, s, group_size).float()
    y = experts_ref(x, topk_ids, topk_weights, lambda e: (deq(w13_packed[e], w13_scale[e]), deq(w2_packed[e], w2_scale[e])))
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

# BLOCK_Q query rows (t, h) x BLOCK_S keys per tile. Splits: enough for ~4 waves of programs, each at least
# MIN_SPLIT keys long so the fp32 partial outputs (T*H*R*4 B per split) stay small next to the keys they summarize.
ATTN_BLOCKS = dict(BLOCK_Q=16, BLOCK_S=64, num_warps=4, num_stages=2)
ATTN_SPLITS = dict(max_splits=256, min_split_len=128)


def tree_mask_bits(tree_mask: torch.Tensor) -> torch.Tensor:
    # [B, T, T] bool -> [B, T] int64 with bit j set iff tree_mask[b, t, j]. Disjoint bits, so sum == OR, and the
    # two's complement wrap puts j = 63 in the sign bit, which is what the kernel's shift-and-mask expects.
    T = tree_mask.shape[-1]
    assert T <= 64, f"one int64 word per row holds at most 64 tree slots, got T={T}"
    return (tree_mask.long() << torch.arange(T, device=tree_mask.device)).sum(-1)


@triton.jit
def _split_len(L, NUM_SPLITS, MIN_SPLIT: tl.constexpr, BLOCK_S: tl.constexpr):
    # keys per split for a row with L visible-or-not keys: even split, at least MIN_SPLIT, a whole number of tiles
    n = tl.maximum(tl.cdiv(L, NUM_SPLITS), MIN_SPLIT)
    return tl.cdiv(n, BLOCK_S) * BLOCK_S


@triton.jit
def _mla_split_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, prefix_ptr, bits_ptr, o_ptr, lse_ptr,
                      sm_scale, T, H, NUM_SPLITS, stride_cb, stride_cs,
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

    # query rows r = t*H + h of row b (q is [B, T, H, .] contiguous, so [B, T*H, .])
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_mask = rows < T * H
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, P)
    q_lat = tl.load(q_lat_ptr + (b * T * H + rows)[:, None] * R + offs_r[None, :], mask=row_mask[:, None], other=0.0)
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


def mla_tree_attention(q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale: float, out=None):
    B, T, H, R = q_lat.shape
    P = q_pe.shape[-1]
    assert HAS_TRITON, "triton is not installed; call mla_tree_attention_ref"
    assert q_pe.shape == (B, T, H, P), f"q_pe {tuple(q_pe.shape)} vs q_lat {tuple(q_lat.shape)}"
    assert cache.dim() == 3 and cache.shape[0] == B and cache.shape[2] == R + P, f"cache {tuple(cache.shape)}: [B, S, R+P]"
    assert prefix_len.shape == (B,) and prefix_len.dtype == torch.int64, "prefix_len: want int64 [B]"
    assert tree_mask.shape == (B, T, T) and tree_mask.dtype == torch.bool, "tree_mask: want bool [B, T, T]"
    assert T <= 64, f"tree part is a 64-bit mask per row: T={T} > 64"
    assert q_lat.dtype == q_pe.dtype == cache.dtype, f"dtypes differ: {q_lat.dtype}, {q_pe.dtype}, {cache.dtype}"
    for n in (R, P):
        assert n >= 16 and n & (n - 1) == 0, f"R={R} and P={P} must be powers of two >= 16 (tl.arange, tl.dot)"
    for name, t in dict(q_lat=q_lat, q_pe=q_pe, cache=cache, prefix_len=prefix_len).items():
        assert t.is_contiguous(), f"{name} must be contiguous"
    if out is None:
        out = torch.empty_like(q_lat)
    assert out.shape == q_lat.shape and out.dtype == q_lat.dtype and out.is_contiguous(), "out: like q_lat, contiguous"

    cfg = ATTN_BLOCKS
    BLOCK_Q, BLOCK_S, MIN_SPLIT = cfg["BLOCK_Q"], cfg["BLOCK_S"], ATTN_SPLITS["min_split_len"]
    assert MIN_SPLIT % BLOCK_S == 0, "min_split_len must be a multiple of BLOCK_S"
    n_qblocks = triton.cdiv(T * H, BLOCK_Q)
    # the grid depends on shapes only (no sync): splits for ~4 waves, at most one per MIN_SPLIT keys of the cache
    # (on CPU only the interpreter runs this: pretend to have SMs, so tests exercise several splits)
    n_sm = torch.cuda.get_device_properties(q_lat.device).multi_processor_count if q_lat.is_cuda else 16
    num_splits = max(1, min(ATTN_SPLITS["max_splits"], triton.cdiv(cache.shape[1], MIN_SPLIT),
                            triton.cdiv(4 * n_sm, B * n_qblocks)))

    bits = tree_mask_bits(tree_mask)                                            # [B, T] int64
    o_part = _empty((B, num_splits, T * H, R), torch.float32, q_lat.device)
    lse_part = _empty((B, num_splits, T * H), torch.float32, q_lat.device)
    _mla_split_kernel[(n_qblocks, num_splits, B)](
        q_lat, q_pe, cache, prefix_len, bits, o_part, lse_part,
        softmax_scale, T, H, num_splits, cache.stride(0), cache.stride(1), R=R, P=P, MIN_SPLIT=MIN_SPLIT, **cfg)
    BLOCK_R = min(R, 64)
    _mla_merge_kernel[(B, T * H, R // BLOCK_R)](
        o_part, lse_part, prefix_len, out, T, H, num_splits,
        R=R, MIN_SPLIT=MIN_SPLIT, BLOCK_S=BLOCK_S, SPLITS=triton.next_power_of_2(num_splits), BLOCK_R=BLOCK_R)
    return out


def mla_tree_attention_ref(q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale: float, out=None):
    B, T, H, R = q_lat.shape
    S = cache.shape[1]
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


def _selftest_row(label: str, case, kernel, ref, tol: float) -> bool:
    """One self-test row: case() -> (args, bytes read, extra column); kernel vs ref error, eager and graph
    times, GB/s. An exception is reported on the row (and fails the test) instead of stopping the table."""
    try:
        args, nbytes, extra = case()
        _, rel = _compare(kernel(*args), ref(*args))
        eager, graph = _time(lambda: kernel(*args))
        gbps = nbytes / (min(eager, graph) if graph == graph else eager) / 1e3
        flag = "" if rel < tol else "  FAIL"
        print(f"{label}{extra} {rel:>9.2e} {eager:>9.1f} {graph:>9.1f} {gbps:>7.0f}{flag}")
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

    print("\nfused_moe_w4a16: E=384, D=7168, top-8, group 32; GB/s = INT4 weights + scales of the used experts / time")
    print(f"{'I':>5} {'T':>3} {'experts':>7} {'rel err':>9} {'eager us':>9} {'graph us':>9} {'GB/s':>7}")
    E, D, K, G = 384, 7168, 8, 32
    for I in (256, 2048):  # TP8 slice, whole expert
        weights = _rand_experts(E, D, I, G, dtype, dev)
        expert_bytes = sum(w[0].numel() * w.element_size() for w in weights)
        for T in (1, 9, 17, 33, 64):
            def case():
                x = torch.randn(T, D, device=dev, dtype=dtype)
                topk_weights, topk_ids = torch.rand(T, E, device=dev).topk(K, dim=-1)
                topk_weights = (topk_weights / topk_weights.sum(-1, keepdim=True)).float()
                n_exp = topk_ids.unique().numel()
                return (x, topk_ids, topk_weights, *weights), n_exp * expert_bytes, f" {n_exp:>7}"
            ok &= _selftest_row(f"{I:>5} {T:>3}", case, fused_moe_w4a16, fused_moe_w4a16_ref, tol)
        del weights
        torch.cuda.empty_cache()

    print("\nmla_tree_attention: R=512, P=64, B=1, random tree; GB/s = cache bytes read (prefix+T) * 576 * 2 / time")
    print(f"{'H':>3} {'T':>3} {'prefix':>7} {'rel err':>9} {'eager us':>9} {'graph us':>9} {'GB/s':>7}")
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
                    tree_mask = ancestor_mask(parents)[None].to(dev)
                    return (q_lat, q_pe, cache, prefix_len, tree_mask, scale), (prefix + T) * (R + P) * 2, ""
                ok &= _selftest_row(f"{H:>3} {T:>3} {prefix:>7}", case, mla_tree_attention, mla_tree_attention_ref,
                                    tol)
    print("\nself-test", "PASSED" if ok else "FAILED")
    return ok


def sweep():
    # Launch-config sweep at K2.6 TP8 shapes (CUDA-graph median, us): change one config at a time from the defaults.
    import itertools
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
    print(f"fused_moe_w4a16, us at (I, T) = {list(moe)}; defaults {MOE_BLOCKS}")
    grid = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=nw, num_stages=st)
            for n, k, nw, st in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (2, 3, 4))]
    run(MOE_BLOCKS, "gate_up", [g for g in grid if g["BLOCK_N"] <= 32], moe)
    run(MOE_BLOCKS, "down", [g for g in grid if g["BLOCK_K"] <= 256], moe)
    del weights, moe
    torch.cuda.empty_cache()

    R, P = 512, 64
    attn = {}
    for H, T, prefix in ((8, 1, 32768), (8, 9, 32768), (8, 17, 32768), (64, 9, 4096)):
        cache = torch.randn(1, prefix + T, R + P, device=dev, dtype=dtype)
        a = (torch.randn(1, T, H, R, device=dev, dtype=dtype), torch.randn(1, T, H, P, device=dev, dtype=dtype), cache,
             torch.tensor([prefix], device=dev), torch.ones(1, T, T, dtype=torch.bool, device=dev).tril(), 0.14468)
        attn[(H, T, prefix)] = (lambda a: lambda: mla_tree_attention(*a))(a)
    print(f"mla_tree_attention, us at (H, T, prefix) = {list(attn)}; defaults {ATTN_BLOCKS} {ATTN_SPLITS}")
    grid = [dict(BLOCK_Q=q, BLOCK_S=bs, num_warps=nw, num_stages=st)
            for q, bs, nw, st in itertools.product((16, 32), (16, 32, 64), (4, 8), (1, 2, 3))]
    run(globals(), "ATTN_BLOCKS", grid, attn)   # the wrappers read these module globals at call time
    splits = [dict(max_splits=m, min_split_len=n) for m in (64, 128, 256) for n in (64, 128, 256)]
    run(globals(), "ATTN_SPLITS", splits, attn)


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        sweep()
    else:
        sys.exit(0 if gpu_selftest() else 1)
