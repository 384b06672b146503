"""Checkpoint formats of the Kimi K2.6 / DeepSeek-V3 target, apart from the model's math (model.py).

Reads:
  * config.json: flat (model_type kimi_k2 / deepseek_v3) or nested as K2.5 / K2.6 ship it (kimi_k25 with a
    text_config), with the routed experts' compressed-tensors `pack-quantized` quantization_config (INT4,
    symmetric, one scale per group) -> model.ModelArgs;
  * HF safetensors: one model.safetensors or shards + model.safetensors.index.json; tensor names under `model.`
    (K2) or `language_model.model.` / `language_model.lm_head` (K2.5 / K2.6); vision tensors and
    multi-token-prediction layers are skipped; routed experts as weight_packed / weight_scale / weight_shape (INT4)
    or weight (float), stacked into model.Experts without ever being dequantized.
Writes: the same K2.6 layout (k26_config, save_checkpoint, quantize_int4, pack_int4; hf_state_dict is the loader's
inverse), for the tests and the bundled tiny model.
Random (no checkpoint): `random:k2.6` / `random:tiny` (and their `-dflash` drafters) name Kimi K2.6's configs, real
size or shrunk; random_model / random_drafter build them on each rank's device in the per-rank layout and fill
them with seeded random values that do not depend on the TP size (randomize_).

Invariant: load_checkpoint fills every parameter of a model exactly once, with this rank's tensor-parallel slice
(read with safetensors' get_slice, so a rank never holds the whole checkpoint), or raises CheckpointError naming
the tensor and its file (a missing, unexpected, duplicate, misshapen, mistyped or non-finite tensor).

Tests: python -m pytest -q tests/test_model.py tests/test_int4_checkpoint.py tests/test_random.py
"""
from __future__ import annotations

import json
import math
import os
import re
import resource
import sys
import time
import zlib

import torch

import model as M


class CheckpointError(ValueError):
    pass


def check_dir(path: str) -> None:
    """The first check on a checkpoint path, before anything reads from it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")


# ----------------------------------------------------------------------------------------------
# config.json -> ModelArgs


def read_config(path_or_dict, name: str = "config") -> tuple[dict, str]:
    """A config dict, or a checkpoint dir / config.json path -> (dict, where) for error messages."""
    if isinstance(path_or_dict, dict):
        return path_or_dict, name
    if is_random(path_or_dict):
        return random_config(path_or_dict), path_or_dict
    where = str(path_or_dict)
    check_dir(where)
    if os.path.isdir(where):
        where = os.path.join(where, "config.json")
    if not os.path.exists(where):
        raise FileNotFoundError(f"{where}: config.json not found")
    try:
        with open(where) as f:
            return json.load(f), where
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None


def quant_args(q: dict, where: str) -> M.QuantArgs:
    """compressed-tensors quantization_config -> QuantArgs; only what K2-Thinking / K2.5 / K2.6 use is accepted:
    pack-quantized INT4, symmetric, per group, weights only."""
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
    # Which modules are quantized is not read from targets / ignore: the tensors say it (weight_packed only
    # where model.Experts expects it; any other quantized tensor is an error in load_checkpoint).
    return M.QuantArgs(group_size=gs)


_TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


def model_args(path_or_dict) -> M.ModelArgs:
    """Read a flat kimi_k2 / deepseek_v3 config or a nested kimi_k25 (K2.5 / K2.6) one (a dict, a checkpoint
    directory or its config.json)."""
    cfg, where = read_config(path_or_dict, "config")
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

    qcfg = top.get("quantization_config") or cfg.get("quantization_config")   # top level first, as vLLM
    args = M.ModelArgs(
        vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"), moe_intermediate_size=need("moe_intermediate_size"),
        num_hidden_layers=need("num_hidden_layers"), num_attention_heads=need("num_attention_heads"),
        q_lora_rank=need("q_lora_rank"), kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"),
        n_routed_experts=need("n_routed_experts"), num_experts_per_tok=need("num_experts_per_tok"),
        n_shared_experts=need("n_shared_experts"), first_k_dense_replace=need("first_k_dense_replace"),
        moe_layer_freq=cfg.get("moe_layer_freq", 1),   # absent in transformers' config class: 1 = every layer
        n_group=need("n_group"), topk_group=need("topk_group"), norm_topk_prob=need("norm_topk_prob"),
        routed_scaling_factor=float(need("routed_scaling_factor")), rms_norm_eps=float(need("rms_norm_eps")),
        rope_theta=float(theta), max_position_embeddings=need("max_position_embeddings"), rope_type=rope_type,
        tie_word_embeddings=bool(opt("tie_word_embeddings", False)),
        bos_token_id=opt("bos_token_id", None), eos_token_id=opt("eos_token_id", None),
        pad_token_id=opt("pad_token_id", None), quant=quant_args(qcfg, where) if qcfg else None, nested=nested,
        **yarn)
    if args.n_routed_experts % args.n_group or args.num_experts_per_tok > args.n_routed_experts:
        raise ValueError(f"{where}: n_routed_experts={args.n_routed_experts} must be divisible by "
                         f"n_group={args.n_group} and >= num_experts_per_tok={args.num_experts_per_tok}")
    if args.qk_rope_head_dim % 2:
        raise ValueError(f"{where}: qk_rope_head_dim={args.qk_rope_head_dim} must be even")
    return args


# ----------------------------------------------------------------------------------------------
# Loading: every parameter exactly once, sliced to this rank.

_SKIP_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "visual.")
EXPERT_RE = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
                       r"(weight|weight_packed|weight_scale|weight_shape)$")
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
          "I64": torch.int64, "I8": torch.int8, "U8": torch.uint8, "F64": torch.float64, "I16": torch.int16,
          "BOOL": torch.bool}


def _normalize(name: str) -> str | None:
    """Checkpoint tensor name -> our parameter name (None: skip)."""
    if name.startswith(_SKIP_PREFIXES):
        return None
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    if name.startswith("model."):
        name = name[len("model."):]
    return name


def shard_files(ckpt_dir: str) -> dict[str, list[str] | None]:
    """file -> tensor names, from model.safetensors.index.json, or {"model.safetensors": None} (every tensor)."""
    check_dir(ckpt_dir)
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


def rank_slice(sl, full_shape, dim: int | None, ws: int, r: int) -> torch.Tensor:
    """Rank r's 1/ws of a safetensors slice along dim (None: the whole tensor)."""
    if dim is None or ws == 1:
        return sl[:]
    n = full_shape[dim] // ws
    idx = [slice(None)] * len(full_shape)
    idx[dim] = slice(r * n, (r + 1) * n)
    return sl[tuple(idx)]


def packed_parts(name: str, p: torch.Tensor) -> list[tuple[str, slice]]:
    """The checkpoint tensors parameter `name` holds, [(checkpoint name, the rows of p that hold this rank's slice
    of it)]: one per part of a stacked model.Linear (weight.parts, in order, each split by TP on its own), else
    [(name, all rows)]."""
    parts = getattr(p, "parts", None)
    if not parts:
        return [(name, slice(None))]
    module, leaf = name.rsplit(".", 1)
    parent = module.rpartition(".")[0]
    ws = sum(parts.values()) // p.shape[0]           # the TP size p was built at (1 if its rows are not split)
    out, row = [], 0
    for part, rows in parts.items():
        out.append((f"{parent}.{part}.{leaf}".lstrip("."), slice(row, row + rows // ws)))
        row += rows // ws
    return out


def checkpoint_slots(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int | None]]:
    """checkpoint tensor name -> (where this rank's slice of it goes: a parameter or a row block of a stacked one,
    the dim TP splits it on), for every parameter of module"""
    return {key: (p[rows], getattr(p, "shard_dim", None))
            for name, p in module.named_parameters() for key, rows in packed_parts(name, p)}


def checkpoint_tensors(module: torch.nn.Module, state: dict | None = None) -> dict[str, torch.Tensor]:
    """state (default: module's parameters) with each stacked parameter of module split into the checkpoint tensors
    it holds, under their names (world size 1: the writers' inverse of loading); other entries pass unchanged."""
    state = dict(module.named_parameters() if state is None else state)
    for name, p in module.named_parameters():
        if getattr(p, "parts", None) and name in state:
            t = state.pop(name)
            state.update((key, t[rows]) for key, rows in packed_parts(name, p))
    return state


def _check_dtype(name, fname, got: torch.dtype, want: torch.dtype):
    ok = (got == want) if not want.is_floating_point else (got is not None and got.is_floating_point)
    if not ok:
        raise CheckpointError(f"tensor {name} in {fname} has dtype {got}, expected {want}")


def build(make, device, dtype: torch.dtype):
    """make() with `device` and `dtype` as the defaults: the module is allocated where it runs, in its final dtype
    (no fp32 copy of the weights, nothing on the host first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(old)


def load_model(ckpt: str, device, dtype: torch.dtype, progress: bool = True) -> M.Transformer:
    """Build the target directly on `device` in `dtype` (its config checked against the TP size first) and load it.
    ckpt `random:<name>`: random_model instead."""
    if is_random(ckpt):
        return random_model(ckpt, device, dtype)
    args = model_args(ckpt)
    M.check_tp_divisibility(args, M.world_size)
    model = build(lambda: M.Transformer(args), device, dtype)
    load_checkpoint(model, ckpt, progress=progress)
    return model.eval()


def load_drafter(path: str, target_args: M.ModelArgs, device, dtype: torch.dtype):
    """draft.load_drafter(path, ...), or random_drafter for a `random:<name>-dflash` path."""
    import draft as Dr     # draft.py imports this module
    return (random_drafter if is_random(path) else Dr.load_drafter)(path, target_args, device, dtype)


@torch.no_grad()
def load_checkpoint(model: M.Transformer, ckpt_dir: str, progress: bool = False, check_finite: bool = True) -> dict:
    """Load this rank's slices of every parameter from an HF safetensors checkpoint. check_finite: no floating
    tensor may hold NaN / inf (checked once over the loaded parameters, one host sync; then the culprit is
    named). Returns stats (bytes read by this rank, seconds, peak host RSS)."""
    from safetensors import safe_open
    files = shard_files(ckpt_dir)
    params = dict(model.named_parameters())
    slots = {k: s for k, s in checkpoint_slots(model).items() if ".experts." not in k}   # name -> (dest, shard dim)
    expected = {k for k in slots if not (model.args.tie_word_embeddings and k == "lm_head.weight")}
    loaded: set[str] = set()
    expert_needed = _expected_expert_tensors(model)
    expert_loaded: set[str] = set()
    written = []    # (name, file, where it landed) of every floating tensor, to name a non-finite one
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
                dtype = DTYPES.get(sl.get_dtype())
                layer = re.match(r"layers\.(\d+)\.", key)
                if layer and int(layer[1]) >= model.args.num_hidden_layers:
                    continue    # multi-token-prediction layers past num_hidden_layers: not used here
                m = EXPERT_RE.fullmatch(key)
                if m:
                    dest = _load_expert(model, m, sl, shape, dtype, name, fname, expert_loaded)
                else:
                    dest = _load_param(slots, loaded, key, sl, shape, dtype, name, fname)
                if dest is None:
                    continue
                nbytes += dest.numel() * dtype.itemsize          # this rank's slice, as stored in the file
                if check_finite and dest.is_floating_point():
                    written.append((name, fname, dest))
        if progress and M.rank == 0:
            print(f"\rloading {ckpt_dir}: shard {n_done}/{len(files)}, {nbytes / 1e9:.2f} GB read",
                  end="", file=sys.stderr, flush=True)
    if progress and M.rank == 0:
        print(file=sys.stderr)
    missing = sorted(expected - loaded) + sorted(expert_needed - expert_loaded)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"{ckpt_dir}: missing tensors {missing[:5]}{more}")
    if check_finite:
        _check_finite([p for p in params.values() if p.is_floating_point()], written)
    return {"bytes_read": nbytes, "seconds": time.time() - t0, "peak_rss_bytes": peak_rss_bytes()}


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: no NaN / inf in t. min and max propagate NaN and show an inf, and make no temporary as
    large as t (host memory while loading stays at the parameters' own size)."""
    return torch.isfinite(torch.stack(torch.aminmax(t))).all() if t.numel() else torch.tensor(True, device=t.device)


def _check_finite(params: list[torch.Tensor], written: list) -> None:
    """One pass over the whole parameters (a few launches per parameter, not per checkpoint tensor: K2.6 has
    ~10^5 expert scales); only if it fails, the tensors written are searched for the first bad one."""
    if params and not torch.stack([_all_finite(p) for p in params]).all():
        name, fname = next((n, f) for n, f, dest in written if not _all_finite(dest))
        raise CheckpointError(f"tensor {name} in {fname} holds NaN or inf")


def _load_param(slots, loaded: set, key, sl, shape, dtype, name, fname) -> torch.Tensor:
    """A non-expert tensor: checked against its slot (checkpoint_slots), this rank's slice copied in. Returns the
    slot."""
    if key not in slots:
        raise CheckpointError(f"unexpected tensor {name} in {fname} (no such parameter)")
    dest, sd = slots[key]
    if key in loaded:
        raise CheckpointError(f"tensor {name} appears twice (again in {fname})")
    _check_dtype(name, fname, dtype, dest.dtype)
    full = list(dest.shape)
    if sd is not None:
        full[sd] *= M.world_size
    if shape != tuple(full):
        raise CheckpointError(f"tensor {name} in {fname} has shape {list(shape)}, expected {full}")
    dest.copy_(rank_slice(sl, shape, sd, M.world_size, M.rank))
    loaded.add(key)
    return dest


def _expected_expert_tensors(model: M.Transformer) -> set[str]:
    args = model.args
    kinds = ("weight_packed", "weight_scale") if args.quant else ("weight",)
    return {f"layers.{l}.mlp.experts.{e}.{p}.{k}" for l in range(args.num_hidden_layers) if args.is_moe_layer(l)
            for e in range(args.n_routed_experts) for p in ("gate_proj", "up_proj", "down_proj") for k in kinds}


def _expert_dest(model: M.Transformer, layer: int, e: int, proj: str, kind: str):
    """Where one expert tensor goes: (dest view, shard_dim along the checkpoint tensor, expected full shape)."""
    args = model.args
    if not (0 <= layer < args.num_hidden_layers) or not args.is_moe_layer(layer) or e >= args.n_routed_experts:
        return None
    ex = model.layers[layer].mlp.experts
    D, I, n = args.hidden_size, args.moe_intermediate_size, ex.inter
    gs = ex.quant.group_size if ex.quant else None
    o, i_ = (I, D) if proj != "down_proj" else (D, I)
    rows = slice(0, n) if proj == "gate_proj" else slice(n, 2 * n)      # gate rows, then up rows of w13
    sd = 0 if proj != "down_proj" else 1
    if kind == "weight_shape":
        return "shape", None, (o, i_)
    if ex.quant is None:
        if kind != "weight":
            return None
        return (ex.w13[e, rows] if proj != "down_proj" else ex.w2[e]), sd, (o, i_)
    if kind == "weight_packed":
        return (ex.w13_packed[e, rows] if proj != "down_proj" else ex.w2_packed[e]), sd, (o, i_ // 8)
    if kind == "weight_scale":
        return (ex.w13_scale[e, rows] if proj != "down_proj" else ex.w2_scale[e]), sd, (o, i_ // gs)
    return None


def _load_expert(model, m, sl, shape, dtype, name, fname, loaded: set) -> torch.Tensor | None:
    """One routed-expert tensor into its row block of the stacked experts. Returns the view written (None for
    weight_shape, which is only checked against the config)."""
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
        return None
    _check_dtype(name, fname, dtype, view.dtype)
    if shape != tuple(full):
        what = {"weight_packed": " (int32 words of 8 int4 values)",
                "weight_scale": f" (one scale per group of {model.args.quant.group_size if model.args.quant else 0})"}
        raise CheckpointError(f"tensor {name} in {fname} has shape {list(shape)}, expected {list(full)}"
                              f"{what.get(kind, '')}")
    view.copy_(rank_slice(sl, shape, sd, M.world_size, M.rank))
    loaded.add(key)
    return view


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
# Writing in the exact K2.6 layout (tests and the bundled tiny model).


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


_SHIFTS = tuple(range(0, 32, 4))  # nibble i of a word sits at bit 4i


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values q [..., I] in [-8, 7] -> [..., I/8] int32 words: model.unpack_int4's inverse (the bit order is
    described there)."""
    assert q.dtype == torch.int8 and q.shape[-1] % 8 == 0, f"want int8 [..., I], I % 8 == 0: {q.dtype} {tuple(q.shape)}"
    assert -8 <= q.min() and q.max() <= 7, "int4 values must lie in [-8, 7]"
    u = (q.long() + 8).view(*q.shape[:-1], -1, 8)                  # [..., I/8, 8], nibble values 0..15
    shifts = torch.tensor(_SHIFTS, dtype=torch.long, device=q.device)
    words = (u << shifts).sum(-1)                                    # disjoint bits, so sum == OR; 0 .. 2^32-1
    words = torch.where(words >= 2**31, words - 2**32, words)        # reinterpret as signed int32 (top bit = sign)
    return words.to(torch.int32)


def save_checkpoint(state: dict[str, torch.Tensor], config: dict, out_dir: str, n_shards: int = 3,
                    vision: bool = True, prefix: str = "language_model.") -> None:
    """Write HF-style tensors `state` (names like 'model.layers.1.mlp.experts.0.up_proj.weight', float
    experts, or (q int8, scale) pairs) in the K2.6 layout: routed experts pack-quantized when config has
    quantization_config, `language_model.` prefix, a few vision tensors, `n_shards` shards + index."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    qcfg = config.get("quantization_config")
    gs = qcfg["config_groups"]["group_0"]["weights"]["group_size"] if qcfg else None
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = EXPERT_RE.search(name)
        if qcfg and m and m[4] == "weight":
            q, scale = t if isinstance(t, tuple) else quantize_int4(t, gs)
            base = name[:-len("weight")]
            out[prefix + base + "weight_packed"] = pack_int4(q).contiguous()
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


def hf_state_dict(model: M.Transformer, int4: bool = False) -> dict[str, torch.Tensor | tuple]:
    """Our (TP=1) parameters under HF names ('model.layers.N...', 'lm_head.weight'), experts unstacked
    (dequantized to float if INT4; int4=True: as the (q int8, scale) pairs they hold, which save_checkpoint writes
    back word for word). Inverse of load_checkpoint; used by export and tests."""
    assert M.world_size == 1, "hf_state_dict is for a single-rank model"
    out = {}
    for name, p in checkpoint_tensors(model).items():
        if ".experts." in name:
            continue
        out[("lm_head.weight" if name == "lm_head.weight" else "model." + name)] = p.detach()
    for l, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, M.MoE):
            continue
        ex = layer.mlp.experts
        for e in range(model.args.n_routed_experts):
            base = f"model.layers.{l}.mlp.experts.{e}."
            if ex.quant and int4:
                q13, s13, n = M.unpack_int4(ex.w13_packed[e]), ex.w13_scale[e], ex.inter
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = (q13[:n], s13[:n]), (q13[n:], s13[n:])
                out[base + "down_proj.weight"] = (M.unpack_int4(ex.w2_packed[e]), ex.w2_scale[e])
                continue
            if ex.quant:
                w13 = M.dequant_int4(ex.w13_packed[e], ex.w13_scale[e], ex.quant.group_size)
                w2 = M.dequant_int4(ex.w2_packed[e], ex.w2_scale[e], ex.quant.group_size)
            else:
                w13, w2 = ex.w13[e].detach(), ex.w2[e].detach()
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = w13.chunk(2, dim=0)
            out[base + "down_proj.weight"] = w2
    return out


# ----------------------------------------------------------------------------------------------
# Kimi K2.6's shapes with random weights, no checkpoint: `--ckpt random:k2.6` (bench.py e2e, generate.py) builds
# the whole 61-layer model and its 6-layer DFlash drafter on each rank's device, in the per-rank layout that
# load_checkpoint fills. Step times mean something; acceptance does not.


def k26_text_config(scale: str) -> dict:
    """Kimi K2.6's text config; scale 'tiny' shrinks every dimension
    (and keeps them divisible by TP 8 and the INT4 group of 32)."""
    cfg = dict(model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
               moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
               q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
               moe_layer_freq=1, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
               norm_topk_prob=True, routed_scaling_factor=2.827, rms_norm_eps=1e-5, rope_theta=50000.0,
               rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
               max_position_embeddings=262144, tie_word_embeddings=False, bos_token_id=163584,
               eos_token_id=163585, hidden_act="silu", attention_bias=False)
    if scale == "tiny":
        cfg.update(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                   num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=64,
                   qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16,
                   num_experts_per_tok=2, bos_token_id=0, eos_token_id=1)
    return cfg


def k26_draft_config(scale: str) -> dict:
    """The Kimi K2.6 DFlash drafter's config; 'tiny' shrinks it for CPU smoke tests."""
    cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=7168, intermediate_size=18432,
               num_hidden_layers=6, num_attention_heads=64, num_key_value_heads=8, head_dim=128, hidden_act="silu",
               rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=262144, attention_bias=False,
               rope_scaling=dict(rope_type="yarn", factor=64.0, original_max_position_embeddings=4096,
                                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
               vocab_size=163840, tie_word_embeddings=False, block_size=8, num_target_layers=61,
               dflash_config=dict(mask_token_id=163838, target_layer_ids=[1, 12, 24, 35, 47, 58]))
    if scale == "tiny":
        cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=32,
                   vocab_size=1024, dflash_config=dict(mask_token_id=1022, target_layer_ids=[1, 12, 24, 35, 47, 58]))
    return cfg


RANDOM_MODELS = {            # name -> its config.json, as the checkpoint would ship it (INT4 routed experts)
    "random:k2.6": lambda: k26_config(k26_text_config("real")),
    "random:k2.6-dflash": lambda: k26_draft_config("real"),
    "random:tiny": lambda: k26_config(k26_text_config("tiny")),
    "random:tiny-dflash": lambda: k26_draft_config("tiny"),
}


def is_random(path) -> bool:
    """A `random:<name>` model instead of a checkpoint directory."""
    return isinstance(path, str) and path.startswith("random:")


def random_config(name: str) -> dict:
    if name not in RANDOM_MODELS:
        raise ValueError(f"{name}: no such random model (expected one of {', '.join(RANDOM_MODELS)})")
    return RANDOM_MODELS[name]()


def random_model(config, device, dtype: torch.dtype, seed: int = 0) -> M.Transformer:
    """The target of `config` (a random:<name>, or any config model_args reads) built on `device` in `dtype` at this
    rank's TP coordinates, every parameter filled by randomize_: the tensors load_checkpoint would fill, random."""
    args = model_args(config)
    M.check_tp_divisibility(args, M.world_size)
    model = build(lambda: M.Transformer(args), device, dtype)
    randomize_(model, seed)
    return model.eval()


def random_drafter(config, target_args: M.ModelArgs | None, device, dtype: torch.dtype, seed: int = 0):
    """The DFlash drafter of `config` (random:<name>-dflash or a drafter config), as draft.load_drafter builds it,
    filled by randomize_ (its names prefixed 'draft.', so no drafter weight repeats a target weight)."""
    import draft as Dr     # draft.py imports this module
    args = Dr.DraftArgs.from_config(config)
    if target_args is not None:
        Dr.check_compatible(args, target_args)
    drafter = build(lambda: Dr.DFlashDrafter(args), device, dtype)    # checks the TP divisibility first
    randomize_(drafter, seed, prefix="draft.")
    return drafter.eval()


class IdTokenizer:
    """What generate.py decodes a random model's output with: no tokenizer covers its ids, so each id reads as
    <id>, and prompts come as token ids (--prompt-ids)."""
    vocab_size = 0              # no ids of its own: any model's ids decode
    stop_ids = frozenset()

    def decode_bytes(self, ids) -> bytes:
        return "".join(f"<{i}>" for i in ids).encode()

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode()

    def encode(self, text: str, *args, **kw) -> list[int]:
        raise ValueError("a random:<name> model has no tokenizer: give the prompt as --prompt-ids")

    apply_chat_template = encode


_INT4_SQUARE = 21.5   # mean of q^2 over the 16 INT4 values q in [-8, 7]: a random word's nibbles


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int = 0, prefix: str = "") -> None:
    """Fill every parameter in place: RMSNorm gains 1, biases 0 (the router's correction bias too), INT4 experts
    random words (every nibble equally likely) with scales around 1 / sqrt(21.5 in_features), every other weight
    uniform with variance 1 / in_features (activations keep their scale through the 61 layers).

    Each element is a function of (seed, prefix + checkpoint tensor name, its index in the full, unsharded tensor), a
    32-bit hash, never of a generator's position: a rank fills only its own slice (module built at model.world_size
    and model.rank), and every TP size holds the same model (TP=N logits == TP=1 logits)."""
    params = dict(module.named_parameters())
    for name, p in params.items():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        if name.endswith("bias"):
            p.zero_()
            continue
        for part, block in packed_parts(name, p):        # a stacked Linear: each checkpoint tensor on its own
            view, full, sd = _sharding(part, p[block], getattr(p, "shard_dim", None))
            key = zlib.crc32(f"{seed}:{prefix}{part}".encode())
            if p.dtype == torch.int32:                       # packed INT4 words, as signed int32
                value = lambda h: torch.where(h >= 2**31, h - 2**32, h)
            elif name.endswith("_scale"):
                packed = params[name[:-len("scale")] + "packed"]
                n_in = _sharding(name, packed, None)[1][-1] * 8
                s = (_INT4_SQUARE * n_in) ** -0.5
                value = lambda h, s=s: _uniform(h, 0.5 * s, 1.5 * s)
            else:
                a = 3 ** 0.5 * full[-1] ** -0.5               # uniform on [-a, a]: variance 1 / in_features
                value = lambda h, a=a: _uniform(h, -a, a)
            for rows, h in _element_hashes(view, full, sd, key):
                view[rows].copy_(value(h))


def _sharding(name: str, p: torch.Tensor, sd: int | None) -> tuple[torch.Tensor, tuple, int | None]:
    """(a view of p, the full shape, the split dim): p as this rank's slice of one unsharded tensor, the one the
    checkpoint stores (sd: the dim TP splits it on). The stacked experts' w13* hold each expert's gate rows then up
    rows, each split by rows: [E, 2n, X] is viewed as [E, 2, n, X] and split on dim 2; w2* [E, D, X] are split by
    columns."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("w13", "w13_packed", "w13_scale"):
        E, n2, X = p.shape
        return p.view(E, 2, n2 // 2, X), (E, 2, n2 // 2 * M.world_size, X), 2
    if leaf in ("w2", "w2_packed", "w2_scale"):
        E, D, X = p.shape
        return p, (E, D, X * M.world_size), 2
    full = list(p.shape)
    if sd is not None:
        full[sd] *= M.world_size
    return p, tuple(full), sd


def _element_hashes(view: torch.Tensor, full: tuple, sd: int | None, key: int, chunk: int = 2**24):
    """(rows of view, a 32-bit hash of each of their elements' index in the full tensor xor key), a chunk of at most
    `chunk` elements at a time (bounded temporaries at K2.6 size), on view's device."""
    if math.prod(full) >= 2**32:
        raise ValueError(f"a {list(full)} tensor has more elements than the 32-bit index that randomize_ hashes")
    step = max(1, chunk // max(1, math.prod(view.shape[1:])))
    for start in range(0, view.shape[0], step):
        rows = slice(start, min(start + step, view.shape[0]))
        idx, stride = torch.zeros((), dtype=torch.int64, device=view.device), 1
        for d in reversed(range(view.dim())):          # row-major index in the full tensor, built per dim
            n = rows.stop - rows.start if d == 0 else view.shape[d]
            first = (rows.start if d == 0 else 0) + (M.rank * view.shape[d] if d == sd else 0)
            pos = torch.arange(first, first + n, device=view.device)                      # [n]
            idx = idx + (pos * stride).view(-1, *[1] * (view.dim() - 1 - d))
            stride *= full[d]
        yield rows, _hash32(idx ^ key)                                                    # [rows, ...] int64


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds, constants from Chris Wellons' hash-prospector): int64 in
    [0, 2^32) -> int64 in [0, 2^32). Both multipliers are below 2^31, so no int64 product overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def _uniform(h: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """A hash's top 24 bits -> fp32 in (lo, hi)."""
    return ((h >> 8).float() + 0.5) * ((hi - lo) * 2.0**-24) + lo
