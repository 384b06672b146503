"""Checkpoint formats of the Kimi K2.6 / DeepSeek-V3 target and of its DFlash drafter, apart from the models'
math (model.py, draft.py).

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
The DFlash drafter's files, in the public z-lab layout: its config.json (draft_args, checked against the target:
check_drafter_compatible), its safetensors (load_drafter) and both written (write_drafter, tiny_draft_config).
Random (no checkpoint): `random:k2.6` / `random:tiny` (and their `-dflash` drafters) name Kimi K2.6's configs, real
size or shrunk; random_model / random_drafter build them on each rank's device in the per-rank layout and fill
them with seeded random values that do not depend on the TP size (randomize_).

Invariant: load_checkpoint fills every parameter of a model exactly once, with this rank's tensor-parallel slice
(read with safetensors' get_slice, so a rank never holds the whole checkpoint), or raises CheckpointError naming
the tensor and its file (a missing, unexpected, duplicate, misshapen, mistyped or non-finite tensor). Every config
value is checked for its type and range where it is read (Fields), and load_model checks the config against the
tensors present (check_checkpoint: names, dtypes, shapes) before it allocates anything.

Tests: python -m pytest -q tests/test_model.py tests/test_int4_checkpoint.py tests/test_random.py tests/test_faults.py
"""
from __future__ import annotations

import json
import math
import os
import re
import resource
import sys
import time
import types
import zlib

import torch

import draft as Dr
import model as M
from files import json_kind, read_json, regular_file, replacing, write_json


class CheckpointError(ValueError):
    pass


def check_dir(path: str) -> None:
    """The first check on a checkpoint path, before anything reads from it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")


# ----------------------------------------------------------------------------------------------
# Config values are checked where they are read, by one helper (Fields): a bad value is one error naming the
# file, the field and what was expected, never a NaN, a traceback or a guess.


_REQUIRED = object()
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38   # the compute dtype's range


def _show(value) -> str:
    """A config value as its file spells it (true, null), numbers and strings as Python prints them, cut short."""
    r = json.dumps(value) if isinstance(value, bool) or value is None else repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


class Fields:
    """The fields of one JSON object of a config file, each read with its type and range checked:

        f = Fields(cfg, "ckpt/config.json")
        f.int("num_hidden_layers")                      # required, an integer >= 1
        f.number("rms_norm_eps", above=0, below=1)      # required, a finite number in (0, 1)
        f.sub("rope_scaling").number("factor", 1.0)     # an optional object; a field with a default

    A bad value raises ValueError "<file>: field <dotted.path> = <value>: expected <what>". A field set to null
    reads as absent (HF configs write null for "unset"); a default is returned as it is, unchecked."""

    def __init__(self, obj, where: str, path: str = ""):
        if not isinstance(obj, dict):
            what = f"field {path}" if path else "the file"
            raise ValueError(f"{where}: {what} must be a JSON object, got {json_kind(obj)}")
        self.obj, self.where, self.path = obj, where, path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def bad(self, key: str, value, expected: str) -> ValueError:
        return ValueError(f"{self.where}: field {self.name(key)} = {_show(value)}: expected {expected}")

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def get(self, key: str, default=_REQUIRED):
        """The raw value (any type), or default when absent; absent and required: an error."""
        if self.has(key):
            return self.obj[key]
        if default is _REQUIRED:
            raise ValueError(f"{self.where}: field {self.name(key)} is missing (required)")
        return default

    def int(self, key: str, default=_REQUIRED, min: int = 1, max: int | None = None, why: str = ""):
        """An integer in [min, max] (bool and 8.0 are not integers)."""
        if not self.has(key):
            return self.get(key, default)
        v = self.obj[key]
        if type(v) is not int or v < min or (max is not None and v > max):
            rng = f">= {min}" if max is None else f"in [{min}, {max}]"
            raise self.bad(key, v, f"an integer {rng}" + (f" ({why})" if why else ""))
        return v

    def number(self, key: str, default=_REQUIRED, min: float | None = None, above: float | None = None,
               below: float | None = None, why: str = "") -> float:
        """A finite number (an integer or a float, finite in float32 too: the values enter fp32 math), at least
        min / more than above / less than below."""
        if not self.has(key):
            return self.get(key, default)
        v = self.obj[key]
        ok = isinstance(v, (int, float)) and type(v) is not bool and math.isfinite(v) and abs(v) <= FLOAT32_MAX
        ok = ok and (min is None or v >= min) and (above is None or v > above) and (below is None or v < below)
        if not ok:
            rng = " and ".join(s for s in (min is not None and f">= {min:g}", above is not None and f"> {above:g}",
                                           below is not None and f"< {below:g}") if s)
            raise self.bad(key, v, "a finite number" + (f" {rng}" if rng else "") + (f" ({why})" if why else ""))
        return float(v)

    def flag(self, key: str, default=_REQUIRED) -> bool:
        if not self.has(key):
            return self.get(key, default)
        if type(self.obj[key]) is not bool:
            raise self.bad(key, self.obj[key], "true or false")
        return self.obj[key]

    def choice(self, key: str, choices: tuple, default=_REQUIRED, why: str = ""):
        """One of `choices` (compared with their type: 1 is not true)."""
        if not self.has(key):
            return self.get(key, default)
        v = self.obj[key]
        if not any(type(v) is type(c) and v == c for c in choices):
            want = " or ".join(json.dumps(c) if isinstance(c, bool) else repr(c) for c in choices)
            raise ValueError(f"{self.where}: field {self.name(key)} = {_show(v)} is not supported (expected "
                             f"{want}{'; ' + why if why else ''})")
        return v

    def sub(self, key: str, required: bool = False) -> "Fields":
        """A nested object (an empty one when absent and not required)."""
        return Fields(self.get(key, _REQUIRED if required else {}), self.where, self.name(key))

    def ints(self, key: str, default=_REQUIRED, min: int = 0) -> list[int]:
        """A non-empty list of integers >= min."""
        if not self.has(key):
            return self.get(key, default)
        v = self.obj[key]
        if not isinstance(v, list) or not v or any(type(i) is not int or i < min for i in v):
            raise self.bad(key, v, f"a non-empty list of integers >= {min}")
        return v

    def token_ids(self, key: str, vocab_size: int):
        """null, a token id or a list of them, each in [0, vocab_size)."""
        v = self.get(key, None)
        ids = v if isinstance(v, list) else [v] if v is not None else []
        if any(type(i) is not int or not 0 <= i < vocab_size for i in ids):
            raise self.bad(key, v, f"a token id or a list of them, in [0, vocab_size = {vocab_size})")
        return v


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
    return read_json(where), where


def quant_args(q: Fields, hidden_size: int, moe_intermediate_size: int) -> M.QuantArgs:
    """compressed-tensors quantization_config -> QuantArgs; only what K2-Thinking / K2.5 / K2.6 use is accepted:
    pack-quantized INT4, symmetric, per group, weights only."""
    def bad(msg):
        return ValueError(f"{q.where}: quantization_config {msg}")
    if q.get("quant_method", None) != "compressed-tensors":
        raise bad(f"quant_method {q.get('quant_method', None)!r} is not supported (expected 'compressed-tensors')")
    if q.get("format", None) != "pack-quantized":
        raise bad(f"format {q.get('format', None)!r} is not supported (expected 'pack-quantized')")
    groups = q.sub("config_groups")
    if len(groups.obj) != 1:
        raise bad(f"config_groups has {len(groups.obj)} groups; exactly one is supported")
    g = groups.sub(next(iter(groups.obj)), required=True)
    w = g.sub("weights").obj
    # (key, required value, compressed-tensors' default when the key is absent)
    checks = [("num_bits", 4, None), ("type", "int", "int"), ("symmetric", True, True),
              ("strategy", "group", None), ("dynamic", False, False)]
    for key, want, default in checks:
        got = w.get(key, default)
        if type(got) is not type(want) or got != want:
            raise bad(f"weights.{key} = {w.get(key)!r} is not supported (expected {want!r})")
    # "group" act-order stores a g_idx permutation; "weight"/"static" reorder only during calibration
    if w.get("actorder") not in (None, False, "weight", "static"):
        raise bad(f"weights.actorder = {w.get('actorder')!r} is not supported (expected null)")
    if g.get("input_activations", None) or g.get("output_activations", None):
        raise bad("activation quantization is not supported (W4A16 only)")
    gs = w.get("group_size")
    if type(gs) is not int or gs <= 0 or gs % 8:
        raise bad(f"weights.group_size = {gs!r}; expected a positive multiple of 8")
    for name, dim in (("hidden_size", hidden_size), ("moe_intermediate_size", moe_intermediate_size)):
        if dim % gs:     # each expert's input columns come in whole groups
            raise bad(f"weights.group_size = {gs} does not divide {name} = {dim}")
    # Which modules are quantized is not read from targets / ignore: the tensors say it (weight_packed only
    # where model.Experts expects it; any other quantized tensor is an error in load_checkpoint).
    return M.QuantArgs(group_size=gs)


def rope_fields(f: Fields) -> tuple[Fields, float, str]:
    """Rope settings, as real Kimi/DeepSeek files write them (rope_theta + rope_scaling) or transformers 5
    (rope_parameters): (the scaling object's fields, rope_theta, rope type 'default' or 'yarn')."""
    scaling, params = f.sub("rope_scaling"), f.sub("rope_parameters")
    rope = Fields({**params.obj, **scaling.obj}, f.where, "rope_scaling" if scaling.obj else "rope_parameters")
    if not f.has("rope_theta") and not rope.has("rope_theta"):
        raise ValueError(f"{f.where}: field {f.name('rope_theta')} is missing (required; or "
                         f"rope_parameters.rope_theta)")
    # base > 1: the wavelengths grow with the dimension (and YaRN divides by log(base))
    theta = (f if f.has("rope_theta") else rope).number("rope_theta", above=1)
    kind = rope.choice("rope_type" if rope.has("rope_type") else "type", ("default", "yarn"), "default")
    return rope, theta, kind


def yarn_fields(rope: Fields) -> dict:
    """YaRN's fields (factor and original_max_position_embeddings required; the others have transformers'
    documented defaults) -> ModelArgs / DraftArgs keyword arguments."""
    return dict(rope_factor=rope.number("factor", min=1),
                original_max_position_embeddings=rope.int("original_max_position_embeddings"),
                beta_fast=rope.number("beta_fast", 32.0, above=0), beta_slow=rope.number("beta_slow", 1.0, above=0),
                rope_attention_factor=rope.number("attention_factor", None, above=0))


_TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")


def model_args(path_or_dict) -> M.ModelArgs:
    """Read a flat kimi_k2 / deepseek_v3 config or a nested kimi_k25 (K2.5 / K2.6) one (a dict, a checkpoint
    directory or its config.json), every field checked for its type and range."""
    cfg, where = read_config(path_or_dict, "config")
    top = Fields(cfg, where)
    nested = "text_config" in cfg
    f = top
    if nested:
        top.choice("model_type", ("kimi_k25",), None, why="a text_config is read only in a kimi_k25 wrapper")
        f = top.sub("text_config", required=True)
    f.choice("model_type", _TEXT_MODEL_TYPES, why="or a kimi_k25 wrapper with a text_config")
    f.choice("topk_method", ("noaux_tc",), "noaux_tc")
    f.choice("scoring_func", ("sigmoid",), "sigmoid")
    f.choice("hidden_act", ("silu",), "silu")
    f.choice("rope_interleave", (True,), True, why="DeepSeek/Kimi checkpoints use interleaved rope pairs")
    f.choice("attention_bias", (False,), False)
    either = lambda key: f if f.has(key) or not nested else top      # the text config's, else the wrapper's

    rope, theta, rope_type = rope_fields(f)
    yarn = {}
    if rope_type == "yarn":
        yarn = dict(yarn_fields(rope), mscale=rope.number("mscale", None, min=0),
                    mscale_all_dim=rope.number("mscale_all_dim", None, min=0))

    experts, groups = f.int("n_routed_experts"), f.int("n_group")
    if experts % groups or (groups > 1 and experts // groups < 2):   # a group's score sums its top 2 experts
        raise f.bad("n_group", groups, f"a divisor of n_routed_experts = {experts} leaving >= 2 experts per group")
    topk_group = f.int("topk_group", max=groups, why=f"n_group = {groups}")
    selectable = topk_group * (experts // groups)
    layers, vocab, hidden = f.int("num_hidden_layers"), f.int("vocab_size"), f.int("hidden_size")
    moe_inter = f.int("moe_intermediate_size")
    rope_dim = f.int("qk_rope_head_dim", min=2)
    if rope_dim % 2:
        raise f.bad("qk_rope_head_dim", rope_dim, "an even integer (rope rotates pairs)")
    qcfg = top.get("quantization_config", None) or f.get("quantization_config", None)  # top level first, as vLLM
    qname = "quantization_config" if top.has("quantization_config") else f.name("quantization_config")
    args = M.ModelArgs(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=f.int("intermediate_size"),
        moe_intermediate_size=moe_inter, num_hidden_layers=layers, num_attention_heads=f.int("num_attention_heads"),
        q_lora_rank=f.int("q_lora_rank"), kv_lora_rank=f.int("kv_lora_rank"),
        qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=rope_dim, v_head_dim=f.int("v_head_dim"),
        n_routed_experts=experts, n_group=groups, topk_group=topk_group,
        num_experts_per_tok=f.int("num_experts_per_tok", max=selectable,
                                  why=f"the experts of topk_group = {topk_group} of n_group = {groups} groups"),
        # the model code always builds the shared expert
        n_shared_experts=f.int("n_shared_experts"),
        first_k_dense_replace=f.int("first_k_dense_replace", min=0, max=layers, why=f"num_hidden_layers = {layers}"),
        moe_layer_freq=f.int("moe_layer_freq", 1),    # absent in transformers' config class: 1 = every layer
        norm_topk_prob=f.flag("norm_topk_prob"), routed_scaling_factor=f.number("routed_scaling_factor", above=0),
        rms_norm_eps=f.number("rms_norm_eps", min=FLOAT32_TINY, below=1, why="not 0 in float32"),
        rope_theta=theta,
        max_position_embeddings=f.int("max_position_embeddings"), rope_type=rope_type,
        num_nextn_predict_layers=f.int("num_nextn_predict_layers", 0, min=0),
        tie_word_embeddings=either("tie_word_embeddings").flag("tie_word_embeddings", False),
        bos_token_id=either("bos_token_id").token_ids("bos_token_id", vocab),
        eos_token_id=either("eos_token_id").token_ids("eos_token_id", vocab),
        pad_token_id=either("pad_token_id").token_ids("pad_token_id", vocab),
        quant=quant_args(Fields(qcfg, where, qname), hidden, moe_inter) if qcfg else None, nested=nested, **yarn)
    return args


def draft_args(path_or_dict) -> Dr.DraftArgs:
    """A DFlash drafter's config.json (a dict, a checkpoint directory or the file) -> DraftArgs, every field checked
    for its type and range."""
    return _draft_args(*read_config(path_or_dict, "drafter config"))


def _draft_args(cfg: dict, where: str) -> Dr.DraftArgs:
    """A DFlash config.json -> draft.DraftArgs, every field checked for its type and range
    (checkpoint.Fields: an error names the file and the field)."""
    f = Fields(cfg, where)
    dcfg = f.sub("dflash_config")
    # a DFlash field: dflash_config's, else the top level's (as upstream reads it)
    dflash = lambda key: dcfg if dcfg.has(key) or not f.has(key) else f
    f.choice("model_type", ("qwen3",), "qwen3")
    archs = f.get("architectures", [])
    if not isinstance(archs, list) or [a for a in archs if a != "DFlashDraftModel"]:
        raise f.bad("architectures", archs, "['DFlashDraftModel'] (no other is supported)")
    f.choice("hidden_act", ("silu",), "silu")
    layer_types = f.get("layer_types", [])
    if not isinstance(layer_types, list) or [t for t in layer_types if t != "full_attention"] \
            or f.flag("use_sliding_window", False):
        raise f.bad("layer_types", layer_types,
                    "only 'full_attention' (sliding-window drafter layers are not supported)")
    dflash("is_causal").choice("is_causal", (False,), False,
                               why="DFlash blocks attend non-causally")

    rope, theta, rope_type = rope_fields(f)
    rope.choice("partial_rotary_factor", (1.0, 1), 1.0)
    yarn = {}
    if rope_type == "yarn":
        yarn = dict(yarn_fields(rope), rope_truncate=rope.flag("truncate", True))

    n_heads, hidden = f.int("num_attention_heads"), f.int("hidden_size")
    n_kv = f.int("num_key_value_heads", n_heads, max=n_heads)
    if n_heads % n_kv:
        raise f.bad("num_key_value_heads", n_kv, f"a divisor of num_attention_heads = {n_heads}")
    if not f.has("head_dim") and hidden % n_heads:
        raise ValueError(f"{where}: field head_dim is missing, and hidden_size = {hidden} is not "
                         f"a multiple of num_attention_heads = {n_heads}")
    head_dim = f.int("head_dim", hidden // n_heads, min=2)
    if head_dim % 2:
        raise f.bad("head_dim", head_dim, "an even integer (rope rotates pairs)")
    max_pos = f.int("max_position_embeddings")
    scale = lambda key, default: dflash(key).number(key, default, above=0)
    return Dr.DraftArgs(
        hidden_size=hidden, intermediate_size=f.int("intermediate_size"),
        num_hidden_layers=f.int("num_hidden_layers"), num_attention_heads=n_heads,
        num_key_value_heads=n_kv, head_dim=head_dim,
        rms_norm_eps=f.number("rms_norm_eps", min=FLOAT32_TINY, below=1), rope_theta=theta,
        max_position_embeddings=max_pos,
        # the block's positions follow the context: a block past the positions is never drafted
        block_size=f.int("block_size", min=2, max=max_pos,
                         why=f"max_position_embeddings = {max_pos}"),
        num_target_layers=f.int("num_target_layers"),
        mask_token_id=dflash("mask_token_id").int("mask_token_id", min=0),
        target_layer_ids=dflash("target_layer_ids").ints("target_layer_ids"),
        vocab_size=f.int("vocab_size", None), attention_bias=f.flag("attention_bias", False),
        rope_type=rope_type, input_embedding_scale=scale("input_embedding_scale", 1.0),
        output_multiplier=scale("output_multiplier", 1.0),
        final_logit_softcapping=scale("final_logit_softcapping", None), **yarn)


def check_drafter_compatible(d: Dr.DraftArgs, t: M.ModelArgs) -> None:
    """Reject a drafter that cannot run on this target, before anything is loaded or computed."""
    T = t.num_hidden_layers
    for i in d.target_layer_ids:
        if not 0 <= i < T:
            raise ValueError(f"drafter target_layer_ids contains {i}, outside the target's "
                             f"layers [0, {T}) (target num_hidden_layers = {T})")
    if list(d.target_layer_ids) != sorted(set(d.target_layer_ids)):
        # model.Transformer concatenates the taps in layer order; DFlash concatenates in list order
        raise ValueError(f"drafter target_layer_ids {d.target_layer_ids} "
                         "must be strictly increasing")
    if d.num_target_layers != T:
        raise ValueError(f"drafter num_target_layers = {d.num_target_layers} "
                         f"but target num_hidden_layers = {T}")
    if d.hidden_size != t.hidden_size:
        raise ValueError(f"drafter hidden_size = {d.hidden_size} "
                         f"but target hidden_size = {t.hidden_size}")
    # The fc input width is then len(target_layer_ids) x target hidden_size by construction; a
    # checkpoint whose fc.weight disagrees is rejected by load_drafter's shape check, which names
    # that product.
    if d.vocab_size is not None and d.vocab_size != t.vocab_size:
        raise ValueError(f"drafter vocab_size = {d.vocab_size} "
                         f"but target vocab_size = {t.vocab_size}")
    if not 0 <= d.mask_token_id < t.vocab_size:
        raise ValueError(f"drafter mask_token_id = {d.mask_token_id} "
                         f"is outside the target vocab_size = {t.vocab_size}")
    if d.block_size > t.max_position_embeddings:
        raise ValueError(f"drafter block_size = {d.block_size} is more than the target's "
                         f"max_position_embeddings = {t.max_position_embeddings}")


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
    """file -> tensor names, from model.safetensors.index.json, or {"model.safetensors": None} (every tensor).
    The index may name only files inside ckpt_dir (a relative path without '..'; a symlink there may point
    anywhere, as in the Hugging Face cache)."""
    check_dir(ckpt_dir)
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if regular_file(index):
        weight_map = Fields(read_json(index), index).sub("weight_map", required=True)
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.obj.items():
            if not (isinstance(fname, str) and fname and "\0" not in fname and not os.path.isabs(fname)
                    and ".." not in fname.replace("\\", "/").split("/")):
                raise CheckpointError(f"{index}: field weight_map.{name} = {_show(fname)}: expected the name of a "
                                      f"shard file inside {ckpt_dir}")
            files.setdefault(fname, []).append(name)
        for fname in files:
            if not regular_file(os.path.join(ckpt_dir, fname)):     # a FIFO or a directory: not a regular file
                raise CheckpointError(f"{index} names shard {fname}, which does not exist in {ckpt_dir}")
        return files
    single = os.path.join(ckpt_dir, "model.safetensors")
    if regular_file(single):      # a FIFO would block safetensors' open forever, Ctrl-C or not
        return {"model.safetensors": None}
    raise CheckpointError(f"{ckpt_dir}: no model.safetensors.index.json and no model.safetensors")


def open_shard(ckpt_dir: str, fname: str):
    """safetensors' safe_open of one shard (a context manager); an unreadable file is an error naming it."""
    from safetensors import safe_open
    path = os.path.join(ckpt_dir, fname)
    if not regular_file(path):
        raise CheckpointError(f"{path}: no such file")
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read as safetensors ({e})") from None


def tensor_names(ckpt_dir: str) -> list[tuple[str, str]]:
    """(tensor name, file) of every tensor the checkpoint holds (headers only, no data read)."""
    out = []
    for fname, names in sorted(shard_files(ckpt_dir).items()):
        if names is None:
            with open_shard(ckpt_dir, fname) as f:
                names = list(f.keys())
        out += [(n, fname) for n in names]
    return out


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


def _check_dtype(name, fname, sl, want: torch.dtype) -> torch.dtype:
    """The tensor's dtype, checked: exactly want, or any float for a float (an unknown one, e.g. F8_E4M3, by
    safetensors' name)."""
    got = DTYPES.get(sl.get_dtype())
    ok = (got == want) if not want.is_floating_point else (got is not None and got.is_floating_point)
    if not ok:
        expected = "a float (F32, F16, BF16)" if want.is_floating_point else str(want)
        raise CheckpointError(f"tensor {name} in {fname} has dtype {got or sl.get_dtype()}, expected {expected}")
    return got


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


def load_model(ckpt: str, device, dtype: torch.dtype, progress: bool = True, check: bool = True) -> M.Transformer:
    """Build the target directly on `device` in `dtype` (its config checked against the TP size and, unless the
    caller did already (check=False), the checkpoint's tensors first) and load it.
    ckpt `random:<name>`: random_model instead."""
    if is_random(ckpt):
        return random_model(ckpt, device, dtype)
    args = model_args(ckpt)
    M.check_tp_divisibility(args, M.world_size)
    if check:
        check_checkpoint(args, ckpt)
    model = build(lambda: M.Transformer(args), device, dtype)
    load_checkpoint(model, ckpt, progress=progress)
    return model.eval()


def check_checkpoint(args: M.ModelArgs, ckpt_dir: str) -> None:
    """The config against the tensors the checkpoint holds, before anything is allocated: the layer and expert
    counts from the tensor names, then every tensor's name, dtype and shape against the model the config
    describes, built on the meta device (no memory; load_checkpoint's own checks, reading no data)."""
    names = tensor_names(ckpt_dir)
    where = os.path.join(ckpt_dir, "config.json")
    layers, experts = {}, {}            # index -> (tensor, file) of the first tensor that names it
    for name, fname in names:
        key = _normalize(name)
        m = key and re.match(r"layers\.(\d+)\.", key)
        if m:
            layers.setdefault(int(m[1]), (name, fname))
            e = EXPERT_RE.fullmatch(key)
            if e and int(m[1]) < args.num_hidden_layers:
                experts.setdefault(int(e[2]), (name, fname))
    n, mtp = args.num_hidden_layers, args.num_nextn_predict_layers
    top = max(layers, default=-1)
    if top >= n + mtp:
        raise CheckpointError(f"{where}: num_hidden_layers = {n} (+ num_nextn_predict_layers = {mtp}), but "
                              f"tensor {layers[top][0]} in {layers[top][1]} is of layer {top}: the config does "
                              f"not describe this checkpoint")
    if top < n - 1:
        raise CheckpointError(f"{where}: num_hidden_layers = {n}, but the checkpoint holds tensors of layers "
                              f"0..{top} only")
    moe = any(args.is_moe_layer(i) for i in range(n))
    top = max(experts, default=-1)
    if top >= args.n_routed_experts or (moe and top < args.n_routed_experts - 1):
        held = f"tensor {experts[top][0]} in {experts[top][1]} is of expert {top}" if top >= 0 else "no experts"
        raise CheckpointError(f"{where}: n_routed_experts = {args.n_routed_experts}, but {held}: the config "
                              f"does not describe this checkpoint")
    meta = build(lambda: M.Transformer(args), "meta", torch.float32)
    load_checkpoint(meta, ckpt_dir, check_finite=False, read=False)


def load_drafter(path: str, target_args: M.ModelArgs | None = None, device=None, dtype=None) -> Dr.DFlashDrafter:
    """A DFlash drafter from its checkpoint directory (_read_drafter), or random_drafter for `random:<name>-dflash`."""
    return (random_drafter if is_random(path) else _read_drafter)(path, target_args, device, dtype)


# optional prefix, vLLM renames
_DRAFT_ALIASES = (("model.", ""), ("midlayer.", "layers.0."), ("encoder.fc.", "fc."))


def _draft_param_name(name: str) -> str:
    for old, new in _DRAFT_ALIASES:
        if name.startswith(old):
            name = new + name[len(old):]
    return name


def check_drafter_layer_count(args: Dr.DraftArgs, path: str) -> None:
    """config.json's num_hidden_layers against the layers the checkpoint's tensor names hold
    (headers only), before the drafter is built: a count too high or too low names the file."""
    layers = {}
    for name, fname in tensor_names(path):
        m = re.match(r"layers\.(\d+)\.", _draft_param_name(name))
        if m:
            layers.setdefault(int(m[1]), (name, fname))
    n, top = args.num_hidden_layers, max(layers, default=-1)
    where = os.path.join(path, "config.json")
    if top >= n:
        name, fname = layers[top]
        raise CheckpointError(f"{where}: num_hidden_layers = {n}, but tensor {name} in {fname} is "
                              f"of layer {top}")
    if top < n - 1:
        raise CheckpointError(f"{where}: num_hidden_layers = {n}, but the checkpoint holds tensors "
                              f"of layers 0..{top} only")


@torch.no_grad()
def _read_drafter(path: str, target_args: M.ModelArgs | None = None, device=None,
                  dtype=None) -> Dr.DFlashDrafter:
    """Read config.json, check it against the target and the TP size (before loading anything),
    build the drafter on `device` in `dtype` and load every tensor exactly once, checked against its
    full shape; each rank reads only its slice (safetensors get_slice, like
    checkpoint.load_checkpoint). No tensor may hold NaN / inf (checked as the target's are: the
    error names the tensor and its file)."""
    args = draft_args(path)
    if target_args is not None:
        check_drafter_compatible(args, target_args)
    check_drafter_layer_count(args, path)
    # allocated in the final dtype (no fp32 copy of a 3.5B model); the constructor checks the TP
    # divisibility first
    drafter = build(lambda: Dr.DFlashDrafter(args), device or "cpu",
                      dtype or torch.get_default_dtype())
    # checkpoint name -> (where its slice goes: a parameter or a stacked one's rows, its shard_dim)
    params, loaded = checkpoint_slots(drafter), set()
    written = []    # (name, file, where it went): names a non-finite tensor
    for fname, names in sorted(shard_files(path).items()):
        with open_shard(path, fname) as f:
            for name in names if names is not None else list(f.keys()):
                key = _draft_param_name(name)
                if key not in params:
                    raise CheckpointError(f"unexpected tensor {name} in {fname} "
                                          "(no such drafter parameter)")
                if key in loaded:
                    raise CheckpointError(f"tensor {name} appears twice (again in {fname})")
                _load_drafter_slice(f.get_slice(name), *params[key], key, name, fname, args)
                loaded.add(key)
                written.append((name, fname, params[key][0]))
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{path}: missing drafter tensors {missing[:5]}"
                              + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""))
    # as the target's: one sync, then the culprit
    _check_finite(list(drafter.parameters()), written)
    return drafter.eval()


def _load_drafter_slice(sl, dest: torch.Tensor, sd: int | None, key: str, name: str, fname: str,
                args: Dr.DraftArgs) -> None:
    """Check one checkpoint tensor's dtype and full (unsharded) shape, then copy this rank's slice
    into dest."""
    _check_dtype(name, fname, sl, dest.dtype)           # any float, as the target's
    shape = tuple(sl.get_shape())
    full = list(dest.shape)
    if sd is not None:
        full[sd] *= M.world_size
    if shape != tuple(full):
        why = (f" ({len(args.target_layer_ids)} target_layer_ids x hidden_size {args.hidden_size} "
               f"input columns)") if key == "fc.weight" else ""
        raise CheckpointError(f"tensor {name} in {fname} has shape {list(shape)}, "
                              f"expected {full}{why}")
    dest.copy_(rank_slice(sl, shape, sd, M.world_size, M.rank))


@torch.no_grad()
def load_checkpoint(model: M.Transformer, ckpt_dir: str, progress: bool = False, check_finite: bool = True,
                    read: bool = True) -> dict:
    """Load this rank's slices of every parameter from an HF safetensors checkpoint. check_finite: no floating
    tensor may hold NaN / inf (checked once over the loaded parameters, one host sync; then the culprit is
    named). read=False: every check on names, dtypes and shapes, no data read (a model on the meta device).
    Returns stats (bytes read by this rank, seconds, peak host RSS)."""
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
        with open_shard(ckpt_dir, fname) as f:
            file_names = set(f.keys())
            for name in (names if names is not None else file_names):
                if name not in file_names:
                    raise CheckpointError(f"index says tensor {name} is in {fname}, but the file does not hold it")
                key = _normalize(name)
                if key is None:
                    continue
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                layer = re.match(r"layers\.(\d+)\.", key)
                n, mtp = model.args.num_hidden_layers, model.args.num_nextn_predict_layers
                if layer and n <= int(layer[1]) < n + mtp:
                    continue    # the multi-token-prediction layers config.json declares: not used here
                if layer and int(layer[1]) >= n:
                    raise CheckpointError(f"tensor {name} in {fname} is of layer {layer[1]}, past config.json's "
                                          f"num_hidden_layers = {n} (+ num_nextn_predict_layers = {mtp})")
                m = EXPERT_RE.fullmatch(key)
                if m:
                    dest = _load_expert(model, m, sl, shape, name, fname, expert_loaded, read)
                else:
                    dest = _load_param(slots, loaded, key, sl, shape, name, fname, read)
                if dest is None:
                    continue
                nbytes += dest.numel() * DTYPES[sl.get_dtype()].itemsize    # this rank's slice, as stored
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


def _load_param(slots, loaded: set, key, sl, shape, name, fname, read: bool = True) -> torch.Tensor:
    """A non-expert tensor: checked against its slot (checkpoint_slots), this rank's slice copied in. Returns the
    slot."""
    if key not in slots:
        raise CheckpointError(f"unexpected tensor {name} in {fname} (no such parameter)")
    dest, sd = slots[key]
    if key in loaded:
        raise CheckpointError(f"tensor {name} appears twice (again in {fname})")
    _check_dtype(name, fname, sl, dest.dtype)
    full = list(dest.shape)
    if sd is not None:
        full[sd] *= M.world_size
    if shape != tuple(full):
        raise CheckpointError(f"tensor {name} in {fname} has shape {list(shape)}, expected {full}")
    if read:
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


def _load_expert(model, m, sl, shape, name, fname, loaded: set, read: bool = True) -> torch.Tensor | None:
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
        if sl.get_dtype() not in ("I32", "I64") or shape != (2,):
            raise CheckpointError(f"tensor {name} in {fname} has dtype {sl.get_dtype()} and shape {list(shape)}, "
                                  f"expected an int32 weight_shape of 2 values")
        if not read:
            return None
        got = tuple(int(v) for v in sl[:].tolist())
        if got != tuple(full):
            raise CheckpointError(f"tensor {name} in {fname}: weight_shape {list(got)} does not match the "
                                  f"config, expected {list(full)}")
        return None
    _check_dtype(name, fname, sl, view.dtype)
    if shape != tuple(full):
        what = {"weight_packed": " (int32 words of 8 int4 values)",
                "weight_scale": f" (one scale per group of {model.args.quant.group_size if model.args.quant else 0})"}
        raise CheckpointError(f"tensor {name} in {fname} has shape {list(shape)}, expected {list(full)}"
                              f"{what.get(kind, '')}")
    if read:
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
        with replacing(os.path.join(out_dir, fname)) as tmp:
            save_file({n: out[n] for n in shard}, tmp, metadata={"format": "pt"})
        for n in shard:
            weight_map[n] = fname
            total += out[n].numel() * out[n].element_size()
    write_json(os.path.join(out_dir, "model.safetensors.index.json"), {"metadata": {"total_size": total},
                                                                       "weight_map": weight_map}, indent=1)
    write_json(os.path.join(out_dir, "config.json"), config)


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


def write_drafter(path: str, drafter_or_state, config: dict, n_shards: int = 1) -> None:
    """Write config.json + model.safetensors (or n_shards shards + index) in the public DFlash
    layout: a drafter (world size 1), or a state dict under checkpoint names or the drafter's own
    (stacked tensors are split)."""
    from safetensors.torch import save_file
    if isinstance(drafter_or_state, torch.nn.Module):
        state = checkpoint_tensors(drafter_or_state)
    else:      # the stacked parameters of a drafter of this config, split into their tensors
        with torch.device("meta"):
            layout = Dr.DFlashDrafter(draft_args(config))
        state = checkpoint_tensors(layout, drafter_or_state)
    state = {k: v.detach().contiguous() for k, v in state.items()}
    if n_shards > 1:
        save_checkpoint(state, config, path, n_shards=n_shards, vision=False, prefix="")
        return
    os.makedirs(path, exist_ok=True)
    with replacing(os.path.join(path, "model.safetensors")) as tmp:
        save_file(state, tmp, metadata={"format": "pt"})
    write_json(os.path.join(path, "config.json"), config)


def tiny_draft_config(target_args: M.ModelArgs, **over) -> dict:
    """A tiny DFlash config for `target_args`, with the public files' fields: 2 layers, GQA 4/2,
    head_dim != hidden/heads, YaRN, block_size 4, mask token = vocab - 2 (as Kimi's 163838 of
    163840)."""
    T, D, V = target_args.num_hidden_layers, target_args.hidden_size, target_args.vocab_size
    n_layers = over.get("num_hidden_layers", 2)
    ids = sorted({min(max(i, 0), T - 1) for i in Dr.build_target_layer_ids(T, n_layers)})
    cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=D,
               intermediate_size=2 * D, num_hidden_layers=n_layers, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, hidden_act="silu", rms_norm_eps=1e-6,
               rope_theta=50000.0,
               rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32,
                                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
               max_position_embeddings=256, attention_bias=False, vocab_size=V,
               tie_word_embeddings=False, block_size=4, num_target_layers=T,
               dflash_config=dict(mask_token_id=V - 2, target_layer_ids=ids))
    cfg.update(over)
    return cfg


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


def int4_experts(w13_packed, w13_scale, w2_packed, w2_scale, group_size: int = 32) -> M.Experts:
    """A model.Experts holding these INT4 tensors (the layout load_checkpoint fills): the routed experts of one layer
    for the kernel tests and bench.py, without a model around them."""
    E, D, I = w13_packed.shape[0], w2_packed.shape[1], w2_packed.shape[2] * 8
    args = types.SimpleNamespace(n_routed_experts=E, hidden_size=D, moe_intermediate_size=I * M.world_size)
    experts = build(lambda: M.Experts(args, M.QuantArgs(group_size)), "meta", w13_scale.dtype)
    for name, t in zip(("w13_packed", "w13_scale", "w2_packed", "w2_scale"),
                       (w13_packed, w13_scale, w2_packed, w2_scale)):
        setattr(experts, name, torch.nn.Parameter(t, requires_grad=False))
    return experts


def random_drafter(config, target_args: M.ModelArgs | None, device, dtype: torch.dtype, seed: int = 0):
    """The DFlash drafter of `config` (random:<name>-dflash or a drafter config), as draft.load_drafter builds it,
    filled by randomize_ (its names prefixed 'draft.', so no drafter weight repeats a target weight)."""
    args = draft_args(config)
    if target_args is not None:
        check_drafter_compatible(args, target_args)
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
