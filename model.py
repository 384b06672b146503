"""Kimi K2.6 / DeepSeek-V3 text model: MLA attention with a compressed KV cache, noaux_tc MoE with
INT4 routed experts, tensor parallelism, and HF safetensors checkpoint loading.

Invariants this file keeps:
  * every hyperparameter comes from config.json (ModelArgs.from_config); nothing is guessed from shapes;
  * the naive MLA path (decompress K/V) and the weight-absorbed path (attend over the compressed cache)
    compute the same function; tests/test_model.py checks both against transformers' DeepseekV3;
  * the KV cache is one static tensor [n_layers, max_batch, max_seq_len, kv_lora_rank + qk_rope_head_dim]
    written in place, so tree verification (positions = start + depth, ancestor-only mask) needs no
    second model, and KV commit (verify.py) is one gather/scatter over all layers;
  * under tensor parallelism every collective is visible at its call site (all_reduce / all_gather below).

Usage:
    args = ModelArgs.from_config("ckpt/config.json")
    model = Transformer(args)            # current default device and dtype
    load_checkpoint(model, "ckpt/")
    logits = model(tokens)               # [B, T] int64 -> [B, T, vocab], no cache used
"""
from __future__ import annotations

import json
import math
import os
import re
import resource
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import kernels

# ----------------------------------------------------------------------------------------------
# Distributed state: read once from the torchrun environment (WORLD_SIZE, RANK, LOCAL_RANK).
# A single process needs no torchrun: world_size = 1 and no collective is ever called.

world_size = 1
rank = 0


DEVICE_HELP = ("cpu, cuda or cuda:N (default: this rank's GPU, else the CPU); under torchrun the backend follows it: "
               "NCCL on GPUs, gloo on the CPU")          # generate.py's and bench.py's --device (init_distributed)


def init_distributed(timeout_s: float = 300.0, device: str | None = None) -> torch.device:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPU) and return this rank's device: `device` (a
    --device flag; "cuda" means this rank's GPU), else this rank's GPU if there is one, else the CPU. The backend
    follows the device, so --device cpu on a GPU host runs over gloo."""
    global world_size, rank
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        from datetime import timedelta
        # A timeout turns a rank that died into an error on the others instead of a hang.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=timeout_s))
    return device


def close_distributed() -> None:
    """Leave the process group at exit: every rank waits for the others, then tears down (without this, gloo
    aborts at interpreter exit with 'terminate called without an active exception')."""
    if dist.is_initialized():
        dist.barrier()
        if dist.get_backend() == "gloo":
            # NCCL is left to process exit: on 2xH200 here, destroy_process_group() hung in a process that had
            # captured NCCL all-reduces in a CUDA graph (measured_here.md)
            dist.destroy_process_group()


def set_tp(size: int, r: int) -> None:
    """Set the TP coordinates without a process group (tests that build per-rank models)."""
    global world_size, rank
    world_size, rank = size, r


def print0(*a, **k) -> None:
    if rank == 0:
        print(*a, **k)


# ----------------------------------------------------------------------------------------------
# Config


@dataclass
class QuantArgs:
    """compressed-tensors `pack-quantized` settings of the routed experts (K2-Thinking/K2.5/K2.6)."""
    num_bits: int = 4
    group_size: int = 32
    ignore: list = field(default_factory=list)

    @staticmethod
    def from_config(q: dict, where: str) -> "QuantArgs":
        def bad(msg):
            return ValueError(f"{where}: quantization_config {msg}")
        if q.get("quant_method") != "compressed-tensors":
            raise bad(f"quant_method {q.get('quant_method')!r} is not supported (expected 'compressed-tensors')")
        if q.get("format") != "pack-quantized":
            raise bad(f"format {q.get('format')!r} is not supported (expected 'pack-quantized')")
        groups = q.get("config_groups") or {}
        if len(groups) != 1:
            raise bad(f"config_groups has {len(groups)} groups; exactly one is supported")
        g = next(iter(groups.values()))
        w = g.get("weights") or {}
        # (key, required value, compressed-tensors' default when the key is absent)
        checks = [("num_bits", 4, None), ("type", "int", "int"), ("symmetric", True, True),
                  ("strategy", "group", None), ("dynamic", False, False)]
        for key, want, default in checks:
            if w.get(key, default) != want:
                raise bad(f"weights.{key} = {w.get(key)!r} is not supported (expected {want!r})")
        # "group" act-order stores a g_idx permutation; "weight"/"static" reorder only during calibration
        if w.get("actorder") not in (None, False, "weight", "static"):
            raise bad(f"weights.actorder = {w.get('actorder')!r} is not supported (expected null)")
        if g.get("input_activations") or g.get("output_activations"):
            raise bad("activation quantization is not supported (W4A16 only)")
        gs = w.get("group_size")
        if not isinstance(gs, int) or gs <= 0 or gs % 8:
            raise bad(f"weights.group_size = {gs!r}; expected a positive multiple of 8")
        return QuantArgs(num_bits=4, group_size=gs, ignore=list(q.get("ignore") or []))

    def quantizes(self, module_name: str) -> bool:
        """True if `module_name` (e.g. 'model.layers.3.mlp.experts.7.up_proj') is quantized."""
        short = module_name.split(".")[-1]
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], module_name):
                    return False
            elif pat in (module_name, short) or module_name.endswith("." + pat):
                return False
        return True


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
    quant: QuantArgs | None = None
    nested: bool = False               # K2.5/K2.6 layout: text model under `language_model.`

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @staticmethod
    def from_config(path_or_dict) -> "ModelArgs":
        """Read a flat kimi_k2/deepseek_v3 config or a nested kimi_k25 (K2.5/K2.6) config."""
        return _args_from_dict(*read_config(path_or_dict, "config"))


def read_config(path_or_dict, name: str) -> tuple[dict, str]:
    """A config dict, or a checkpoint dir / config.json path -> (dict, where) for error messages."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, name
    where = str(path_or_dict)
    if os.path.isdir(where):
        where = os.path.join(where, "config.json")
    if not os.path.exists(where):
        raise FileNotFoundError(f"{where}: config.json not found")
    try:
        with open(where) as f:
            return json.load(f), where
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None


_TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


def _args_from_dict(cfg: dict, where: str) -> ModelArgs:
    top = cfg
    nested = "text_config" in cfg
    if nested:
        if cfg.get("model_type") not in ("kimi_k25", None):
            raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} with a text_config is not "
                             f"supported (expected 'kimi_k25')")
        cfg = cfg["text_config"]
        where = where + ":text_config"
    if cfg.get("model_type") not in _TEXT_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} is not supported "
                         f"(expected one of {_TEXT_MODEL_TYPES} or a kimi_k25 wrapper)")

    def need(key):
        if key not in cfg or cfg[key] is None:
            raise ValueError(f"{where}: required field {key!r} is missing")
        return cfg[key]

    def opt(key, default):
        v = cfg.get(key, top.get(key, default))
        return default if v is None else v

    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"{where}: topk_method {cfg['topk_method']!r} is not supported (expected 'noaux_tc')")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"{where}: scoring_func {cfg['scoring_func']!r} is not supported (expected 'sigmoid')")
    if cfg.get("rope_interleave", True) is not True:
        raise ValueError(f"{where}: rope_interleave false is not supported (DeepSeek/Kimi checkpoints use "
                         f"interleaved rope pairs)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (expected 'silu')")
    if cfg.get("attention_bias", False):
        raise ValueError(f"{where}: attention_bias true is not supported")

    # Rope: real Kimi/DeepSeek files use rope_theta + rope_scaling; transformers 5 writes rope_parameters.
    rope = dict(cfg.get("rope_scaling") or {})
    if cfg.get("rope_parameters"):
        rope = {**cfg["rope_parameters"], **rope}
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{where}: required field 'rope_theta' is missing (neither rope_theta nor "
                         f"rope_parameters.rope_theta)")
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"{where}: rope_scaling type {rope_type!r} is not supported (expected 'yarn' or none)")
    yarn = {}
    if rope_type == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if rope.get(key) is None:
                raise ValueError(f"{where}: rope_scaling.{key} is missing (required for yarn)")
        yarn = dict(rope_factor=float(rope["factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                    # transformers' documented defaults for these optional yarn fields
                    beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                    mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                    rope_attention_factor=rope.get("attention_factor"))

    quant = None
    qcfg = top.get("quantization_config") or cfg.get("quantization_config")   # top level first, as vLLM
    if qcfg:
        quant = QuantArgs.from_config(qcfg, where)

    q_lora = need("q_lora_rank")
    n_heads = need("num_attention_heads")
    args = ModelArgs(
        vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"), moe_intermediate_size=need("moe_intermediate_size"),
        num_hidden_layers=need("num_hidden_layers"), num_attention_heads=n_heads,
        q_lora_rank=q_lora, kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"),
        n_routed_experts=need("n_routed_experts"), num_experts_per_tok=need("num_experts_per_tok"),
        n_shared_experts=need("n_shared_experts"), first_k_dense_replace=need("first_k_dense_replace"),
        moe_layer_freq=cfg.get("moe_layer_freq", 1),   # absent in transformers' config class: 1 = every layer
        n_group=need("n_group"), topk_group=need("topk_group"), norm_topk_prob=need("norm_topk_prob"),
        routed_scaling_factor=float(need("routed_scaling_factor")), rms_norm_eps=float(need("rms_norm_eps")),
        rope_theta=float(theta), max_position_embeddings=need("max_position_embeddings"), rope_type=rope_type,
        tie_word_embeddings=bool(opt("tie_word_embeddings", False)),
        bos_token_id=opt("bos_token_id", None), eos_token_id=opt("eos_token_id", None),
        pad_token_id=opt("pad_token_id", None), quant=quant, nested=nested, **yarn)
    if args.n_routed_experts % args.n_group or args.num_experts_per_tok > args.n_routed_experts:
        raise ValueError(f"{where}: n_routed_experts={args.n_routed_experts} must be divisible by "
                         f"n_group={args.n_group} and >= num_experts_per_tok={args.num_experts_per_tok}")
    if args.qk_rope_head_dim % 2:
        raise ValueError(f"{where}: qk_rope_head_dim={args.qk_rope_head_dim} must be even")
    return args


def check_tp_divisibility(args: ModelArgs, ws: int) -> None:
    """Fail before loading anything if the world size cannot split the model evenly."""
    gs = args.quant.group_size if args.quant else 1
    checks = [("num_attention_heads", args.num_attention_heads, 1), ("vocab_size", args.vocab_size, 1),
              ("intermediate_size", args.intermediate_size, 1),
              ("moe_intermediate_size", args.moe_intermediate_size, gs),
              ("moe_intermediate_size*n_shared_experts", args.moe_intermediate_size * args.n_shared_experts, 1)]
    for name, value, unit in checks:
        if value % (ws * unit):
            extra = f" x group_size {unit}" if unit > 1 else ""
            raise ValueError(f"tensor parallel size {ws} does not divide {name}={value}{extra}")


# ----------------------------------------------------------------------------------------------
# Layers. Each weight carries `shard_dim` (0: split output rows, 1: split input columns, None: replicated)
# so load_checkpoint can read only this rank's slice.


class Linear(nn.Module):
    """y = x W^T; `shard_dim` says how tensor parallelism splits W (column- or row-parallel)."""

    def __init__(self, in_features: int, out_features: int, shard_dim: int | None = None):
        super().__init__()
        part_out = out_features // world_size if shard_dim == 0 else out_features
        part_in = in_features // world_size if shard_dim == 1 else in_features
        self.weight = nn.Parameter(torch.empty(part_out, part_in))   # [out/ws?, in/ws?]
        self.weight.shard_dim = shard_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def ColumnParallelLinear(i: int, o: int) -> Linear:
    return Linear(i, o, shard_dim=0)


def RowParallelLinear(i: int, o: int) -> Linear:
    """Row-parallel: each rank holds a slice of the input columns; the caller all-reduces the partial sums."""
    return Linear(i, o, shard_dim=1)


def share_rows(*linears: Linear, name: str = "weight") -> torch.Tensor:
    """Put the weights (name="bias": the biases) of Linears that read the same input (MLA's q_a and kv_a; an MLP's
    gate and up) into one [sum of out, in] tensor, returned: each Linear's weight becomes a view of its row block,
    so parameter names, in-place loading and TP slicing stay as they were, while linear_rows computes every output
    in one GEMM (one launch, one pass over the weights; H200, T = 9: q_a + kv_a 18.8 -> 13.2 µs, shared gate + up
    27.4 -> 21.2). Writes in place keep the sharing; .to() / .cuda() give every parameter a new tensor, so the
    modules that share rows (SharesRows) call this again from _apply. linear_rows checks it
    (load_state_dict(assign=True) would break it)."""
    w = torch.cat([getattr(lin, name).detach() for lin in linears])             # [sum out, in] (bias: [sum out])
    row = 0
    for lin in linears:
        old = getattr(lin, name)
        new = nn.Parameter(w[row:row + old.shape[0]], requires_grad=old.requires_grad)
        new.shard_dim = old.shard_dim
        setattr(lin, name, new)
        row += old.shape[0]
    return w


class SharesRows(nn.Module):
    """A module whose Linears share one weight tensor (share_rows). ROW_GROUPS: attribute of the shared tensor ->
    names of its Linears; share() builds them, and _apply builds them again after .to() / .cuda(). Linears with
    biases (a drafter's attention_bias) share them the same way: attribute "..._bias" (else None)."""
    ROW_GROUPS: dict[str, tuple[str, ...]] = {}

    def share(self) -> None:
        for attr, names in self.ROW_GROUPS.items():
            linears = [getattr(self, n) for n in names]
            setattr(self, attr, share_rows(*linears))
            biased = getattr(linears[0], "bias", None) is not None
            setattr(self, attr.replace("_weight", "_bias"), share_rows(*linears, name="bias") if biased else None)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.share()
        return self


def linear_rows(x: torch.Tensor, w: torch.Tensor, *linears: Linear, split: bool = True,
                bias: torch.Tensor | None = None):
    """Each Linear's output, from one GEMM over their shared weight w and bias (see share_rows); split=False: the
    one [..., sum of out] output. When autograd wants the parameters' gradients (train.py), each Linear runs on its
    own: w is not part of the autograd graph."""
    if torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in linears):
        ys = tuple(lin(x) for lin in linears)
        return ys if split else torch.cat(ys, dim=-1)
    if not torch.compiler.is_compiling():
        row_bytes, row = w.stride(0) * w.element_size(), 0
        for lin in linears:            # pointer arithmetic, not w[row]: no view made per call on the eager hot path
            if lin.weight.data_ptr() != w.data_ptr() + row * row_bytes:
                raise RuntimeError("a Linear's weight no longer lives in its share_rows tensor (a parameter was "
                                   "replaced, e.g. by load_state_dict(assign=True)): load in place instead")
            row += lin.weight.shape[0]
    y = F.linear(x, w, bias)
    return y.split([lin.weight.shape[0] for lin in linears], dim=-1) if split else y


def fused(device) -> bool:
    """Use the small Triton glue kernels (norms, rope, routing, SwiGLU): on a GPU, outside torch.compile (inductor
    fuses the PyTorch forms by itself, and re-generating user kernels from their source is fragile), and only where
    the model serves: not while autograd records (the kernels have no backward; their PyTorch twins do) nor under
    autocast (train.py's bf16 autocast hands them bf16 activations with fp32 rope tables and weights)."""
    kind = torch.device(device).type
    return (kernels.use_triton(device) and not torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled(kind))


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(g) * u: one launch on a GPU (kernels.silu_mul), two PyTorch ops elsewhere."""
    return (kernels.silu_mul if fused(g.device) else kernels.silu_mul_ref)(g, u)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight.shard_dim = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one Triton launch on a GPU; under torch.compile the PyTorch form, which inductor fuses by itself
        if fused(x.device):
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.rms_norm_ref(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + r, self(x + r)): a residual add and this norm, in one launch on a GPU."""
        fn = kernels.add_rms_norm if fused(x.device) else kernels.add_rms_norm_ref
        return fn(x, r, self.weight, self.eps)


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
        outside = (local < 0) | (local >= self.part)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(y)                      # each token's row lives on exactly one rank
        return y


# ----------------------------------------------------------------------------------------------
# Rotary embedding: YaRN frequencies exactly as transformers computes them, applied to interleaved
# pairs (x[2i], x[2i+1]) as the DeepSeek/Kimi checkpoints expect.


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [rope_dim/2] fp32, attention_factor applied to cos/sin)."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))   # [dim/2]
    if args.rope_type != "yarn":
        return freq, 1.0
    factor, L0 = args.rope_factor, args.original_max_position_embeddings

    def corr_dim(rot: float) -> float:   # frequency index that completes `rot` turns over L0 positions
        return dim * math.log(L0 / (rot * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(corr_dim(args.beta_fast)), 0)
    high = min(math.ceil(corr_dim(args.beta_slow)), dim - 1)
    if low == high:
        high += 0.001                    # avoid a division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                      # 1: keep the original (high) frequency; 0: interpolate by factor
    inv_freq = (freq / factor) * (1 - keep) + freq * keep
    af = args.rope_attention_factor
    if af is None:
        if args.mscale and args.mscale_all_dim:
            af = yarn_mscale(factor, args.mscale) / yarn_mscale(factor, args.mscale_all_dim)
        else:
            af = yarn_mscale(factor)
    return inv_freq, float(af)


def rope_cos_sin(inv_freq: torch.Tensor, attn_factor: float, positions: torch.Tensor, dtype,
                 interleaved: bool = True) -> tuple:
    """positions [B, T] -> cos, sin [B, T, rope_dim] laid out for apply_rope: (cos, cos) and (-sin, +sin) of each
    pair's angle, per adjacent pair (interleaved, K2) or as halves (the drafter's Qwen3 rope). Computed in fp32,
    cast like transformers; once per forward, for every layer."""
    ang = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)   # [B, T, dim/2]
    cos, sin = ang.cos(), ang.sin()
    if attn_factor != 1.0:
        cos, sin = cos * attn_factor, sin * attn_factor
    cos, sin = cos.to(dtype), sin.to(dtype)
    if interleaved:
        return torch.stack((cos, cos), dim=-1).flatten(-2), torch.stack((-sin, sin), dim=-1).flatten(-2)
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate the pairs (x1, x2) of x [B, T, (H,) P] - adjacent (x[2i], x[2i+1]) when interleaved, else
    (x[i], x[i + P/2]) - by the angles in cos/sin [B, T, P] from rope_cos_sin: x * (cos, cos) + (x2, x1) *
    (-sin, sin) = (x1 cos - x2 sin, x2 cos + x1 sin), bit for bit (the sign sits in sin): four elementwise ops
    (kernels.rope_ref), or on a GPU one launch (kernels.rope, equal to within one rounding)."""
    P = x.shape[-1]
    if fused(x.device) and P & (P - 1) == 0:
        return kernels.rope(x, cos, sin, interleaved=interleaved)
    return kernels.rope_ref(x, cos, sin, interleaved=interleaved)


# ----------------------------------------------------------------------------------------------
# MLA attention


class MLA(SharesRows):
    """Multi-head latent attention. Cache per token: kv_a_layernorm(c_kv) [R] | rope(k_pe) [P], shared by heads."""
    ROW_GROUPS = {"q_kv_a_weight": ("q_a_proj", "kv_a_proj_with_mqa")}     # both read x: one GEMM

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads // world_size          # local heads
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        self.q_a_proj = Linear(args.hidden_size, args.q_lora_rank)
        self.q_a_layernorm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(args.q_lora_rank, args.num_attention_heads * args.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(args.hidden_size, args.kv_lora_rank + args.qk_rope_head_dim)
        self.share()                             # q_kv_a_weight [q_lora + R + P, D], replicated
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, args.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(args.kv_lora_rank,
                                              args.num_attention_heads * (args.qk_nope_head_dim + args.v_head_dim))
        self.o_proj = RowParallelLinear(args.num_attention_heads * args.v_head_dim, args.hidden_size)
        self.softmax_scale = args.qk_head_dim ** -0.5
        if args.rope_type == "yarn" and args.mscale_all_dim:
            # transformers: the YaRN mscale enters the softmax scale squared (q and k each carry one factor)
            self.softmax_scale *= yarn_mscale(args.rope_factor, args.mscale_all_dim) ** 2
        # the Triton paths tile the latent (R) and rope (P) widths with power-of-two blocks; tl.dot wants >= 16
        pow2 = lambda n, least: n >= least and n & (n - 1) == 0
        self.latent_kernel_fits = pow2(self.kv_lora_rank, 2) and pow2(self.rope, 2)
        self.attn_kernel_fits = pow2(self.kv_lora_rank, 16) and pow2(self.rope, 16)

    def forward(self, x, cos, sin, cache=None, start_pos=None, tree_mask=None, absorb=False, slots=None):
        """x [B, T, D]. cache: this layer's [Bmax, S, R+P] slice or None (no cache: causal attention over x).
        start_pos: int or LongTensor [B] = slot of the first new token. tree_mask [B, T, T] bool or None (causal);
        the absorbed path also takes it packed, [B, T] int64 (kernels.tree_mask_bits).
        slots [B, T]: the new tokens' cache slots, start_pos + [0, T) (Transformer computes them once)."""
        B, T, _ = x.shape
        q_a, kv = linear_rows(x, self.q_kv_a_weight, self.q_a_proj, self.kv_a_proj_with_mqa)  # [B, T, q_lora], [B, T, R+P]
        q = self.q_b_proj(self.q_a_layernorm(q_a)).view(B, T, self.n_heads, -1)                # [B, T, H, nope+rope]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)

        if cache is None:
            c_kv, k_pe = kv.split([self.kv_lora_rank, self.rope], dim=-1)
            latent = torch.cat([self.kv_a_layernorm(c_kv), apply_rope(k_pe, cos, sin)], dim=-1)   # [B, T, R+P]
            mask = tree_mask if tree_mask is not None else _causal(T, x.device).expand(B, T, T)
            o = self._naive(q_nope, q_pe, latent, mask)
        else:
            if slots is None:
                slots = _slots(start_pos, B, T, x.device)                                      # [B, T]
            # the new rows of the compressed cache: kv_a_layernorm(c_kv) | rope(k_pe), written at their slots
            fused_write = fused(x.device) and self.latent_kernel_fits
            write = kernels.mla_latent_to_cache if fused_write else kernels.mla_latent_to_cache_ref
            write(kv, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cos, sin, cache, slots)
            if tree_mask is None:
                tree_mask = _causal(T, x.device).expand(B, T, T)
            if absorb:
                o = self._absorbed(q_nope, q_pe, cache[:B], start_pos, tree_mask)
            else:
                if not isinstance(start_pos, int):
                    raise ValueError("the naive MLA path needs an int start_pos (prefill); use absorb=True")
                keys = cache[:B, :start_pos + T]                                                # [B, S, R+P]
                mask = torch.cat([torch.ones(B, T, start_pos, dtype=torch.bool, device=x.device), tree_mask], -1)
                o = self._naive(q_nope, q_pe, keys, mask)
        y = self.o_proj(o.flatten(2))
        if world_size > 1:
            dist.all_reduce(y)                  # o_proj is row-parallel: sum the heads' partial outputs
        return y

    def _wkv_b(self):
        return self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)  # [H, nope+v, R]

    def _naive(self, q_nope, q_pe, keys, mask):
        """Decompress every key's latent into per-head k_nope and v (prefill: compute-bound, T large)."""
        B, S, _ = keys.shape
        c_kv, k_pe = keys.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c_kv).view(B, S, self.n_heads, self.nope + self.v_dim)             # [B, S, H, nope+v]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.n_heads, -1)], dim=-1)   # [B, S, H, qk]
        q = torch.cat([q_nope, q_pe], dim=-1)                                                  # [B, T, H, qk]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask.unsqueeze(1), scale=self.softmax_scale)
        return o.transpose(1, 2)                                                               # [B, T, H, v]

    def _absorbed(self, q_nope, q_pe, cache, start_pos, tree_mask):
        """Absorb W_UK into the query and W_UV into the output: attend over the R+P cached values per token
        (decode / verify: memory-bound, reads only the compressed cache)."""
        B, T = q_nope.shape[:2]
        wkv_b = self._wkv_b()
        q_lat = torch.einsum("bthd,hdr->bthr", q_nope, wkv_b[:, :self.nope])     # [B, T, H, R] (a permuted view)
        prefix = start_pos
        if isinstance(start_pos, int):
            prefix = torch.full((B,), start_pos, dtype=torch.long, device=q_nope.device)      # [B]
        # the kernel packs each query's tree mask into one 64-bit word (T <= 64, i.e. budget <= 63) and
        # tiles R and P with power-of-two blocks; it reads only the live slots of the full cache itself
        if kernels.use_triton(q_nope.device) and T <= kernels.MASK_WORD_BITS and self.attn_kernel_fits:
            o_lat = kernels.mla_tree_attention(q_lat, q_pe.contiguous(), cache, prefix, tree_mask.contiguous(),
                                               self.softmax_scale)
        else:
            if isinstance(start_pos, int):
                cache = cache[:, :start_pos + T]     # eager reference: read only the live part
            o_lat = kernels.mla_tree_attention_ref(q_lat, q_pe, cache, prefix, tree_mask, self.softmax_scale)
        # o = einsum("bthr,hdr->bthd", o_lat, W_UV) as one batched GEMM per head written straight into [B, T, H, v]
        # rows, so o_proj reads it without the copy that flattening the einsum's [H, B*T, v] result costs
        o = torch.empty(B, T, self.n_heads, self.v_dim, dtype=o_lat.dtype, device=o_lat.device)     # [B, T, H, v]
        torch.bmm(o_lat.reshape(B * T, self.n_heads, -1).transpose(0, 1), wkv_b[:, self.nope:].transpose(1, 2),
                  out=o.view(B * T, self.n_heads, self.v_dim).transpose(0, 1))
        return o


def _causal(T: int, device) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()                          # [T, T]


def _slots(start_pos, B: int, T: int, device) -> torch.Tensor:
    ar = torch.arange(T, device=device)
    if isinstance(start_pos, int):
        return (start_pos + ar).repeat(B, 1)          # [B, T], contiguous (the cache-write kernel indexes it flat)
    return start_pos.view(B, 1) + ar                                                           # [B, T]


# ----------------------------------------------------------------------------------------------
# Feed-forward: dense SwiGLU MLP, noaux_tc router, routed experts (INT4 or float), shared experts


class MLP(SharesRows):
    """SwiGLU MLP, tensor-parallel (gate/up column, down row). Returns this rank's partial sum: the
    caller all-reduces (so MoE can add routed + shared before one all-reduce)."""
    ROW_GROUPS = {"gate_up_weight": ("gate_proj", "up_proj")}

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(dim, inter)
        self.up_proj = ColumnParallelLinear(dim, inter)
        self.down_proj = RowParallelLinear(inter, dim)
        self.share()                             # gate_up_weight [2 inter/ws, dim]

    def forward(self, x):
        return self.down_proj(silu_mul(*linear_rows(x, self.gate_up_weight, self.gate_proj, self.up_proj)))


class DenseMLP(MLP):
    def forward(self, x):
        y = super().forward(x)
        if world_size > 1:
            dist.all_reduce(y)
        return y


class Gate(nn.Module):
    """noaux_tc router: sigmoid scores (fp32), bias only for selection, optional group-limited top-k."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = args.num_experts_per_tok, args.n_group, args.topk_group
        self.norm, self.scale = args.norm_topk_prob, args.routed_scaling_factor
        # [E, D] in fp32 whatever the model dtype: the scores are computed in fp32 (as the reference does), so
        # the bf16 checkpoint weight is upcast once at load instead of being converted again on every step
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size, dtype=torch.float32))
        self.weight.shard_dim = None
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts, dtype=torch.float32))
        self.e_score_correction_bias.shard_dim = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k])"""
        # x @ W^T in fp32, sigmoid, + bias, top-k, gather, renormalize, scale: two launches on a GPU (the router
        # matmul in slices, then routing); K2.6 has one expert group
        route = kernels.router_topk if fused(x.device) and self.n_group == 1 else kernels.router_topk_ref
        return route(x, self.weight, self.e_score_correction_bias, self.top_k, self.norm, self.scale, self.n_group,
                     self.topk_group)


class Experts(nn.Module):
    """Routed experts stacked per layer. INT4: w13_packed [E, 2I/ws, D/8] int32 (gate rows then up rows),
    w13_scale [E, 2I/ws, D/gs], w2_packed [E, D, I/ws/8], w2_scale [E, D, I/ws/gs]; never dequantized as a
    whole. Float checkpoints: w13 [E, 2I/ws, D], w2 [E, D, I/ws]. Tensor-parallel inside every expert (each
    rank holds all experts, a slice of the intermediate dim): at one request this balances the bytes each
    rank reads (performance.md §6.6), where expert-parallel leaves the busiest rank reading 1.3-2.6x more.
    Measured (`bench.py moe-split --tp 8`, K2.6 shapes, one H200, CUDA graphs, 2026-11-29): the routed experts
    of one layer take 87 / 443 / 677 / 1142 us at T = 1 / 9 / 17 / 33 tokens split this way, against 191 / 588 /
    920 / 1336 us for the busiest rank under expert parallelism (48 whole experts per rank); both with the same
    earlier fused_moe_w4a16 (since replaced by the GEMV path), so the ratio is the point, not the microseconds."""

    def __init__(self, args: ModelArgs, quant: QuantArgs | None):
        super().__init__()
        E, D, inter = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size // world_size
        self.inter, self.quant = inter, quant
        if quant:
            gs = quant.group_size
            sdt = torch.get_default_dtype()
            self.w13_packed = nn.Parameter(torch.empty(E, 2 * inter, D // 8, dtype=torch.int32), requires_grad=False)
            self.w13_scale = nn.Parameter(torch.empty(E, 2 * inter, D // gs, dtype=sdt), requires_grad=False)
            self.w2_packed = nn.Parameter(torch.empty(E, D, inter // 8, dtype=torch.int32), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(E, D, inter // gs, dtype=sdt), requires_grad=False)
        else:
            self.w13 = nn.Parameter(torch.empty(E, 2 * inter, D))                              # [E, 2I/ws, D]
            self.w2 = nn.Parameter(torch.empty(E, D, inter))                                   # [E, D, I/ws]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """x [N, D], weights/ids [N, k], shared [N, D] (the shared experts' output) -> Σ_k w_k expert_k(x) + shared,
        [N, D] fp32 (this rank's partial sum). The INT4 kernel adds `shared` where it sums the pairs."""
        if self.quant:
            fn = kernels.fused_moe_w4a16 if kernels.use_triton(x.device) else kernels.fused_moe_w4a16_ref
            return fn(x, ids, weights, self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale,
                      self.quant.group_size, shared=shared)
        return experts_float_ref(x, ids, weights, self.w13, self.w2) + shared.float()


def experts_float_ref(x, ids, weights, w13, w2) -> torch.Tensor:
    """Float experts w13 [E, 2I, D], w2 [E, D, I] (the INT4 twin dequantizes instead); fp32 accumulation."""
    return kernels.experts_ref(x, ids, weights, lambda e: (w13[e], w2[e]))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Gate(args)
        self.experts = Experts(args, args.quant)
        self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, ids = self.gate(x)
        y = self.experts(x, w, ids, shared=self.shared_experts(x))          # routed + shared experts, fp32
        if world_size > 1:
            dist.all_reduce(y)                  # one all-reduce per MoE layer: routed + shared summed first
        return y.to(x.dtype).view(shape)


class Block(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.self_attn = MLA(args)
        self.mlp = MoE(args) if args.is_moe_layer(layer_id) else DenseMLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache, start_pos, tree_mask, absorb, slots=None):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, start_pos, tree_mask, absorb, slots)
        x, h = self.post_attention_layernorm.add(x, attn)                  # x + attn and its norm, one launch
        return x + self.mlp(h)


# Below this many new tokens the cache path uses absorbed MLA (decode, verify: memory-bound); above it,
# naive MLA (prefill: decompressing K/V once beats absorbing every head's query).
ABSORB_MAX_T = 64


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        check_tp_divisibility(args, world_size)
        self.args = args
        self.embed_tokens = ParallelEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = ColumnParallelLinear(args.hidden_size, args.vocab_size)   # vocab-parallel
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        inv_freq, self.rope_attn_factor = rope_inv_freq(args)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.kv_cache = None    # [n_layers, Bmax, S, R+P], allocated by setup_cache

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        a, p = self.args, self.embed_tokens.weight
        self.kv_cache = torch.zeros(a.num_hidden_layers, max_batch_size, max_seq_len,
                                    a.kv_lora_rank + a.qk_rope_head_dim, dtype=p.dtype, device=p.device)

    @property
    def max_seq_len(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.shape[2]

    def forward(self, tokens: torch.Tensor, start_pos=None, positions=None, tree_mask=None,
                hidden_layers=(), absorb=None, last_only: bool = False, debug: bool = False, cache_row: int = 0):
        """tokens [B, T] -> logits [B, T, vocab] fp32 (or [B, 1, vocab] with last_only).

        start_pos None: no cache; causal attention over `tokens` (or `tree_mask`).
        start_pos int / LongTensor [B]: the new tokens go to cache slots start_pos + [0, T); they see every
          slot before start_pos and, among themselves, what tree_mask [B, T, T] bool allows (default causal;
          or its rows packed, [B, T] int64 as kernels.tree_mask_bits makes them).
        positions [B, T]: rope positions (default start_pos + arange(T); tree verify passes start + depth).
        hidden_layers: return also the outputs of these layers, concatenated: [B, T, len * hidden_size].
        cache_row: the batch uses cache rows cache_row .. cache_row+B-1 (prefilling one sequence of a batch).
        """
        B, T = tokens.shape
        slots = None if start_pos is None else _slots(start_pos, B, T, tokens.device)       # [B, T]
        if positions is None:
            positions = _slots(0, B, T, tokens.device) if slots is None else slots
        if start_pos is not None:
            if self.kv_cache is None:
                raise RuntimeError("call setup_cache(max_batch_size, max_seq_len) before a cached forward")
            if isinstance(start_pos, int) and start_pos + T > self.max_seq_len:
                raise ValueError(f"cache overflow: start_pos {start_pos} + {T} tokens > max_seq_len {self.max_seq_len}")
        if absorb is None:
            # decode and tree verify (any width) take the absorbed path, so every budget rounds like decoding
            # does; so does a tensor start_pos (graph-captured steps: fixed shapes). Long prefills go naive.
            absorb = start_pos is not None and (T <= ABSORB_MAX_T or tree_mask is not None
                                                or not isinstance(start_pos, int))
        if tree_mask is None:      # causal; built once here rather than in every layer
            tree_mask = _causal(T, tokens.device).expand(B, T, T)
        packed = tree_mask.dtype == torch.int64      # rows packed by the GPU tree search (tree.Tree.mask_bits)
        if absorb and T <= kernels.MASK_WORD_BITS and not packed:   # absorbed attention takes each row packed in
            tree_mask = kernels.tree_mask_bits(tree_mask)           # a word: pack once  [B, T] int64
        elif packed and not absorb:                                 # the naive path wants the bool mask
            tree_mask = kernels.tree_mask_unpack(tree_mask)                                 # [B, T, T] bool
        h = self.embed_tokens(tokens)                                                       # [B, T, D]
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_attn_factor, positions, h.dtype)
        taps = []
        for i, layer in enumerate(self.layers):
            cache = None if start_pos is None else self.kv_cache[i, cache_row:]
            h = layer(h, cos, sin, cache, start_pos, tree_mask, absorb, slots)
            if debug:
                check_finite(h, f"layer {i} output")
            if i in hidden_layers:
                taps.append(h)
        if last_only:
            h = h[:, -1:]
        logits = self.head(self.norm(h))
        if debug:
            check_finite(logits, "logits")
        if hidden_layers:
            return logits, torch.cat(taps, dim=-1)
        return logits

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Normalized hidden states [..., D] -> fp32 logits [..., vocab] in global vocabulary order
        (the drafter shares this lm_head)."""
        logits = self.lm_head(h).float()
        if world_size > 1:
            parts = [torch.empty_like(logits) for _ in range(world_size)]
            dist.all_gather(parts, logits)      # vocab-parallel lm_head: each rank holds V/ws columns
            logits = torch.cat(parts, dim=-1)
        return logits


def check_finite(t: torch.Tensor, where: str) -> None:
    """Debug check: report the first place where NaN/inf appears."""
    if not torch.isfinite(t).all():
        raise FloatingPointError(f"non-finite values (NaN/inf) first seen in {where}")


# ----------------------------------------------------------------------------------------------
# Checkpoint loading: HF safetensors, single file or sharded index; `model.` (K2) or
# `language_model.model.` / `language_model.lm_head` (K2.5/K2.6) prefixes; vision tensors skipped;
# every parameter loaded exactly once, sliced to this rank with safetensors' get_slice.

_SKIP_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "visual.")
_EXPERT_RE = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                        r"(weight|weight_packed|weight_scale|weight_shape)$")


class CheckpointError(ValueError):
    pass


def _normalize(name: str) -> str | None:
    """Checkpoint tensor name -> our parameter name (None: skip)."""
    if name.startswith(_SKIP_PREFIXES):
        return None
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    if name.startswith("model."):
        name = name[len("model."):]
    return name


def _shard_files(ckpt_dir: str) -> dict[str, list[str]]:
    """file -> tensor names, from model.safetensors.index.json or the single model.safetensors."""
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        for fname in files:
            if not os.path.exists(os.path.join(ckpt_dir, fname)):
                raise CheckpointError(f"{index} names shard {fname}, which does not exist in {ckpt_dir}")
        return files
    single = os.path.join(ckpt_dir, "model.safetensors")
    if os.path.exists(single):
        return {"model.safetensors": None}
    raise CheckpointError(f"{ckpt_dir}: no model.safetensors.index.json and no model.safetensors")


def _rank_slice(sl, full_shape, dim: int | None, ws: int, r: int):
    if dim is None or ws == 1:
        return sl[:]
    n = full_shape[dim] // ws
    idx = [slice(None)] * len(full_shape)
    idx[dim] = slice(r * n, (r + 1) * n)
    return sl[tuple(idx)]


def _expert_dest(model: Transformer, layer: int, e: int, proj: str, kind: str):
    """Where one expert tensor goes: (dest view, shard_dim along the checkpoint tensor, expected full shape)."""
    args = model.args
    if not (0 <= layer < args.num_hidden_layers) or not args.is_moe_layer(layer) or e >= args.n_routed_experts:
        return None
    ex = model.layers[layer].mlp.experts
    D, I, n = args.hidden_size, args.moe_intermediate_size, ex.inter
    gs = ex.quant.group_size if ex.quant else None
    o, i_ = (I, D) if proj != "down_proj" else (D, I)
    rows = slice(0, n) if proj == "gate_proj" else slice(n, 2 * n)
    if kind == "weight_shape":
        return "shape", None, (o, i_)
    if ex.quant is None:
        if kind != "weight":
            return None
        return (ex.w13[e, rows] if proj != "down_proj" else ex.w2[e]), (0 if proj != "down_proj" else 1), (o, i_)
    if kind == "weight_packed":
        full = (o, i_ // 8)
        return (ex.w13_packed[e, rows] if proj != "down_proj" else ex.w2_packed[e]), (0 if proj != "down_proj" else 1), full
    if kind == "weight_scale":
        full = (o, i_ // gs)
        return (ex.w13_scale[e, rows] if proj != "down_proj" else ex.w2_scale[e]), (0 if proj != "down_proj" else 1), full
    return None


def _check_dtype(name, fname, got: torch.dtype, want: torch.dtype):
    ok = (got == want) if not want.is_floating_point else got.is_floating_point
    if not ok:
        raise CheckpointError(f"tensor {name} in {fname} has dtype {got}, expected {want}")


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
           "I64": torch.int64, "I8": torch.int8, "U8": torch.uint8, "F64": torch.float64, "I16": torch.int16,
           "BOOL": torch.bool}


@torch.no_grad()
def load_checkpoint(model: Transformer, ckpt_dir: str, progress: bool = False) -> dict:
    """Load this rank's slices of every parameter from an HF safetensors checkpoint. Returns stats
    (bytes read by this rank, seconds, peak host RSS)."""
    from safetensors import safe_open
    files = _shard_files(ckpt_dir)
    params = dict(model.named_parameters())
    expected = {k for k, p in params.items() if not (model.args.tie_word_embeddings and k == "lm_head.weight")}
    expected = {k for k in expected if ".experts." not in k}
    loaded: set[str] = set()
    expert_needed = _expected_expert_tensors(model)
    expert_loaded: set[str] = set()
    nbytes, t0 = 0, time.time()
    for n_done, (fname, names) in enumerate(sorted(files.items()), 1):
        path = os.path.join(ckpt_dir, fname)
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read as safetensors ({e})") from None
        with f:
            file_names = set(f.keys())
            for name in (names if names is not None else file_names):
                if name not in file_names:
                    raise CheckpointError(f"index says tensor {name} is in {fname}, but the file does not hold it")
                key = _normalize(name)
                if key is None:
                    continue
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                dtype = _DTYPES.get(sl.get_dtype())
                layer = re.match(r"layers\.(\d+)\.", key)
                if layer and int(layer[1]) >= model.args.num_hidden_layers:
                    continue    # multi-token-prediction layers past num_hidden_layers: not used here
                m = _EXPERT_RE.fullmatch(key)
                if m:
                    nbytes += _load_expert(model, m, sl, shape, dtype, name, fname, expert_loaded)
                    continue
                if key not in params:
                    raise CheckpointError(f"unexpected tensor {name} in {fname} (no such parameter)")
                p = params[key]
                if key in loaded:
                    raise CheckpointError(f"tensor {name} appears twice (again in {fname})")
                _check_dtype(name, fname, dtype, p.dtype)
                sd = getattr(p, "shard_dim", None)
                full = list(p.shape)
                if sd is not None:
                    full[sd] *= world_size
                if shape != tuple(full):
                    raise CheckpointError(f"tensor {name} in {fname} has shape {list(shape)}, expected {full}")
                t = _rank_slice(sl, shape, sd, world_size, rank)
                nbytes += t.numel() * t.element_size()
                p.copy_(t)
                loaded.add(key)
        if progress and rank == 0:
            print(f"\rloading {ckpt_dir}: shard {n_done}/{len(files)}, {nbytes / 1e9:.2f} GB read",
                  end="", file=sys.stderr, flush=True)
    if progress and rank == 0:
        print(file=sys.stderr)
    missing = sorted(expected - loaded) + sorted(expert_needed - expert_loaded)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{ckpt_dir}: missing tensors {missing[:5]}{more}")
    return {"bytes_read": nbytes, "seconds": time.time() - t0, "peak_rss_bytes": peak_rss_bytes()}


def _expected_expert_tensors(model: Transformer) -> set[str]:
    args = model.args
    kinds = ("weight_packed", "weight_scale") if args.quant else ("weight",)
    return {f"layers.{l}.mlp.experts.{e}.{p}.{k}" for l in range(args.num_hidden_layers) if args.is_moe_layer(l)
            for e in range(args.n_routed_experts) for p in ("gate_proj", "up_proj", "down_proj") for k in kinds}


def _load_expert(model, m, sl, shape, dtype, name, fname, loaded: set) -> int:
    layer, e, proj, kind = int(m[1]), int(m[2]), m[3], m[4]
    dest = _expert_dest(model, layer, e, proj, kind)
    if dest is None:
        if model.args.quant is None and kind != "weight":
            raise CheckpointError(f"tensor {name} in {fname} is quantized, but config.json has no "
                                  f"quantization_config")
        if model.args.quant is not None and kind == "weight":
            raise CheckpointError(f"tensor {name} in {fname} is unquantized, but quantization_config "
                                  f"expects weight_packed/weight_scale")
        raise CheckpointError(f"unexpected tensor {name} in {fname}")
    view, sd, full = dest
    key = m[0]
    if key in loaded:
        raise CheckpointError(f"tensor {name} appears twice (again in {fname})")
    if view == "shape":
        got = tuple(int(v) for v in sl[:].tolist())
        if got != tuple(full):
            raise CheckpointError(f"tensor {name} in {fname}: weight_shape {list(got)} does not match the "
                                  f"config, expected {list(full)}")
        return 0
    want = view.dtype
    _check_dtype(name, fname, dtype, want)
    if shape != tuple(full):
        what = {"weight_packed": " (int32 words of 8 int4 values)",
                "weight_scale": f" (one scale per group of {model.args.quant.group_size if model.args.quant else 0})"}
        raise CheckpointError(f"tensor {name} in {fname} has shape {list(shape)}, expected {list(full)}"
                              f"{what.get(kind, '')}")
    t = _rank_slice(sl, shape, sd, world_size, rank)
    view.copy_(t)
    loaded.add(key)
    return t.numel() * t.element_size()


def peak_rss_bytes() -> int:
    """Peak resident host memory of this process. VmHWM, not ru_maxrss: a forked child (torchrun ranks,
    test subprocesses) inherits its parent's ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ----------------------------------------------------------------------------------------------
# Checkpoint writing in the exact K2.6 layout (tests and the bundled tiny model).


def k26_config(text_config: dict, quant_group_size: int | None = 32) -> dict:
    """Wrap a DeepSeek-V3 text config the way K2.5/K2.6 ship it (nested kimi_k25, compressed-tensors INT4)."""
    text = dict(text_config, model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": text, "vision_config": {"patch_size": 14, "vt_hidden_size": 16},
           "bos_token_id": text.get("bos_token_id"), "eos_token_id": text.get("eos_token_id"),
           "pad_token_id": text.get("pad_token_id"), "tie_word_embeddings": False}
    if quant_group_size:
        q = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                 "group_size": quant_group_size, "dynamic": False, "actorder": None, "block_structure": None,
                 "observer": "minmax"}, "input_activations": None, "output_activations": None}},
             "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
             "kv_cache_scheme": None}
        cfg["quantization_config"] = q
        text["quantization_config"] = q
    return cfg


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group INT4 on Kimi's QAT grid (scale = absmax / 7, q in [-7, 7]).
    w [O, I] -> (q int8 [O, I], scale [O, I/group_size] in w's dtype)."""
    O, I = w.shape
    g = w.float().view(O, I // group_size, group_size)
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-8)                                           # [O, I/gs]
    q = torch.round(g / scale.unsqueeze(-1)).clamp(-7, 7).to(torch.int8).view(O, I)
    return q, scale.to(w.dtype)


def save_checkpoint(state: dict[str, torch.Tensor], config: dict, out_dir: str, n_shards: int = 3,
                    vision: bool = True, prefix: str = "language_model.") -> None:
    """Write HF-style tensors `state` (names like 'model.layers.1.mlp.experts.0.up_proj.weight', float
    experts) in the K2.6 layout: routed experts pack-quantized when config has quantization_config,
    `language_model.` prefix, a few vision tensors, `n_shards` shards + model.safetensors.index.json."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    qcfg = config.get("quantization_config")
    gs = qcfg["config_groups"]["group_0"]["weights"]["group_size"] if qcfg else None
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _EXPERT_RE.search(name)
        if qcfg and m and m[4] == "weight":
            q, scale = t if isinstance(t, tuple) else quantize_int4(t, gs)
            base = name[:-len("weight")]
            out[prefix + base + "weight_packed"] = kernels.pack_int4(q).contiguous()
            out[prefix + base + "weight_scale"] = scale.contiguous()
            out[prefix + base + "weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int32)
        else:
            out[prefix + name] = t.contiguous()
    if vision:   # present in real K2.6 files; the text engine must skip them
        out["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2).to(torch.bfloat16)
        out["mm_projector.proj.0.weight"] = torch.randn(8, 8).to(torch.bfloat16)
    names = sorted(out)
    shards = [names[i::n_shards] for i in range(n_shards)]
    weight_map, total = {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{n_shards:06d}.safetensors"    # K2.6 uses a 6-digit total
        save_file({n: out[n] for n in shard}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for n in shard:
            weight_map[n] = fname
            total += out[n].numel() * out[n].element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our (TP=1) parameters under HF names ('model.layers.N...', 'lm_head.weight'), experts unstacked
    (dequantized to float if INT4). Inverse of load_checkpoint; used by export and tests."""
    assert world_size == 1, "hf_state_dict is for a single-rank model"
    out = {}
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        out[("lm_head.weight" if name == "lm_head.weight" else "model." + name)] = p.detach()
    for l, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, MoE):
            continue
        ex = layer.mlp.experts
        for e in range(model.args.n_routed_experts):
            if ex.quant:
                w13 = kernels.dequant_int4_ref(ex.w13_packed[e], ex.w13_scale[e], ex.quant.group_size)
                w2 = kernels.dequant_int4_ref(ex.w2_packed[e], ex.w2_scale[e], ex.quant.group_size)
            else:
                w13, w2 = ex.w13[e].detach(), ex.w2[e].detach()
            base = f"model.layers.{l}.mlp.experts.{e}."
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = w13.chunk(2, dim=0)
            out[base + "down_proj.weight"] = w2
    return out
