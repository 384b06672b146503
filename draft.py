"""
draft.py: the DFlash block-diffusion drafter (z-lab, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv 2602.06036), loaded from the public checkpoints (z-lab/Kimi-K2.6-DFlash etc.).

    python -m pytest -q tests/test_draft.py   # drafter == plain equations; cached == plain forward

One forward drafts a whole block: the input is [last committed token, MASK x (block_size-1)]
embedded with the *target's* embedding; every drafter layer attends, non-causally, over K/V
projected from fused target hidden states ("context features": the outputs of the target layers in
target_layer_ids) plus the block's own K/V. The output goes through the *target's* lm_head. The
drafter has no embedding and no lm_head of its own. Positions: context row j sits at position j, the
block at ctx_len + n_new + i.

The plain forward (DFlashDrafter.plain_forward) says exactly that: each layer concatenates the
context's K/V and the block's and runs one masked attention. It is the reference; train.py trains
through it. The decode step runs the cached forward (DFlashDrafter.cached_forward), equal to it: the
per-layer context K/V cache filled incrementally (each round appends only the features of the tokens
committed last round, at slots ctx_len..) equals recomputing it from all context features at once.
The block's own K/V pass through the slots right after the context (one cache, one attention over
it, no concatenation) and are overwritten by the next round's context rows. The drafter never sees
rejected branches: the caller passes features of accepted tokens only, and a row's stale
slots >= ctx_len are overwritten before they become visible. The step's shapes are fixed (one CUDA
graph for every step): each row gets block_size context rows of which its first n_valid are real;
the padding rows are parked block_size slots past the block, where nothing reads them.

Tensor parallel (torchrun), like the target: each rank holds 1/world_size of the drafter's heads, of
its intermediate rows and of fc's input columns, and only its own kv heads in the context cache.
Replicating it would be simpler, but the Kimi drafter is ~3.5B params (6.5 GB bf16), which every
draft step would then read in full on every GPU; split 8 ways a rank reads ~0.8 GB and pays 2
all-reduces per layer + 1 (DFlashDrafter.cached_forward).

Reading order: DraftArgs; Attention, Layer (plain or cached); DFlashDrafter (plain_forward,
cached_forward, draft_logits); the cached forward's two ops with a fast path (qkv_norm_rope,
block_attention: plain PyTorch here, one Triton launch each on a GPU, kernels.py; Layer.forward is
a part with a launcher too: its middle add and norm in one launch); DFlash's
default taps. The rotary embedding is model.py's. The drafter's files (its config.json, the
loader, the writer) are checkpoint.py's: checkpoint.draft_args, load_drafter, write_drafter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import kernels
import model as M
from model import RMSNorm


# ----------------------------------------------------------------------------------------------
# Config: a Qwen3Config plus block_size, num_target_layers, dflash_config{mask_token_id,
# target_layer_ids} (parsed and checked by checkpoint.draft_args)


@dataclass
class DraftArgs:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int                     # Qwen3: independent of hidden_size / num_attention_heads
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int                   # tokens per drafted block, root included: drafts block_size-1
    num_target_layers: int            # depth of the target the drafter was trained against
    mask_token_id: int
    target_layer_ids: list[int]       # 0-indexed target layers whose OUTPUTS are concatenated
    vocab_size: int | None = None
    attention_bias: bool = False
    # rope
    rope_type: str = "default"        # "default" or "yarn"
    rope_factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_truncate: bool = True
    # explicit cos/sin amplitude; None: 1 + 0.1 ln(factor)
    rope_attention_factor: float | None = None
    # newer z-lab fields, absent from the Kimi files (then identity)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @property
    def fc_in(self) -> int:           # width of the concatenated context features
        return len(self.target_layer_ids) * self.hidden_size

    def tp_splits(self) -> list[tuple[str, int, int]]:
        """What tensor parallelism splits (model.check_tp_divisibility): whole q heads and whole kv
        heads per rank (a kv head is never replicated), whole intermediate rows, fc input columns."""
        return [("drafter num_attention_heads", self.num_attention_heads, 1),
                ("drafter num_key_value_heads", self.num_key_value_heads, 1),
                ("drafter intermediate_size", self.intermediate_size, 1),
                ("drafter fc input width len(target_layer_ids) x hidden_size", self.fc_in, 1)]


# ----------------------------------------------------------------------------------------------
# Layers, tensor-parallel like model.py: q/k/v_proj and gate/up_proj column-parallel (whole heads,
# slices of the intermediate rows), o_proj, down_proj and fc row-parallel, each followed by an
# all_reduce at its call site (only when world_size > 1). Norms and rope are replicated. The MLP is
# model.DenseMLP itself. fc's input, the target's residual stream, is on every rank: each multiplies
# its slice of the columns.


class Linear(M.Linear):
    """model.Linear (shard_dim 0: column-parallel, 1: row-parallel, None: replicated; out_features
    may stack several checkpoint tensors) plus Qwen3's optional bias, stacked like the weight. A
    column-parallel bias is split with the output rows. A row-parallel bias is replicated but only
    rank 0 adds it, so the caller's all-reduce counts it once."""

    def __init__(self, in_features: int, out_features: int | dict[str, int], bias: bool = False,
                 shard_dim: int | None = None):
        super().__init__(in_features, out_features, shard_dim)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.weight.shape[0]))
            self.bias.shard_dim = 0 if shard_dim == 0 else None
            self.bias.parts = self.weight.parts

    def forward(self, x: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """x W^T + b, or only the output rows `rows` (some of the tensors a stacked weight holds)"""
        if self.bias is None or (self.weight.shard_dim == 1 and M.rank != 0):  # rank 0 adds it
            return M.linear(x, self.weight[rows])
        return F.linear(x, self.weight[rows], self.bias[rows])


class Attention(nn.Module):
    """Column-parallel by heads: rank r holds q heads [r*H/ws, (r+1)*H/ws) and kv heads
    [r*KV/ws, ...), the kv heads those q heads share (GQA groups are contiguous), so attention needs
    no communication; o_proj is row-parallel and one all_reduce sums the heads' partial outputs."""

    def __init__(self, a: DraftArgs):
        super().__init__()
        H, KV, self.hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.n_heads, self.n_kv = H // M.world_size, KV // M.world_size          # local heads
        D, b = a.hidden_size, a.attention_bias
        # q, k and v of the context and block rows: the three weights stacked, one GEMM
        rows = {"q_proj": H * self.hd, "k_proj": KV * self.hd, "v_proj": KV * self.hd}
        self.qkv_proj = Linear(D, rows, b, shard_dim=0)
        self.o_proj = Linear(H * self.hd, D, b, shard_dim=1)
        self.q_norm = RMSNorm(self.hd, a.rms_norm_eps)     # per head, before rope (Qwen3)
        self.k_norm = RMSNorm(self.hd, a.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> roped K, V [B, T, n_kv, hd] of context rows alone (append_context)."""
        B, T, _ = x.shape
        kv = self.qkv_proj(x, rows=slice(self.n_heads * self.hd, None))   # [B, T, 2KV hd]
        k, v = kv.view(B, T, 2 * self.n_kv, self.hd).chunk(2, dim=2)     # [B, T, KV, hd] each
        return M.rope(self.k_norm(k), cos, sin, interleaved=False), v

    def forward(self, x, f, cos, sin, mask=None, cache: BlockCache | None = None) -> torch.Tensor:
        """x [B, N, D]: the block's rows (normed); f [B, n, D]: the context rows (fused features);
        cos / sin [B, n + N, hd]. One q/k/v projection serves both ("KV injection"); the block's
        queries attend over the K/V of [f | x] -> [B, N, D], through the cache or concatenated."""
        B, n = x.shape[0], f.shape[1]
        qkv = self.qkv_proj(torch.cat([f, x], 1))                            # [B, n+N, (H+2KV) hd]
        if cache is None:
            o = self._plain_attention(qkv, cos, sin, mask, n)                # [B, N, H, hd]
        else:
            k_cache, v_cache = cache.kv                                      # [Bmax, slots, KV, hd]
            q = qkv_norm_rope(qkv, self.n_heads, self.n_kv, self.q_norm.weight, self.k_norm.weight,
                              self.q_norm.eps, cos, sin, k_cache, v_cache, cache.slots,
                              q_start=n)                                     # [B, N, H, hd]
            k_cache, v_cache = k_cache[:B, :cache.S], v_cache[:B, :cache.S]  # the slots it reads
            o = block_attention(q, k_cache, v_cache, cache.prefix, self.hd ** -0.5)  # [B, N, H, hd]
        y = self.o_proj(o.flatten(2))                                        # [B, N, D]
        if M.world_size > 1:
            dist.all_reduce(y)      # o_proj is row-parallel: sum the heads' partial outputs
        return y

    def _plain_attention(self, qkv, cos, sin, mask, n: int) -> torch.Tensor:
        """The equations: per-head q_norm / k_norm, rope, GQA softmax attention of the block's
        queries (rows >= n) over every row's keys, block row i seeing the keys mask[b, i]
        ([B, N, n + N] bool; None: all of them) -> [B, N, H, hd]."""
        heads = (self.n_heads, self.n_kv, self.n_kv)
        q, k, v = qkv.unflatten(-1, (sum(heads), self.hd)).split(heads, 2)   # [B, n+N, heads, hd]
        q = self.q_norm(q[:, n:])                                     # [B, N, H, hd]: the block's
        q = M.rope(q, cos[:, n:], sin[:, n:], interleaved=False)
        k = M.rope(self.k_norm(k), cos, sin, interleaved=False)                 # [B, n+N, KV, hd]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=None if mask is None else mask[:, None],
                                           scale=self.hd ** -0.5, enable_gqa=True)
        return o.transpose(1, 2)


class BlockCache(NamedTuple):
    """What a cached forward's layer needs beyond its inputs (DFlashDrafter.cached_forward makes
    it)."""
    kv: torch.Tensor        # this layer's cache [2 (K, V), Bmax, slots, n_kv, hd]
    slots: torch.Tensor     # [B, n + N]: each row's cache slot (= its rope position)
    prefix: torch.Tensor    # [B]: the context rows the block sees, its own slots right after them
    S: int                  # cache slots the attention reads (the rest of each row stays unread)


class Layer(nn.Module):
    def __init__(self, a: DraftArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        # Qwen3's SwiGLU is the target's dense MLP
        self.mlp = M.DenseMLP(a.hidden_size, a.intermediate_size)

    @kernels.fast
    def forward(self, h, f, cos, sin, mask=None, cache: BlockCache | None = None) -> torch.Tensor:
        """h [B, N, D]: the block's residual stream; the rest as in Attention.forward"""
        h = h + self.self_attn(self.input_layernorm(h), f, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """Module names match the checkpoint tensors (fc, hidden_norm, layers.{i}...., norm)."""

    def __init__(self, args: DraftArgs):
        super().__init__()
        M.check_tp_divisibility(args, M.world_size)
        self.args = args
        self.fc = Linear(args.fc_in, args.hidden_size, shard_dim=1)   # row-parallel: see fuse()
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # [n_layers, 2 (K, V), Bmax, max_ctx + 2 bs, local n_kv, hd], allocated by setup_cache
        self.ctx_cache = None
        self.max_ctx_len = 0
        # [slots, hd] in the weights' dtype, set by setup_cache
        self.rope_cos = self.rope_sin = None
        # 0, 1, 2, ...: slices of it are the step's slot and row numbers (no arange kernels)
        self.ids = None

    block_size = property(lambda self: self.args.block_size)
    mask_token_id = property(lambda self: self.args.mask_token_id)
    target_layer_ids = property(lambda self: list(self.args.target_layer_ids))

    def plain_forward(self, block_embeds: torch.Tensor, ctx_feats: torch.Tensor,
                      positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The DFlash drafter as its equations, no cache. block_embeds [B, N, D] at rope positions
        positions [B, N]; ctx_feats [B, n, n_taps*D]: the context's features, at positions 0 .. n-1.
        Each layer projects K/V from the context rows and the block rows, concatenates them and runs
        one attention in which block row i sees the keys mask[b, i] ([B, N, n + N] bool; None: all
        of them, one block after the whole context) -> normalized hidden states [B, N, D].
        The reference: cached_forward (the step's) equals it; train.py trains through it (many
        blocks per sequence, each masked to its own)."""
        B, n = block_embeds.shape[0], ctx_feats.shape[1]
        dtype = self.fc.weight.dtype
        ctx_pos = torch.arange(n, device=positions.device).expand(B, n)                 # [B, n]
        cos, sin = self.rope_cos_sin(torch.cat([ctx_pos, positions], 1), dtype)      # [B, n+N, hd]
        f = self.fuse(ctx_feats)                                                         # [B, n, D]
        h = block_embeds.to(dtype)                                                       # [B, N, D]
        for layer in self.layers:
            h = layer(h, f, cos, sin, mask)
        return self.norm(h)

    def rope_cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, head_dim]: model.py's YaRN over the whole head, on
        Qwen3's halves. Amplitude: the Kimi DFlash checkpoints were trained with the legacy YaRN
        amplitude 1 + 0.1 ln(factor) (1.416 for factor 64). Newer transformers/vLLM derive
        mscale/mscale_all_dim = 1 from the same config and lose it, which lowers acceptance
        (vllm-ascend forces the legacy value). An explicit rope_scaling.attention_factor in the
        file still wins."""
        a = self.args
        inv_freq, amp = M.rope_inv_freq(a, a.head_dim, a.rope_truncate,
                                        legacy_amplitude=True)                       # [hd/2] fp32
        return M.rope_cos_sin(inv_freq, amp, positions, dtype, interleaved=False)

    @staticmethod
    def cache_shape(a: DraftArgs, max_batch_size: int, max_ctx_len: int,
                    n_kv: int) -> tuple[int, ...]:
        """[layers, K/V, batch, slots, n_kv (this rank's kv heads), head_dim]: the context's slots,
        then two blocks."""
        S = max_ctx_len + 2 * a.block_size
        return a.num_hidden_layers, 2, max_batch_size, S, n_kv, a.head_dim

    def setup_cache(self, max_batch_size: int, max_ctx_len: int) -> None:
        """Room for max_ctx_len context rows per sequence, plus 2 x block_size slots past them: the
        block's own K/V (written at the slots after the context, where the next call's context rows
        overwrite them) and the padding rows of a fixed-shape step (up to block_size of them, parked
        past the block so they never collide with it)."""
        a, w = self.args, self.fc.weight
        self.max_ctx_len = max_ctx_len
        shape = self.cache_shape(a, max_batch_size, max_ctx_len, self.layers[0].self_attn.n_kv)
        S = shape[3]
        # [layers, K/V, B, S, KV, hd]
        self.ctx_cache = torch.zeros(shape, dtype=w.dtype, device=w.device)
        self.ids = torch.arange(max(max_batch_size, S), device=w.device)
        # cos / sin of every slot's position (a row's slot is its position), computed once: a
        # forward gathers its rows' instead of recomputing them (the same elementwise ops, so the
        # same values; 2 launches, not ~11)
        cos, sin = self.rope_cos_sin(self.ids[None, :S], w.dtype)                    # [1, S, hd]
        self.rope_cos, self.rope_sin = cos[0], sin[0]                                # [S, hd] each

    def fuse(self, ctx_feats: torch.Tensor) -> torch.Tensor:
        """Context features [B, n, n_taps*D] -> hidden_norm(fc(.)) [B, n, D]"""
        w = self.fc.weight                                                     # [D, fc_in/ws]
        x = ctx_feats.narrow(-1, M.rank * w.shape[1], w.shape[1]).to(w.dtype)  # ws 1: all columns
        f = self.fc(x)                                                         # [B, n, D]
        if M.world_size > 1:
            dist.all_reduce(f)      # fc is row-parallel: sum the ranks' partial products
        return self.hidden_norm(f)

    @torch.no_grad()
    def cached_forward(self, block_embeds, ctx_feats, ctx_len, n_valid) -> torch.Tensor:
        """block_embeds [B, bs, D]; ctx_feats [B, n, n_taps*D]: row b's first n_valid[b] are its
        tokens committed since the last call, at positions ctx_len[b].., the rest padding -> the
        block's normed hidden states [B, bs, D]. ctx_len + n_valid <= max_ctx_len: the caller's."""
        if self.ctx_cache is None:
            raise RuntimeError("call setup_cache(max_batch_size, max_ctx_len) first")
        bs, n, ids = block_embeds.shape[1], ctx_feats.shape[1], self.ids
        live = ctx_len + n_valid                                          # [B] context after append
        # slot = rope position; padding rows (i >= n_valid) go bs slots up, past the block, unread
        ctx_slots = ctx_len[:, None] + ids[:n] + bs * (ids[:n] >= n_valid[:, None])  # [B, n]
        slots = torch.cat([ctx_slots, live[:, None] + ids[:bs]], dim=1)              # [B, n+bs]
        cos, sin = self.rope_cos[slots], self.rope_sin[slots]                        # [B, n+bs, hd]
        f = self.fuse(ctx_feats)                                                     # [B, n, D]
        h = block_embeds.to(self.fc.weight.dtype)                                    # [B, bs, D]
        S = self.max_ctx_len + bs                    # the slots a row may read: context, then block
        for i, layer in enumerate(self.layers):
            h = layer(h, f, cos, sin, cache=BlockCache(self.ctx_cache[i], slots, live, S))
        return self.norm(h)

    @torch.no_grad()
    def append_context(self, ctx_feats: torch.Tensor, ctx_len: int, row: int = 0) -> None:
        """Write context rows' K/V without drafting (the prompt, before fixed-shape steps take over)
        into cache rows row .. row+B-1."""
        B, n, _ = ctx_feats.shape
        if self.ctx_cache is None:
            raise RuntimeError("call setup_cache(max_batch_size, max_ctx_len) first")
        if ctx_len + n > self.max_ctx_len:
            raise ValueError(f"drafter context overflow: ctx_len {ctx_len} + {n} new rows > "
                             f"max_ctx_len {self.max_ctx_len}")
        f = self.fuse(ctx_feats)                                          # [B, n, D]
        cos, sin = (t[None, ctx_len:ctx_len + n].expand(B, n, -1)
                    for t in (self.rope_cos, self.rope_sin))              # [B, n, hd]
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(f, cos, sin)
            self.ctx_cache[i, 0, row:row + B, ctx_len:ctx_len + n] = k
            self.ctx_cache[i, 1, row:row + B, ctx_len:ctx_len + n] = v

    @torch.no_grad()
    def draft_logits(self, target, last_token, ctx_feats, ctx_len, n_valid) -> torch.Tensor:
        """last_token [B] (the root) -> fp32 logits [B, bs-1, V] of the tokens after it (the rest:
        cached_forward's). Under TP: embedding all-reduce, cached_forward's, lm_head all-gather."""
        a, B = self.args, last_token.shape[0]
        block = torch.full((B, a.block_size), a.mask_token_id, device=last_token.device)  # [B, bs]
        block[:, 0] = last_token            # the real token first: MASK there collapses acceptance
        x = target.embed_tokens(block)                                    # [B, bs, D]
        if a.input_embedding_scale != 1.0:
            x = x * a.input_embedding_scale
        h = self.cached_forward(x, ctx_feats, ctx_len, n_valid)           # [B, bs, D]
        logits = target.head(h[:, 1:].to(target.lm_head.weight.dtype))   # [B, bs-1, V]
        if a.output_multiplier != 1.0:
            logits = logits * a.output_multiplier
        if a.final_logit_softcapping:
            logits = torch.tanh(logits / a.final_logit_softcapping) * a.final_logit_softcapping
        return logits


# ----------------------------------------------------------------------------------------------
# The cached layer's middle as two ops with a fast path: plain PyTorch here, one Triton launch each
# on a GPU (@kernels.fast picks it; kernels.py holds the kernels and the conditions they need).


@kernels.fast
def qkv_norm_rope(qkv, n_heads: int, n_kv: int, q_weight, k_weight, eps: float, cos, sin, k_cache,
                  v_cache, slots, q_start: int, interleaved: bool = False) -> torch.Tensor:
    """qkv [B, T, (H + 2 KV) hd]: T rows' fused q|k|v. Every row's key (k_norm'ed, rotated) and
    value go to k_cache / v_cache [Bmax, S, KV, hd] at (b, slots[b, t]); returns the queries of rows
    t >= q_start, q_norm'ed and rotated [B, T - q_start, H, hd]. cos / sin [B, T, hd]."""
    # [B, T, heads, hd]
    q, k, v = qkv.unflatten(-1, (n_heads + 2 * n_kv, -1)).split([n_heads, n_kv, n_kv], dim=2)
    rows = torch.arange(qkv.shape[0], device=qkv.device)[:, None]                     # [B, 1]
    k_cache[rows, slots] = M.rope(M.rms_norm(k, k_weight, eps), cos, sin, interleaved)
    v_cache[rows, slots] = v
    return M.rope(M.rms_norm(q[:, q_start:], q_weight, eps), cos[:, q_start:], sin[:, q_start:],
                  interleaved)


@kernels.fast
def block_attention(q, k_cache, v_cache, prefix_len, softmax_scale: float):
    """GQA attention of the block's queries q [B, T, H, hd] over k_cache / v_cache [B, S, KV, hd],
    row b's keys s < prefix_len[b] + T (its context, then the block) -> [B, T, H, hd]. In fp32, as
    flash attention computes it; a kv head's G = H / KV query heads are one matmul's rows. Not
    SDPA: with a mask and this few query rows it may pick a cuDNN kernel that uses few blocks."""
    (B, T, H, hd), (S, KV) = q.shape, k_cache.shape[1:3]
    qg = q.float().transpose(1, 2).reshape(B, KV, H // KV * T, hd)           # [B, KV, G*T, hd]
    s = torch.matmul(qg, k_cache.float().permute(0, 2, 3, 1)) * softmax_scale  # [B, KV, G*T, S]
    visible = torch.arange(S, device=q.device) < (prefix_len + T)[:, None]   # [B, S]
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    o = torch.matmul(s.softmax(-1), v_cache.float().transpose(1, 2))         # [B, KV, G*T, hd]
    return o.view(B, H, T, hd).transpose(1, 2).to(q.dtype)                   # [B, T, H, hd]


# ==============================================================================================
# Checkpoint I/O: config parsing and checks, the safetensors loader, the writer, a tiny config for
# tests. Checkpoints are config.json + model.safetensors (or index + shards), unprefixed names like
# the public ones.


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default taps: evenly spaced from layer 1 to layer T-3 (Python round, as
    upstream)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]
