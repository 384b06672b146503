"""Kimi K2.6 / DeepSeek-V3 text model: MLA attention over a compressed KV cache, a noaux_tc-routed
MoE with INT4 experts, tensor parallelism. It reads top to bottom as the forward: config, ops,
layers, Transformer.

Invariants this file keeps:
  * every hyperparameter comes from the checkpoint's config.json (checkpoint.py parses it); none is
    guessed;
  * the naive MLA path (decompress K/V; prefill) and the weight-absorbed path (attend over the
    compressed cache; decode and tree verify) compute the same function; tests/test_model.py checks
    both against transformers;
  * the KV cache is one static tensor
    [n_layers, max_batch, max_seq_len, kv_lora_rank + qk_rope_head_dim] written in place, so
    verifying a tree (positions = start + depth, ancestor-only mask) needs no second model and
    committing the accepted path (verify.py) is one gather / scatter over all layers;
  * each op or part (Transformer.blocks, MLA.attend, MLP.forward, Gate.forward, Experts.forward,
    MoE.local) marked `@kernels.fast` is written here in plain PyTorch and is the reference: on a
    GPU the switch in kernels.py may run Triton kernels instead, fused across the ops of a part (on
    the CPU a few run in fewer ops), which tests/test_kernels.py holds equal to it;
  * under tensor parallelism every collective is visible at its call site (all_reduce / all_gather
    below).

Usage:
    import checkpoint
    model = Transformer(checkpoint.model_args("ckpt/"))   # current default device and dtype
    checkpoint.load_checkpoint(model, "ckpt/")
    logits = model(tokens).logits    # [B, T] int64 -> [B, T, vocab] fp32, no cache used
Tests: python -m pytest -q tests/test_model.py
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import kernels

# Tensor-parallel coordinates, set once by set_tp (cli.init_distributed under torchrun); a single
# process keeps world_size = 1 and never calls a collective.
world_size = 1
rank = 0


# ----------------------------------------------------------------------------------------------
# Config (parsed from config.json by checkpoint.py)


@dataclass
class QuantArgs:
    """The routed experts' INT4 format: compressed-tensors pack-quantized, symmetric, one scale per
    group."""
    group_size: int = 32


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int            # dense MLP (first_k_dense_replace layers)
    moe_intermediate_size: int        # per routed expert; shared expert = this x n_shared_experts
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_type: str = "default"        # "default" or "yarn"
    rope_factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers after the last (not run)
    quant: QuantArgs | None = None     # None: float experts
    nested: bool = False               # K2.5/K2.6 layout: text model under `language_model.`

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return (self.n_routed_experts > 0 and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    def tp_splits(self) -> list[tuple[str, int, int]]:
        """What tensor parallelism splits (check_tp_divisibility): (name, size, unit), each rank
        taking whole units (the routed experts' intermediate rows: whole INT4 groups)."""
        gs = self.quant.group_size if self.quant else 1
        return [("num_attention_heads", self.num_attention_heads, 1),
                ("vocab_size", self.vocab_size, 1),
                ("intermediate_size", self.intermediate_size, 1),
                ("moe_intermediate_size", self.moe_intermediate_size, gs),
                ("moe_intermediate_size*n_shared_experts",
                 self.moe_intermediate_size * self.n_shared_experts, 1)]


def check_tp_divisibility(args, ws: int) -> None:
    """Fail before loading anything if the world size cannot split the model (ModelArgs) or the
    drafter (draft.DraftArgs) evenly: each gives its args.tp_splits()."""
    for name, value, unit in args.tp_splits():
        if value % (ws * unit):
            extra = f" x group_size {unit}" if unit > 1 else ""
            raise ValueError(f"tensor parallel size {ws} does not divide {name}={value}{extra}")


# ----------------------------------------------------------------------------------------------
# Parallel linear layers. Each weight carries `shard_dim` (0: split output rows, 1: split input
# columns, None: replicated) so the loader reads only this rank's slice.


@kernels.fast
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T -> [..., out]: every Linear's GEMM (decoding: a few rows)"""
    return F.linear(x, weight)


class Linear(nn.Module):
    """y = x W^T; `shard_dim` says how tensor parallelism splits W: 0 column-parallel (output rows),
    1 row-parallel (input columns: the caller all-reduces the partial sums), None replicated.
    out_features {name: rows}: W stacks these checkpoint tensors (projections of the same input: one
    GEMM), each split by TP on its own, so a rank's W is its slice of each in turn; the loader fills
    them (weight.parts)."""

    def __init__(self, in_features: int, out_features: int | dict[str, int],
                 shard_dim: int | None = None):
        super().__init__()
        parts = out_features if isinstance(out_features, dict) else None
        out_features = sum(parts.values()) if parts else out_features
        part_out = out_features // world_size if shard_dim == 0 else out_features
        part_in = in_features // world_size if shard_dim == 1 else in_features
        self.weight = nn.Parameter(torch.empty(part_out, part_in))   # [out/ws?, in/ws?]
        self.weight.shard_dim = shard_dim
        self.weight.parts = parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class ParallelEmbedding(nn.Module):
    """Vocabulary-parallel embedding: rank r holds rows [r*V/ws, (r+1)*V/ws)."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.part = vocab_size // world_size
        self.weight = nn.Parameter(torch.empty(self.part, dim))    # [V/ws, D]
        self.weight.shard_dim = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if world_size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - rank * self.part
        out = (local < 0) | (local >= self.part)                  # another rank's rows
        y = F.embedding(local.masked_fill(out, 0), self.weight).masked_fill(out[..., None], 0)
        dist.all_reduce(y)                      # each token's row lives on exactly one rank
        return y


# ----------------------------------------------------------------------------------------------
# RMSNorm


@kernels.fast
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] / rms(x) * weight: fp32 statistics, cast back to x's dtype, then scaled (the
    transformers order; it matters in bf16)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight.shard_dim = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# ----------------------------------------------------------------------------------------------
# Rotary embedding: YaRN frequencies exactly as transformers computes them, applied to interleaved
# pairs (x[2i], x[2i+1]) as the DeepSeek/Kimi checkpoints expect. The drafter (draft.py) uses the
# same three functions over its whole head_dim, on Qwen3's halves (interleaved=False).


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(args, dim: int | None = None, truncate: bool = True,
                  legacy_amplitude: bool = False) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [dim/2] fp32, attention_factor applied to cos/sin). args: a ModelArgs, or
    the drafter's DraftArgs (the same rope fields); dim: the rotated width (default
    qk_rope_head_dim); truncate: round the YaRN ramp's ends to whole indices (transformers'
    default); legacy_amplitude: ignore mscale / mscale_all_dim, attention_factor = 1 + 0.1
    ln(factor) (the drafter's)."""
    dim, base = dim or args.qk_rope_head_dim, args.rope_theta
    pos_freq = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)        # [dim/2]
    if args.rope_type != "yarn":
        return 1.0 / pos_freq, 1.0
    factor, L0 = args.rope_factor, args.original_max_position_embeddings

    # frequency index that completes `rot` turns over L0 positions
    def corr_dim(rot: float) -> float:
        return dim * math.log(L0 / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = corr_dim(args.beta_fast), corr_dim(args.beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                    # avoid a division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp     # 1: keep the original (high) frequency; 0: interpolate by factor
    inv_freq = 1.0 / (factor * pos_freq) * (1 - keep) + 1.0 / pos_freq * keep    # [dim/2]
    af = args.rope_attention_factor
    if af is None:
        if not legacy_amplitude and args.mscale and args.mscale_all_dim:
            af = yarn_mscale(factor, args.mscale) / yarn_mscale(factor, args.mscale_all_dim)
        else:
            af = yarn_mscale(factor)
    return inv_freq, float(af)


def rope_cos_sin(inv_freq: torch.Tensor, attn_factor: float, positions: torch.Tensor, dtype,
                 interleaved: bool = True) -> tuple:
    """positions [B, T] -> cos, sin [B, T, rope_dim] for rope(): each pair's (cos, cos), (-sin,
    sin), pairs adjacent (interleaved, K2) or halves (Qwen3, the drafter); fp32, cast as HF does"""
    ang = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)   # [B, T, dim/2]
    cos, sin = (ang.cos() * attn_factor).to(dtype), (ang.sin() * attn_factor).to(dtype)
    if interleaved:
        return (torch.stack((cos, cos), dim=-1).flatten(-2),
                torch.stack((-sin, sin), dim=-1).flatten(-2))
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


@kernels.fast
def rope(x, cos, sin, interleaved: bool = True) -> torch.Tensor:
    """Rotate each pair (x1, x2) of x [B, T, (H,) P] (x[2i], x[2i+1] when interleaved, else x[i],
    x[i + P/2]) by cos / sin [B, T, P] (rope_cos_sin): x * (cos, cos) + (x2, x1) * (-sin, sin)."""
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if interleaved:
        partner = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x2, x1) per adjacent pair
    else:
        x1, x2 = x.chunk(2, dim=-1)
        partner = torch.cat([x2, x1], dim=-1)                    # rotate_half without the sign
    return x * cos + partner * sin


# ----------------------------------------------------------------------------------------------
# MLA attention. Per token the cache holds one latent row, shared by every head:
# kv_a_layernorm(c_kv) [R] then rope(k_pe) [P]. Naive (prefill): decompress each key's latent into
# per-head k_nope, v with kv_b_proj. Absorbed (decode, verify): fold kv_b_proj's key half into the
# query (q_lat = q_nope W_UK) and its value half into the output, so attention reads only the
# compressed cache. The new tokens see the committed prefix and, among themselves, what the tree
# mask allows (their ancestors).

def mla_latent(kv, weight, eps: float, cos, sin) -> torch.Tensor:
    """kv_a_proj_with_mqa's output kv [B, T, R+P] -> what the cache keeps per token [B, T, R+P]:
    the normed latent (every head's key and value) and the roped shared key."""
    R = weight.shape[0]
    return torch.cat([rms_norm(kv[..., :R], weight, eps), rope(kv[..., R:], cos, sin)], dim=-1)


@kernels.fast
def mla_latent_to_cache(kv, weight, eps: float, cos, sin, cache, slots) -> None:
    """cache[b, slots[b, t]] = mla_latent(kv)[b, t] in place: cache [Bmax, S, R+P], slots [B, T]"""
    latent = mla_latent(kv, weight, eps, cos, sin)                                  # [B, T, R+P]
    cache[:len(kv)].scatter_(1, slots[..., None].expand_as(latent), latent.to(cache.dtype))


@kernels.fast
def mla_attention(q_lat, q_pe, cache, prefix_len, tree_mask, softmax_scale: float):
    """Absorbed MLA attention: q_lat [B, T, H, R], q_pe [B, T, H, P] over cache [B, S, R+P] (the
    latent is both key and value) -> [B, T, H, R]. Query t of row b sees slot s < prefix_len[b] (the
    committed prefix) and tree slot prefix_len[b] + j where tree_mask[b, t, j] ([B, T, T] bool)."""
    (B, T, _, R), S = q_lat.shape, cache.shape[1]
    kv, k_pe = cache[..., :R].float(), cache[..., R:].float()               # [B, S, R], [B, S, P]
    scores = (torch.einsum("bthr,bsr->bths", q_lat.float(), kv)
              + torch.einsum("bthp,bsp->bths", q_pe.float(), k_pe)) * softmax_scale  # [B,T,H,S]
    # visible [B, T, S]: the committed prefix, and tree slot j = s - prefix_len if tree_mask[.., j]
    j = torch.arange(S, device=cache.device) - prefix_len[:, None]              # [B, S]
    in_tree = torch.gather(tree_mask, 2, j.clamp(0, T - 1)[:, None, :].expand(B, T, S))
    visible = (j < 0)[:, None, :] | (((j >= 0) & (j < T))[:, None, :] & in_tree)
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).masked_fill(~visible.any(-1)[:, :, None, None], 0)  # none: 0
    return torch.einsum("bths,bsr->bthr", p, kv).to(q_lat.dtype)


class MLA(nn.Module):
    """Multi-head latent attention, tensor-parallel by heads (o_proj row-parallel: one
    all-reduce)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads // world_size          # local heads
        self.nope, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        # q_a_proj and kv_a_proj_with_mqa read the same x: one replicated stacked weight, one GEMM
        a_rows = {"q_a_proj": args.q_lora_rank,
                  "kv_a_proj_with_mqa": args.kv_lora_rank + args.qk_rope_head_dim}
        self.qkv_a_proj = Linear(args.hidden_size, a_rows)
        self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        q_b_rows = args.num_attention_heads * args.qk_head_dim
        self.q_b_proj = Linear(args.q_lora_rank, q_b_rows, shard_dim=0)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        kv_b_rows = args.num_attention_heads * (args.qk_nope_head_dim + args.v_head_dim)
        self.kv_b_proj = Linear(args.kv_lora_rank, kv_b_rows, shard_dim=0)
        o_cols = args.num_attention_heads * args.v_head_dim
        self.o_proj = Linear(o_cols, args.hidden_size, shard_dim=1)
        self.softmax_scale = args.qk_head_dim ** -0.5
        if args.rope_type == "yarn" and args.mscale_all_dim:
            # transformers: the YaRN mscale enters the softmax scale squared (q and k each carry one
            # factor)
            self.softmax_scale *= yarn_mscale(args.rope_factor, args.mscale_all_dim) ** 2

    def forward(self, x, cos, sin, cache, start_pos, tree_mask, absorb=False, slots=None):
        """x [B, T, D] -> [B, T, D]: the heads' outputs (attend) through o_proj."""
        o = self.attend(x, cos, sin, cache, start_pos, tree_mask, absorb, slots)    # [B, T, H, v]
        y = self.o_proj(o.flatten(2))
        if world_size > 1:
            dist.all_reduce(y)      # o_proj is row-parallel: sum the heads' partial outputs
        return y

    @kernels.fast
    def attend(self, x, cos, sin, cache, start_pos, tree_mask, absorb, slots):
        """x [B, T, D] -> [B, T, H, v]. cache: this layer's rows [Bmax, S, R+P] (new latents to slots
        [B, T]) or None (x attends to itself); absorb: attend over the compressed cache (decode)."""
        B, T, _ = x.shape
        q_a, kv = self.qkv_a_proj(x).split([self.q_lora_rank, self.kv_lora_rank + self.rope_dim],
                                           -1)                   # [B, T, q_lora_rank], [B, T, R+P]
        q = self.q_b_proj(self.q_a_layernorm(q_a)).view(B, T, self.n_heads, -1)  # [B, T, H, qk]
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        q_pe = rope(q_pe, cos, sin)
        norm = self.kv_a_layernorm
        if cache is None:
            latent = mla_latent(kv, norm.weight, norm.eps, cos, sin)                 # [B, T, R+P]
            return self._naive(q_nope, q_pe, latent, tree_mask)
        mla_latent_to_cache(kv, norm.weight, norm.eps, cos, sin, cache, slots)
        attend = self._absorbed if absorb else self._naive_cached
        return attend(q_nope, q_pe, cache[:B], start_pos, tree_mask)

    def _naive(self, q_nope, q_pe, keys, mask):
        """Decompress every key's latent into per-head k_nope and v (prefill: compute-bound,
        T large)."""
        B, S, _ = keys.shape
        c_kv, k_pe = keys.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv)
        kv = kv.view(B, S, self.n_heads, self.nope + self.v_dim)           # [B, S, H, nope+v]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2).expand(-1, -1, self.n_heads, -1)          # [B, S, H, P]
        k = torch.cat([k_nope, k_pe], dim=-1)                              # [B, S, H, qk]
        q = torch.cat([q_nope, q_pe], dim=-1)                              # [B, T, H, qk]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask.unsqueeze(1), scale=self.softmax_scale)
        return o.transpose(1, 2)                                           # [B, T, H, v]

    def _naive_cached(self, q_nope, q_pe, cache, start_pos, tree_mask):
        """Prefill: the naive path over the cache's first start_pos + T slots (an int start_pos)."""
        if not isinstance(start_pos, int):
            raise ValueError("the naive MLA path needs an int start_pos (prefill); use absorb=True")
        B, T = q_nope.shape[:2]
        prefix = torch.ones(B, T, start_pos, dtype=torch.bool, device=q_nope.device)
        mask = torch.cat([prefix, tree_mask], -1)                                 # [B, T, S]
        return self._naive(q_nope, q_pe, cache[:, :start_pos + T], mask)

    def _absorbed(self, q_nope, q_pe, cache, start_pos, tree_mask):
        """W_UK absorbed into the query, W_UV into the output: attention over the R+P cached values
        per token (decode / verify: memory-bound, reads only the compressed cache)."""
        wkv_b = self.kv_b_proj.weight.view(self.n_heads, -1, self.kv_lora_rank)     # [H, nope+v, R]
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope, wkv_b[:, :self.nope])          # [B, T, H, R]
        prefix = _starts(start_pos, q_nope.shape[0], q_nope.device)                    # [B]
        o_lat = mla_attention(q_lat, q_pe, cache, prefix, tree_mask, self.softmax_scale)
        return torch.einsum("bthr,hdr->bthd", o_lat, wkv_b[:, self.nope:])           # [B, T, H, v]


def _starts(start_pos, B: int, device) -> torch.Tensor:
    """start_pos, an int or a LongTensor [B], as a LongTensor [B] (an int filled in: no copy)"""
    return start_pos if torch.is_tensor(start_pos) else torch.full((B,), start_pos, device=device)


def _slots(start_pos, B: int, T: int, device) -> torch.Tensor:
    """start_pos + [0, T): [B, T], contiguous (the cache-write kernel indexes it flat)"""
    return _starts(start_pos, B, device).view(B, 1) + torch.arange(T, device=device)


# ----------------------------------------------------------------------------------------------
# Feed-forward: dense SwiGLU MLP, noaux_tc router, routed experts (INT4 or float), shared experts


class MLP(nn.Module):
    """SwiGLU MLP, tensor-parallel (gate/up column, down row). Returns this rank's partial sum: the
    caller all-reduces (so MoE can add routed + shared before one all-reduce)."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        # gate_proj and up_proj read the same x: their weights stacked, one GEMM
        self.gate_up_proj = Linear(dim, {"gate_proj": inter, "up_proj": inter}, shard_dim=0)
        self.down_proj = Linear(inter, dim, shard_dim=1)

    @kernels.fast
    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)              # [..., inter/ws] each
        return self.down_proj(F.silu(gate) * up)


class DenseMLP(MLP):
    def forward(self, x):
        y = super().forward(x)
        if world_size > 1:
            dist.all_reduce(y)
        return y


def limit_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing (K2.6 has one group): only the experts of the topk_group
    groups with the best two-expert sums stay choosable; the others' choice [N, E] becomes -inf."""
    grouped = choice.view(choice.shape[0], n_group, -1)                                # [N, G, E/G]
    group_scores = grouped.topk(2, dim=-1)[0].sum(-1)                                  # [N, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1)[1], True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)


class Gate(nn.Module):
    """The noaux_tc router of one MoE layer."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.norm, self.scale = args.norm_topk_prob, args.routed_scaling_factor
        # [E, D] in fp32 whatever the model dtype: the scores are computed in fp32 (as the reference
        # does), so the bf16 checkpoint weight is upcast once at load instead of being converted
        # again on every step
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size,
                                               dtype=torch.float32))
        self.weight.shard_dim = None
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts,
                                                                dtype=torch.float32))
        self.e_score_correction_bias.shard_dim = None

    @kernels.fast
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """noaux_tc: x [N, D] -> (weights [N, k] fp32, expert ids [N, k] by descending score +
        bias): sigmoid scores in fp32; the bias steers the choice only."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()                        # [N, E]
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            choice = limit_groups(choice, self.n_group, self.topk_group)
        ids = choice.topk(self.top_k, dim=-1)[1]                                           # [N, k]
        w = scores.gather(1, ids)
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, ids


# INT4 pack-quantized (compressed-tensors): W [O, I] is stored as packed [O, I/8] int32, column
# j = 8k + i in bits 4i..4i+3 of word k (column 8k in the least significant nibble) as u = q + 8, q
# in [-8, 7]; and scale [O, I/group]: W[o, j] = q[o, j] * scale[o, j // group]. Leading dims (a
# stack of experts [E, O, I]) pass through.


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., I/8] int32 words -> [..., I] int8 values q in [-8, 7]: nibble i of word k is column
    8k + i (shifts, so the host's byte order does not matter)."""
    nibbles = packed[..., None] >> packed.new_tensor(range(0, 32, 4))               # [..., I/8, 8]
    return (nibbles & 0xF).to(torch.int8).flatten(-2) - 8                           # q = u - 8


def dequant_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """packed [..., O, I/8] int32, scale [..., O, I/group_size] -> W [..., O, I], scale's dtype"""
    q = unpack_int4(packed).unflatten(-1, (-1, group_size))              # [..., O, I/group, group]
    assert q.shape[-2] == scale.shape[-1], f"{tuple(packed.shape)}, scale {tuple(scale.shape)}"
    return (q.to(scale.dtype) * scale[..., None]).flatten(-2)


class Experts(nn.Module):
    """Routed experts stacked per layer. INT4: w13_packed [E, 2I/ws, D/8] int32 (gate rows then up
    rows), w13_scale [E, 2I/ws, D/gs], w2_packed [E, D, I/ws/8], w2_scale [E, D, I/ws/gs]; never
    dequantized as a whole. Float checkpoints: w13 [E, 2I/ws, D], w2 [E, D, I/ws]. Tensor-parallel
    inside every expert (each rank holds all experts, a slice of the intermediate dim): at one
    request this balances the bytes each rank reads, where expert parallelism leaves the rank that
    owns the most chosen experts reading more (`bench.py moe-split` measures both)."""

    def __init__(self, args: ModelArgs, quant: QuantArgs | None):
        super().__init__()
        E, D = args.n_routed_experts, args.hidden_size
        inter = args.moe_intermediate_size // world_size
        self.inter, self.quant = inter, quant
        if quant:
            gs = quant.group_size
            sdt = torch.get_default_dtype()
            self.w13_packed = nn.Parameter(torch.empty(E, 2 * inter, D // 8, dtype=torch.int32),
                                           requires_grad=False)
            self.w13_scale = nn.Parameter(torch.empty(E, 2 * inter, D // gs, dtype=sdt),
                                          requires_grad=False)
            self.w2_packed = nn.Parameter(torch.empty(E, D, inter // 8, dtype=torch.int32),
                                          requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(E, D, inter // gs, dtype=sdt),
                                         requires_grad=False)
        else:
            self.w13 = nn.Parameter(torch.empty(E, 2 * inter, D))                  # [E, 2I/ws, D]
            self.w2 = nn.Parameter(torch.empty(E, D, inter))                       # [E, D, I/ws]

    @kernels.fast
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, D], weights / ids [N, k] -> this rank's Σ_k weights[:, k] SwiGLU_{ids[:, k]}(x)
        [N, D] fp32: each used expert on its own rows, one at a time (INT4: bounded memory)."""
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)                    # [N, D]
        for e in ids.unique().tolist():
            rows, k = (ids == e).nonzero(as_tuple=True)      # the rows routed to e, at which choice
            w13, w2 = self.expert(e)                                         # [2I/ws, D], [D, I/ws]
            gate, up = F.linear(x[rows].to(w13.dtype), w13).chunk(2, dim=-1)   # [len(rows), I] each
            y.index_add_(0, rows, F.linear(F.silu(gate) * up, w2) * weights[rows, k, None])
        return y

    def expert(self, e) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's w13 [2I/ws, D], w2 [D, I/ws] (e a tensor: stacked): INT4 dequantized, fp32; or
        as stored."""
        if self.quant is None:
            return self.w13[e], self.w2[e]
        gs = self.quant.group_size
        return (dequant_int4(self.w13_packed[e], self.w13_scale[e], gs).float(),
                dequant_int4(self.w2_packed[e], self.w2_scale[e], gs).float())


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Gate(args)
        self.experts = Experts(args, args.quant)
        self.shared_experts = MLP(args.hidden_size,
                                  args.moe_intermediate_size * args.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> routed + shared experts [..., D], fp32 (the next residual add rounds it)"""
        y = self.local(x.flatten(0, -2))                                               # [N, D]
        if world_size > 1:
            dist.all_reduce(y)      # one all-reduce per MoE layer: routed + shared summed first
        return y.view_as(x)

    @kernels.fast
    def local(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> this rank's routed + shared experts [N, D], fp32"""
        w, ids = self.gate(x)                                          # [N, k] each
        return self.experts(x, w, ids) + self.shared_experts(x).float()


# ----------------------------------------------------------------------------------------------
# Block and Transformer


class Block(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.self_attn = MLA(args)
        self.mlp = (MoE(args) if args.is_moe_layer(layer_id)
                    else DenseMLP(args.hidden_size, args.intermediate_size))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache, start_pos, tree_mask, absorb, slots=None):
        """x [B, T, D] -> [B, T, D]: attention, then the MLP, each on the normed stream and added
        back to it (the MoE's fp32 output rounds to the stream's dtype)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, start_pos, tree_mask,
                               absorb, slots)
        return x + self.mlp(self.post_attention_layernorm(x)).to(x.dtype)


# The cache path attends over the compressed cache (absorbed MLA) for decode and tree verify (any
# width: every budget rounds like decoding) and for a tensor start_pos (a captured step); naive MLA
# only for prefills of more than this many tokens, where decompressing K/V once is cheaper.
ABSORB_MAX_T = 64


class Output(NamedTuple):
    """What Transformer.forward returns, whatever its arguments."""
    logits: torch.Tensor                 # [B, T, vocab] fp32 ([B, 1, vocab] with last_only)
    taps: torch.Tensor | None            # [B, T, len(hidden_layers) * D] the tapped layers, or None


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        check_tp_divisibility(args, world_size)
        self.args = args
        self.embed_tokens = ParallelEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, shard_dim=0)   # vocab-parallel
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq, self.rope_attn_factor = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.kv_cache = None    # [n_layers, Bmax, S, R+P], allocated by setup_cache
        self.rope_cos = self.rope_sin = None     # [S, P], by setup_cache

    @staticmethod
    def cache_shape(a: ModelArgs, max_batch_size: int, max_seq_len: int) -> tuple[int, ...]:
        """One compressed latent + rope key per layer and slot (MLA):
        [layers, batch, slots, R + P]."""
        return a.num_hidden_layers, max_batch_size, max_seq_len, a.kv_lora_rank + a.qk_rope_head_dim

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        """The KV cache, and cos / sin of every slot's position (a cached forward gathers its rows':
        the same values, 2 launches instead of ~10)."""
        p = self.embed_tokens.weight
        shape = self.cache_shape(self.args, max_batch_size, max_seq_len)
        self.kv_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        slots = torch.arange(max_seq_len, device=p.device)[None]                       # [1, S]
        self.rope_cos, self.rope_sin = (t[0] for t in rope_cos_sin(
            self.inv_freq, self.rope_attn_factor, slots, p.dtype))                    # [S, P] each

    @property
    def max_seq_len(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.shape[2]

    def forward(self, tokens, start_pos=None, positions=None, tree_mask=None, hidden_layers=(),
                absorb=None, last_only=False, debug=False, cache_row=0) -> Output:
        """tokens [B, T] -> Output (logits; taps: hidden_layers' outputs). start_pos None: no cache;
        int or LongTensor [B]: the tokens go to cache rows cache_row.. at slots start_pos + [0, T)
        and see every slot before; among themselves, tree_mask [B, T, T] (default causal). positions
        [B, T]: rope positions < max_seq_len (default: the slots; verify: start + depth)."""
        B, T = tokens.shape
        slots = _slots(0 if start_pos is None else start_pos, B, T, tokens.device)     # [B, T]
        positions = slots if positions is None else positions
        overflow = isinstance(start_pos, int) and start_pos + T > self.max_seq_len
        if start_pos is not None and (self.kv_cache is None or overflow):
            raise ValueError(f"cache overflow: {self.max_seq_len} slots (setup_cache), not "
                             f"start_pos {start_pos} + {T} tokens")
        if absorb is None:       # see ABSORB_MAX_T
            absorb = start_pos is not None and (T <= ABSORB_MAX_T or tree_mask is not None
                                                or not isinstance(start_pos, int))
        if tree_mask is None:      # causal, made once for every layer
            tree_mask = torch.ones(B, T, T, dtype=torch.bool, device=tokens.device).tril()
        h = self.embed_tokens(tokens)                                                   # [B, T, D]
        if start_pos is None:
            cos, sin = rope_cos_sin(self.inv_freq, self.rope_attn_factor, positions, h.dtype)
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]          # [B, T, P] each
        caches = [None] * len(self.layers) if start_pos is None else self.kv_cache[:, cache_row:]
        h, taps = self.blocks(h, cos, sin, caches, start_pos, tree_mask, absorb, slots,
                              hidden_layers, debug)
        logits = self.head(h[:, -1:] if last_only else h)
        if debug:
            check_finite(logits, "logits")
        return Output(logits, torch.cat(taps, dim=-1) if taps else None)

    @kernels.fast
    def blocks(self, h, cos, sin, caches, start_pos, tree_mask, absorb, slots, hidden_layers,
               debug) -> tuple[torch.Tensor, list]:
        """h [B, T, D] through every Block and the final norm -> (normed h, hidden_layers' outputs);
        caches: the layers' cache rows [L, B, S, R+P] or Nones. The fast path (kernels.py) adds each
        residual in the next norm."""
        taps = []
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h = layer(h, cos, sin, cache, start_pos, tree_mask, absorb, slots)
            if debug:
                check_finite(h, f"layer {i} output")
            if i in hidden_layers:
                taps.append(h)
        return self.norm(h), taps

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [..., D] -> fp32 logits [..., vocab] (the drafter's too)."""
        logits = self.lm_head(h).float()
        if world_size > 1:
            parts = [torch.empty_like(logits) for _ in range(world_size)]
            dist.all_gather(parts, logits)  # vocab-parallel lm_head: each rank holds V/ws columns
            logits = torch.cat(parts, dim=-1)
        return logits


def check_finite(t: torch.Tensor, where: str) -> None:
    """Debug check: report the first place where NaN/inf appears."""
    if not torch.isfinite(t).all():
        raise FloatingPointError(f"non-finite values (NaN/inf) first seen in {where}")


# ----------------------------------------------------------------------------------------------
# Running under torchrun: WORLD_SIZE, RANK and LOCAL_RANK come from its environment.

# --device of generate.py (cli.py) and bench.py
DEVICE_HELP = ("cpu, cuda or cuda:N (default: this rank's GPU, else the CPU); under torchrun the "
               "backend follows it: NCCL on GPUs, gloo on the CPU")


def set_tp(size: int, r: int) -> None:
    """Set the TP coordinates without a process group (tests that build per-rank models)."""
    global world_size, rank
    world_size, rank = size, r


def print0(*a, **k) -> None:
    if rank == 0:
        print(*a, **k)
