"""Bad input and faults, as a hostile or careless user makes them: every value read from a file (config.json of
the target and the drafter, the safetensors index, tensor dtypes and shapes, tokenizer_config.json, the chat
template) or a flag, at its worst legal-looking (NaN, inf, 0, negative, huge, a wrong type, empty). Each gives one
line naming the file / field / flag and what was expected, exit code 2 (130 for Ctrl-C), or the right output.
docs/FAULTS.md is the table of these cases; every row names its test here.

Run: python -m pytest -q tests/test_faults.py
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import bench
import checkpoint as C
import cli
import draft as dflash
import generate as G
import model as M
import tiny
import tokenizer as tk
from tokenizer import KIMI_SPECIAL_TOKENS, Tokenizer, write_chat_template, write_tiktoken_model, write_tokenizer_config

VOCAB = 512     # 256 byte tokens + 256 special ids, as the real K2.6 layout
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny K2.6-layout target with a Kimi-layout tokenizer and chat template, and its drafter in draft/."""
    return tiny.write_cli_pair(tmp_path_factory.mktemp("faults"), tiny.text_config(vocab_size=VOCAB), seed=3)


def copy_of(ckpt, tmp_path, name="ck"):
    dst = tmp_path / name
    shutil.copytree(ckpt, dst)
    return dst


def tokenizer_dir(ckpt, tmp_path):
    """The checkpoint's tokenizer files alone."""
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ckpt / name, d / name)
    return d


def edit_json(path, edit):
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))      # json writes NaN / Infinity as Python's json reads them


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(code, err, *words, rc=2):
    lines = err.strip().splitlines()
    return code == rc and "Traceback" not in err and len(lines) == 1 and all(w in err for w in words)


def no_loading(monkeypatch):
    """Fail the test if anything allocates a model: every check must come before."""
    real = C.build

    def build(make, device, dtype):
        if str(device) != "meta":
            raise AssertionError("a model was allocated before the checks")
        return real(make, device, dtype)
    monkeypatch.setattr(C, "build", build)


# ----------------------------------------------------------------------------------------------
# config.json of the target: each field checked for its type and range where it is read

NAN, INF = float("nan"), float("inf")

TARGET_CASES = [   # (field path, bad value, words the error must hold)
    ("rms_norm_eps", -1e-5, "a finite number >= 1.17549e-38 and < 1 (not 0 in float32)"),
    ("rms_norm_eps", NAN, "rms_norm_eps = nan: expected a finite number"),
    ("rms_norm_eps", 0, "rms_norm_eps = 0"),
    ("rms_norm_eps", 1e-300, "rms_norm_eps = 1e-300"),          # 0 once in float32
    ("routed_scaling_factor", 1e300, "routed_scaling_factor = 1e+300"),   # inf once in float32
    ("routed_scaling_factor", NAN, "a finite number > 0"),
    ("routed_scaling_factor", INF, "a finite number > 0"),
    ("routed_scaling_factor", -2.8, "> 0"),
    ("rope_scaling.factor", 0, "rope_scaling.factor = 0: expected a finite number >= 1"),
    ("rope_scaling.factor", NAN, "rope_scaling.factor"),
    ("rope_scaling.beta_fast", 0, "rope_scaling.beta_fast = 0: expected a finite number > 0"),
    ("rope_scaling.mscale_all_dim", -1.0, "rope_scaling.mscale_all_dim"),
    ("rope_scaling.original_max_position_embeddings", "32", "an integer >= 1"),
    ("rope_scaling.attention_factor", 0, "rope_scaling.attention_factor"),
    ("rope_scaling", [], "field rope_scaling must be a JSON object, got a list"),
    ("rope_scaling.type", "dynamic", "'dynamic' is not supported"),
    ("rope_theta", 1.0, "rope_theta = 1.0: expected a finite number > 1"),
    ("rope_theta", "50000", "rope_theta"),
    ("hidden_size", "64", "hidden_size = '64': expected an integer >= 1"),
    ("hidden_size", -64, "an integer >= 1"),
    ("vocab_size", 0, "vocab_size = 0"),
    ("num_hidden_layers", 3.0, "num_hidden_layers = 3.0: expected an integer"),
    ("num_attention_heads", True, "num_attention_heads = true: expected an integer"),
    ("kv_lora_rank", None, "field kv_lora_rank is missing (required)"),
    ("q_lora_rank", [48], "q_lora_rank"),
    ("max_position_embeddings", 0, "max_position_embeddings"),
    ("moe_layer_freq", 0, "moe_layer_freq = 0: expected an integer >= 1"),
    ("n_group", 3, "n_group = 3: expected a divisor of n_routed_experts = 8"),
    ("topk_group", 2, "topk_group = 2: expected an integer in [1, 1]"),
    ("num_experts_per_tok", 9, "num_experts_per_tok = 9: expected an integer in [1, 8]"),
    ("num_experts_per_tok", 0, "num_experts_per_tok"),
    ("n_shared_experts", 0, "n_shared_experts"),
    ("first_k_dense_replace", 5, "first_k_dense_replace = 5: expected an integer in [0, 3]"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim = 7: expected an even integer"),
    ("norm_topk_prob", "yes", "norm_topk_prob = 'yes': expected true or false"),
    ("tie_word_embeddings", 1, "tie_word_embeddings = 1: expected true or false"),
    ("scoring_func", "softmax", "scoring_func = 'softmax' is not supported"),
    ("hidden_act", "gelu", "hidden_act"),
    ("topk_method", ["noaux_tc"], "topk_method"),
    ("model_type", "llama", "model_type = 'llama' is not supported"),
    ("eos_token_id", 96, "eos_token_id = 96: expected a token id or a list of them, in [0, vocab_size = 96)"),
    ("bos_token_id", -1, "bos_token_id"),
    ("eos_token_id", [1, "2"], "eos_token_id"),
    ("num_nextn_predict_layers", -1, "num_nextn_predict_layers"),
]


@pytest.mark.parametrize("field,value,words", TARGET_CASES, ids=[f"{f}={v!r}" for f, v, _ in TARGET_CASES])
def test_bad_target_config_names_file_and_field(tmp_path, field, value, words):
    msg = config_error(tmp_path, tiny.text_config(), field, value, C.model_args)
    assert field.split(".")[-1] in msg and words in msg, msg


def config_error(tmp_path, cfg: dict, field: str, value, read) -> str:
    """cfg with field (dotted: nested objects) set to value, written as tmp_path/config.json and read:
    the one-line error, which names the file."""
    *parents, key = field.split(".")
    obj = cfg
    for p in parents:
        obj = obj[p]
    obj[key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        read(str(tmp_path))
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.update(text_config=[1]), "field text_config must be a JSON object, got a list"),
    (lambda c: c.update(model_type="llava"), "model_type = 'llava' is not supported"),
    (lambda c: c["text_config"].update(rms_norm_eps=NAN), "text_config.rms_norm_eps = nan"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=24),
     "group_size = 24 does not divide hidden_size = 64"),
    (lambda c: c["quantization_config"].update(config_groups=["group_0"]),
     "field quantization_config.config_groups must be a JSON object, got a list"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=4.0),
     "weights.num_bits = 4.0 is not supported"),
])
def test_bad_nested_config(tmp_path, edit, words):
    cfg = C.k26_config(tiny.text_config())
    cfg["text_config"]["quantization_config"] = cfg["quantization_config"]
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        C.model_args(str(tmp_path))
    assert str(tmp_path / "config.json") in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.parametrize("content,words", [
    (b"[1, 2]", "expected a JSON object at the top level, got a list"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[" * 100000, "not valid JSON"),
])
def test_config_file_that_is_not_an_object(tmp_path, content, words):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "config.json")) + ".*" + words):
        C.model_args(str(tmp_path))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "tokenizer_config.json"])
def test_json_file_that_is_a_device(ckpt, tmp_path, name):
    """A config file that is a symlink to /dev/zero used to be read until memory ran out."""
    ck = copy_of(ckpt, tmp_path)
    (ck / name).unlink()
    (ck / name).symlink_to("/dev/zero")
    read = Tokenizer.from_dir if name == "tokenizer_config.json" else \
        (lambda d: C.load_model(str(d), torch.device("cpu"), torch.float32, progress=False))
    with pytest.raises(ValueError, match=re.escape(str(ck / name)) + ": not a regular file"):
        read(ck)


def test_hyperparameters_are_read_not_guessed():
    """A value the file gives is used as given: no `or default` that turns a 0 into 32."""
    cfg = tiny.text_config()
    cfg["rope_scaling"].pop("beta_fast")
    assert C.model_args(cfg).beta_fast == 32.0             # absent: transformers' documented default
    cfg["rope_scaling"]["beta_fast"] = 0
    with pytest.raises(ValueError, match="beta_fast = 0"):
        C.model_args(cfg)


# ----------------------------------------------------------------------------------------------
# config.json of the drafter

DRAFT_CASES = [
    ("block_size", 100000, "block_size = 100000: expected an integer in [2, 256] (max_position_embeddings = 256)"),
    ("block_size", 1, "block_size = 1"),
    ("block_size", "8", "block_size = '8'"),
    ("rms_norm_eps", NAN, "rms_norm_eps = nan"),
    ("num_attention_heads", "4", "num_attention_heads = '4': expected an integer"),
    ("num_key_value_heads", 3, "num_key_value_heads = 3: expected a divisor of num_attention_heads = 4"),
    ("head_dim", 23, "head_dim = 23: expected an even integer"),
    ("intermediate_size", 0, "intermediate_size = 0"),
    ("dflash_config", [1], "field dflash_config must be a JSON object, got a list"),
    ("dflash_config.target_layer_ids", [], "target_layer_ids = []: expected a non-empty list of integers"),
    ("dflash_config.target_layer_ids", ["1"], "target_layer_ids"),
    ("dflash_config.mask_token_id", -1, "mask_token_id = -1"),
    ("dflash_config.mask_token_id", 9.5, "mask_token_id = 9.5"),
    ("dflash_config.input_embedding_scale", NAN, "input_embedding_scale = nan"),
    ("dflash_config.final_logit_softcapping", -30.0, "final_logit_softcapping = -30.0"),
    ("dflash_config.is_causal", True, "is_causal = true is not supported"),
    ("rope_scaling.factor", 0, "rope_scaling.factor = 0"),
    ("rope_scaling.truncate", "no", "rope_scaling.truncate = 'no': expected true or false"),
    ("rope_theta", -1, "rope_theta = -1"),
    ("layer_types", "full_attention", "layer_types = 'full_attention'"),
    ("vocab_size", "96", "vocab_size = '96'"),
    ("attention_bias", "false", "attention_bias = 'false'"),
]


@pytest.mark.parametrize("field,value,words", DRAFT_CASES, ids=[f"{f}={v!r}" for f, v, _ in DRAFT_CASES])
def test_bad_drafter_config_names_file_and_field(tmp_path, field, value, words):
    cfg = C.tiny_draft_config(C.model_args(tiny.text_config()))
    assert words in config_error(tmp_path, cfg, field, value, C.draft_args)


def test_drafter_block_size_must_fit_the_target():
    target = C.model_args(tiny.text_config(max_position_embeddings=16))
    d = C.draft_args(C.tiny_draft_config(target, block_size=32))
    with pytest.raises(ValueError, match="block_size = 32 is more than the target's max_position_embeddings = 16"):
        C.check_drafter_compatible(d, target)


def test_huge_drafter_block_size_refused_before_loading(ckpt, tmp_path, capsys, monkeypatch):
    """block_size 100000 used to be accepted, the first step then asking for 160 GB."""
    draft = tmp_path / "draft"
    shutil.copytree(ckpt / "draft", draft)
    edit_json(draft / "config.json", lambda c: c.update(block_size=100000, max_position_embeddings=1 << 20))
    no_loading(monkeypatch)
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--draft", draft, "--prompt-ids", "1,2", "--quiet")
    assert one_line(code, err, "block_size = 100000"), err


# ----------------------------------------------------------------------------------------------
# the checkpoint's tensors against its config, before anything is allocated

@pytest.mark.parametrize("edit,words", [
    (dict(num_hidden_layers=2), "num_hidden_layers = 2 (+ num_nextn_predict_layers = 0), but tensor"),
    (dict(num_hidden_layers=4), "num_hidden_layers = 4, but the checkpoint holds tensors of layers 0..2 only"),
    (dict(num_hidden_layers=10**9), "num_hidden_layers = 1000000000, but the checkpoint holds"),
    (dict(n_routed_experts=16), "n_routed_experts = 16, but"),
    (dict(n_routed_experts=4), "n_routed_experts = 4, but tensor"),
    (dict(n_routed_experts=2**40), "n_routed_experts = 1099511627776"),
    (dict(kv_lora_rank=10**9), "has shape"),
    (dict(hidden_size=10**7), "has shape"),
    (dict(vocab_size=10**9), "has shape"),
])
def test_config_against_tensors_before_allocating(ckpt, tmp_path, monkeypatch, edit, words):
    """A config that does not describe the tensors (a truncated layer count used to load a truncated model and
    generate) is refused naming the config and a tensor, before any memory is allocated for the model."""
    ck = copy_of(ckpt, tmp_path)
    edit_json(ck / "config.json", lambda c: c["text_config"].update(edit))
    no_loading(monkeypatch)
    with pytest.raises(C.CheckpointError) as e:
        C.load_model(str(ck), torch.device("cpu"), torch.float32, progress=False)
    assert words in str(e.value), str(e.value)


def test_truncated_layer_count_from_the_command_line(ckpt, tmp_path, capsys):
    ck = copy_of(ckpt, tmp_path)
    edit_json(ck / "config.json", lambda c: c["text_config"].update(num_hidden_layers=2))
    code, _, err = run_cli(capsys, "--ckpt", ck, "--prompt-ids", "1,2", "--budget", "0", "--quiet")
    assert one_line(code, err, str(ck / "config.json"), "num_hidden_layers = 2"), err


@pytest.mark.parametrize("weight_map,words", [
    ([], "field weight_map must be a JSON object, got a list"),
    ("model.safetensors", "field weight_map must be a JSON object, got a string"),
    ({"model.embed_tokens.weight": "../other/model.safetensors"}, "expected the name of a shard file inside"),
    ({"model.embed_tokens.weight": "/etc/passwd"}, "expected the name of a shard file inside"),
    ({"model.embed_tokens.weight": "a/../../x.safetensors"}, "expected the name of a shard file inside"),
    ({"model.embed_tokens.weight": 3}, "weight_map.model.embed_tokens.weight = 3"),
    ({"model.embed_tokens.weight": "missing.safetensors"}, "names shard missing.safetensors, which does not exist"),
])
def test_bad_index(ckpt, tmp_path, weight_map, words):
    ck = copy_of(ckpt, tmp_path)
    edit_json(ck / "model.safetensors.index.json", lambda c: c.update(weight_map=weight_map))
    with pytest.raises(ValueError) as e:
        C.load_model(str(ck), torch.device("cpu"), torch.float32, progress=False)
    assert "model.safetensors.index.json" in str(e.value) and words in str(e.value), str(e.value)


def _rewrite_tensor(ck, suffix, fn):
    from safetensors.torch import load_file, save_file
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    name = next(n for n in index["weight_map"] if n.endswith(suffix))
    shard = ck / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = fn(tensors[name])
    save_file(tensors, shard)
    return name


@pytest.mark.parametrize("suffix,fn,words", [
    ("layers.0.input_layernorm.weight", lambda t: t.to(torch.float8_e4m3fn), "has dtype F8_E4M3, expected a float"),
    ("layers.0.input_layernorm.weight", lambda t: t.to(torch.int32), "has dtype torch.int32, expected a float"),
    ("experts.0.up_proj.weight_shape", lambda t: t.float(), "expected an int32 weight_shape of 2 values"),
    ("experts.0.up_proj.weight_shape", lambda t: t[:1].contiguous(), "expected an int32 weight_shape"),
    ("experts.0.up_proj.weight_shape", lambda t: torch.tensor([2**31 - 1, 64], dtype=torch.int32), "weight_shape"),
    ("layers.0.input_layernorm.weight", lambda t: t[:0].contiguous(), "has shape [0], expected [64]"),
    ("embed_tokens.weight", lambda t: t.view(1, 1, *t.shape), "has shape [1, 1, 512, 64]"),
])
def test_bad_tensor_dtype_and_shape(ckpt, tmp_path, suffix, fn, words):
    ck = copy_of(ckpt, tmp_path)
    name = _rewrite_tensor(ck, suffix, fn)
    with pytest.raises(C.CheckpointError) as e:
        C.load_model(str(ck), torch.device("cpu"), torch.float32, progress=False)
    assert name in str(e.value) and words in str(e.value), str(e.value)


@pytest.mark.parametrize("layers,words", [(10**9, "num_hidden_layers = 1000000000, but the checkpoint holds tensors "
                                                    "of layers 0..1 only"),
                                          (1, "num_hidden_layers = 1, but tensor layers.1.")])
def test_drafter_layer_count_against_its_tensors(ckpt, tmp_path, capsys, monkeypatch, layers, words):
    """A drafter config with more layers than its tensors (10^9 used to start building them) or fewer."""
    draft = tmp_path / "draft"
    shutil.copytree(ckpt / "draft", draft)
    edit_json(draft / "config.json", lambda c: c.update(num_hidden_layers=layers))
    no_loading(monkeypatch)
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--draft", draft, "--prompt-ids", "1,2", "--quiet")
    assert one_line(code, err, str(draft / "config.json"), words), err


def test_truncated_drafter_shard_is_named(ckpt, tmp_path, capsys):
    draft = tmp_path / "draft"
    shutil.copytree(ckpt / "draft", draft)
    (draft / "model.safetensors").write_bytes((draft / "model.safetensors").read_bytes()[:64])
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--draft", draft, "--prompt-ids", "1,2", "--quiet")
    assert one_line(code, err, str(draft / "model.safetensors"), "cannot read as safetensors"), err


def test_nan_config_from_the_command_line(ckpt, tmp_path, capsys):
    """A NaN routed_scaling_factor used to give NaN logits and token 0 forever, exit 0."""
    ck = copy_of(ckpt, tmp_path)
    edit_json(ck / "config.json", lambda c: c["text_config"].update(routed_scaling_factor=NAN))
    code, _, err = run_cli(capsys, "--ckpt", ck, "--prompt-ids", "1,2", "--quiet")
    assert one_line(code, err, str(ck / "config.json"), "text_config.routed_scaling_factor = nan"), err


# ----------------------------------------------------------------------------------------------
# tokenizer_config.json and the chat template

def test_chat_markup_missing_from_the_tokenizer(ckpt, tmp_path, capsys):
    """A tokenizer config without the markup tokens the template writes used to turn them into plain text."""
    ck = copy_of(ckpt, tmp_path)
    special = {i: n for i, n in KIMI_SPECIAL_TOKENS(256).items() if n not in ("<|im_user|>", "<|im_middle|>")}
    write_tokenizer_config(ck / "tokenizer_config.json", special)
    tok = Tokenizer.from_dir(ck)
    with pytest.raises(ValueError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert str(ck / "chat_template.jinja") in str(e.value) and "'<|im_user|>'" in str(e.value), str(e.value)
    assert "tokenizer_config.json does not define" in str(e.value)
    code, _, err = run_cli(capsys, "--ckpt", ck, "--prompt", "hi", "--quiet")     # before the weights load
    assert one_line(code, err, "<|im_user|>"), err
    # a raw prompt needs no markup; markup-like text in a message stays text, template or not
    assert tok.encode("<|im_user|>") == tok.encode("<|im_user|>", allow_special=False)
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.apply_chat_template([{"role": "user", "content": "<|made_up|> [BOS]"}])
    assert "<|made_up|> [BOS]" in tok.decode(ids)


def test_id_past_the_tokenizer_decodes_visibly(ckpt):
    """A model whose vocabulary is padded past the tokenizer may sample an id the tokenizer lacks: the stream
    shows it instead of stopping with a KeyError."""
    tok = Tokenizer.from_dir(ckpt)
    text = tok.decode([65, tok.vocab_size + 3, 66])
    assert text == f"A<|id {tok.vocab_size + 3}: not in the tokenizer|>B"
    dec = tk.StreamDecoder(tok)
    assert dec.push([65]) + dec.push([tok.vocab_size]) + dec.flush() == tok.decode([65, tok.vocab_size])


def test_binary_chat_template_is_named(ckpt, tmp_path):
    d = tokenizer_dir(ckpt, tmp_path)
    (d / "chat_template.jinja").write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(ValueError, match=re.escape(f"{d / 'chat_template.jinja'}: not UTF-8 text")):
        Tokenizer.from_dir(d)


def test_deeply_nested_tokenizer_json(ckpt, tmp_path):
    d = tokenizer_dir(ckpt, tmp_path)
    (d / "generation_config.json").write_text("[" * 100000)
    with pytest.raises(ValueError, match="generation_config.json: not valid JSON"):
        Tokenizer.from_dir(d)


def test_special_token_id_far_past_the_vocab(tmp_path):
    write_tiktoken_model(tmp_path / "tiktoken.model", {bytes([i]): i for i in range(256)})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"1000000000": {"content": "<|x|>"}}}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json.*1000000000.*num_base_tokens \+ 65536"):
        Tokenizer.from_dir(tmp_path)


HOSTILE = [   # (template, words of the error): each ends, in one line naming the template file
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "render-time limit"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "limit"),
    ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}", "render-time limit"),
    ("{% for i in range(80) %}{{ 'x' * 1000000 }}{% endfor %}", "output-size limit"),     # 80 MB
    ("{{ 'x' * 80000000 }}", "'*' would make 80000000 characters"),
    ("{% include 'other.jinja' %}", "line 1: no loader"),
    ("{{ range(10**9) | list }}", "Range too big"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
    ("{{ 10 ** 1000000 }}", "'**' would make an integer of more than 65536 bits"),
    ("{{ 'x' | center(10**10) }}", "center would make"),
    ("{{ 'x'.ljust(10**10) }}", "ljust would make"),
    ("{{ '{:>9999999999}'.format(1) }}", "a format width would make"),
    ("{{ '%09999999999d' % 1 }}", "a format width would make"),
    ("{{ '%9999999999s' | format(1) }}", "a format width would make"),
    ("{% set s = 'y' * 100000 %}{{ [s] * 100000 }}", "'*' would make"),
    ("{% set s = 'y' * 10000 %}{{ ([s] * 1000) | join(s) }}", "join would make"),
    ("{% set s = 'y' * 100000 %}{{ s | replace('', s) }}", "replace would make"),
    ("{% set s = 'y' * 100000 %}{{ range(100000) | map('string') | map('replace', '', s) | list | length }}",
     "render-work limit"),
    ("{% set a = 'x' * 1000 %}" + "{% set a = a ~ a %}" * 40 + "{{ a | length }}", "render-work limit"),
    ("{% set ns = namespace(a='x') %}{% for i in range(60) %}{% set ns.a = ns.a ~ ns.a %}{% endfor %}",
     "render-work limit"),
    ("{% set a = 'xxxxxxxx' %}" + "{% set a %}{{ a }}{{ a }}{% endset %}" * 40, "render-work limit"),
    ("{{ ('\n' * 100000) | indent(100000) }}", "indent would make"),
    ("{{ ('\t' * 100000).expandtabs(100000) }}", "expandtabs would make"),
    ("{{ messages | tojson(indent=100000000) }}", "tojson indent=100000000"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),      # the sandbox holds
    ("{{ foo.bar }}", "'foo' is undefined"),
    ("{{ 1 / 0 }}", "division by zero"),
    ("{{ messages.append(1) }}", "unsafe"),                            # inputs stay immutable
    ("ok\n{% for m in messages %}", "line 2: Unexpected end of template"),
]


@pytest.mark.parametrize("template,words", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_chat_template_is_one_line(ckpt, tmp_path, template, words):
    """Nested loops used to run until killed, an 80 MB render took 23 s, include and huge ranges gave
    tracebacks. The bounds are lowered here so the time-limit cases take half a second."""
    ck = tokenizer_dir(ckpt, tmp_path)
    write_chat_template(ck, template)
    tok = Tokenizer.from_dir(ck)
    tok.render_seconds = 0.5
    with pytest.raises(ValueError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    msg = str(e.value)
    assert msg.startswith(str(ck / "chat_template.jinja")) and words in msg and "\n" not in msg, msg


def test_render_bounds_hold_off_the_main_thread(ckpt):
    """No signals off the main thread: the checks in the sandbox's calls still stop a runaway render."""
    tok = Tokenizer.from_dir(ckpt)
    tok.chat_template = "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}"
    tok.render_seconds = 0.5
    box = []

    def render():
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        except ValueError as e:
            box.append(str(e))
    t = threading.Thread(target=render)
    t.start()
    t.join(120)
    assert box and "render-time limit" in box[0], box


def test_template_from_tokenizer_config_is_named(ckpt, tmp_path):
    ck = tokenizer_dir(ckpt, tmp_path)
    (ck / "chat_template.jinja").unlink()
    edit_json(ck / "tokenizer_config.json", lambda c: c.update(chat_template="{{ 'x' * 10**9 }}"))
    with pytest.raises(ValueError, match=re.escape(f"{ck / 'tokenizer_config.json'} (field chat_template), line 1")):
        Tokenizer.from_dir(ck).apply_chat_template([{"role": "user", "content": "hi"}])


def test_bounded_render_is_the_same_render(ckpt):
    """The bounds change no output: the shipped template renders what an unbounded jinja sandbox renders."""
    import jinja2.sandbox
    tok = Tokenizer.from_dir(ckpt)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a" * 5000},
            {"role": "assistant", "content": "b", "reasoning_content": "r"}, {"role": "user", "content": "c"}]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    want = env.from_string(tok.chat_template).render(messages=msgs, tools=None, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs, tokenize=False) == want


# ----------------------------------------------------------------------------------------------
# flags: output paths, --prompts, stdin

@pytest.mark.parametrize("path,words,bench_too", [
    ("{tmp}", "is a directory", True),
    ("{tmp}/no/such/dir/t.html", "no such directory", False),      # bench.py makes --out's directory
    ("{tmp}/file.txt/t.html", "no such directory", True),
    ("/proc/t.html", "cannot write there", True),
])
def test_output_paths_checked_before_work(ckpt, tmp_path, capsys, monkeypatch, path, words, bench_too):
    """--trace used to be checked after all the work (and bench's --out too), naming no flag."""
    (tmp_path / "file.txt").write_text("x")
    path = path.format(tmp=tmp_path)
    no_loading(monkeypatch)
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--draft", ckpt / "draft", "--prompt-ids", "1,2", "--trace", path,
                           "--quiet")
    assert one_line(code, err, f"--trace {path}", words), err
    if bench_too:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["tree", "--out", path])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--out {path}" in err, err


def test_bench_out_png_would_be_overwritten(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["tree", "--out", str(tmp_path / "r.png")])
    assert "name the JSON <name>.json" in capsys.readouterr().err
    a = bench.parse_args(["tree", "--out", str(tmp_path / "new" / "r.json")])      # a new directory is made
    assert a.out and (tmp_path / "new").is_dir() and not (tmp_path / "new" / "r.json").exists()


@pytest.mark.parametrize("make,words", [
    (lambda p: p.write_bytes(b"def f():\n\x89PNG\x00\xff"), "line 2 is not UTF-8 text"),
    (lambda p: p.write_bytes(b"ok\nnul\x00here\n"), "line 2 is not UTF-8 text (byte 0x00"),
    (lambda p: p.write_bytes(b"\n \n"), "no prompts"),
    (lambda p: None, "no such file or directory"),
])
def test_prompts_file_that_is_not_text(ckpt, tmp_path, capsys, monkeypatch, make, words):
    f = tmp_path / "prompts.txt"
    make(f)
    no_loading(monkeypatch)
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--prompts", f, "--raw", "--quiet")
    assert one_line(code, err, f"--prompts {f}", words), err


def test_prompts_device_and_pipe(ckpt, tmp_path, capsys, monkeypatch):
    """A device is refused, naming it and the flag; a pipe (--prompts <(...)) is read like a file."""
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--prompts", "/dev/zero", "--raw", "--quiet")
    assert one_line(code, err, "--prompts /dev/zero is a device"), err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write():
        with open(fifo, "w") as f:
            f.write("def f(x):\nclass A:\n")
    threading.Thread(target=write, daemon=True).start()
    code, out, err = run_cli(capsys, "--ckpt", ckpt, "--draft", ckpt / "draft", "--prompts", fifo, "--raw",
                             "--max-new-tokens", "3", "--quiet")
    assert code == 0 and "2 prompts" in out, err


def test_prompts_file_with_crlf_lines(ckpt, tmp_path, capsys, monkeypatch):
    """Windows line ends split prompts as Python's text files do (no prompt ends in \\r), and a leading
    byte-order mark is no part of the first prompt."""
    f = tmp_path / "p.txt"
    f.write_bytes(b"\xef\xbb\xbfa\r\nb\rc\n")          # a byte-order mark too, as Windows editors write
    seen = []
    monkeypatch.setattr(G, "generate_batch", lambda target, prompts, *a, **k: seen.extend(prompts) or [])
    code, out, err = run_cli(capsys, "--ckpt", ckpt, "--prompts", f, "--raw", "--quiet")
    tok = Tokenizer.from_dir(ckpt)
    assert code == 0 and [tok.decode(p) for p in seen] == ["a", "b", "c"], (err, seen)


def test_binary_stdin(ckpt, capsys, monkeypatch):
    import io

    class Stdin(io.StringIO):
        buffer = io.BytesIO(b"\xff\xfe\x00binary")
    monkeypatch.setattr(sys, "stdin", Stdin())
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--raw", "--quiet")
    assert one_line(code, err, "stdin: line 1 is not UTF-8 text"), err


@pytest.mark.parametrize("argv,words", [
    (["--temperature", "inf"], "--temperature must be 0 (greedy) or a finite number >= 0.0001, got inf"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "nan"], "--top-p"),
    (["--seed", "-1"], "--seed must be in [0, 2^63), got -1"),
    (["--seed", str(2**70)], "--seed"),
    (["--device", "tpu:0"], "--device 'tpu:0': expected cpu, cuda or cuda:N"),
    (["--device", "meta"], "--device 'meta'"),                       # a model of shapes and no values
    (["--device", "cuda:-1"], "--device 'cuda:-1'"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--budget", "1e3"], "argument --budget"),
])
def test_worst_legal_looking_flags(ckpt, capsys, monkeypatch, argv, words):
    no_loading(monkeypatch)
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--prompt-ids", "1", "--quiet", *argv)
    assert one_line(code, err, words), err


@pytest.mark.parametrize("argv,words", [
    (["e2e", "--temperature", "nan"], "--temperature must be 0 (greedy) or a finite number >= 0.0001 "
                                      "(each value), got [nan]"),
    (["e2e", "--temperature", "0,1e-30"], "(each value), got [0.0, 1e-30]"),
    (["e2e", "--temperature", ","], "--temperature"),
    (["e2e", "--batch", "0"], "--batch must be batch sizes >= 1"),
    (["e2e", "--n-prompts", "-1"], "--n-prompts must be >= 0"),
    (["e2e", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["e2e", "--max-seq-len", "-5"], "--max-seq-len"),
    (["e2e", "--warmup", "-2"], "--warmup"),
    (["e2e", "--budgets", ","], "--budgets must be at least one budget"),
    (["e2e", "--prompts", "/dev/zero"], "--prompts /dev/zero: expected a prompt set file"),
    (["step", "--step-modes", "fast"], "--step-modes must be among"),
    (["step", "--step-budgets", "-1"], "--step-budgets"),
    (["layers", "--ctx", "0"], "--ctx"),
    (["layers", "--allreduce-us", "inf"], "--allreduce-us"),
    (["tree", "--vocab", "0"], "--vocab must be >= 2, got 0"),
    (["tree", "--tree-depth", "0"], "--tree-depth"),
    (["tree", "--seed", "-1"], "--seed"),
])
def test_bench_flags_checked_first(capsys, argv, words):
    """bench.py's flags at their worst (a NaN temperature used to end in StopIteration, --batch 0 in a division
    by zero, --n-prompts -1 to drop the last prompt): refused by the parser, naming the flag."""
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and "Traceback" not in err, err


def test_bench_error_from_the_shell():
    r = subprocess.run([sys.executable, "bench.py", "e2e", "--ckpt", "/nonexistent/path"], cwd=ROOT, env=CPU_ENV,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert one_line(r.returncode, r.stderr, "/nonexistent/path not found"), r.stderr


# ----------------------------------------------------------------------------------------------
# Ctrl-C and a chat that outgrows the cache

def test_ctrl_c_while_loading(ckpt, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(C, "load_model", interrupted)
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--prompt-ids", "1,2", "--quiet")
    assert one_line(code, err, "interrupted (Ctrl-C)", rc=130), err


def test_ctrl_c_while_generating_flushes_and_traces(ckpt, tmp_path, capsys, monkeypatch):
    """Raised at the streaming hook after a few steps: the text so far is printed, the trace page holds the
    steps so far, one line on stderr, exit 130."""
    pushed = []
    push = tk.StreamDecoder.push

    def push_then_interrupt(self, ids):
        pushed.append(list(ids))
        if len(pushed) == 4:
            raise KeyboardInterrupt
        return push(self, ids)
    monkeypatch.setattr(tk.StreamDecoder, "push", push_then_interrupt)
    page = tmp_path / "t.html"
    code, out, err = run_cli(capsys, "--ckpt", ckpt, "--draft", ckpt / "draft", "--prompt-ids", "1,2,3",
                             "--max-new-tokens", "200", "--trace", page, "--quiet")
    assert one_line(code, err, "interrupted (Ctrl-C)", rc=130), err
    tok = Tokenizer.from_dir(ckpt)
    assert tok.decode([t for ids in pushed[:3] for t in ids]) in out and "tokens in" not in out
    html = page.read_text()
    assert "<!doctype html>" in html and re.search(r"\b3 steps\b", html), html[:600]


def test_ctrl_c_in_a_batch_prints_each_prompt_so_far(ckpt, tmp_path, capsys, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("a\nb\n")

    def gen(target, prompts, n, on_tokens=None, **kw):
        on_tokens(0, [65, 66])
        on_tokens(1, [67])
        raise KeyboardInterrupt
    monkeypatch.setattr(G, "generate_batch", gen)
    code, out, err = run_cli(capsys, "--ckpt", ckpt, "--prompts", f, "--raw", "--quiet")
    assert one_line(code, err, "interrupted", rc=130), err
    assert "--- 'a'\nAB\n--- 'b'\nC\n" in out


def test_ctrl_c_at_the_chat_prompt(ckpt, capsys, monkeypatch):
    class Terminal:
        def isatty(self):
            return True

    def ctrl_c(prompt=""):
        raise KeyboardInterrupt
    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr("builtins.input", ctrl_c)
    code, out, err = run_cli(capsys, "--ckpt", ckpt, "--quiet")
    assert "[chat:" in out and one_line(code, err, "interrupted (Ctrl-C)", rc=130), err


def test_chat_that_outgrows_the_cache_goes_on(ckpt, capsys, monkeypatch):
    """The history outgrows --max-seq-len: said in one line with /reset, the turn dropped, the chat goes on."""
    class Terminal:
        def isatty(self):
            return True
    lines = iter(["x" * 200, "hi", "/exit"])
    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    code, out, err = run_cli(capsys, "--ckpt", ckpt, "--max-seq-len", "64", "--max-new-tokens", "2", "--quiet")
    assert code == 0, err
    assert re.search(r"\[the conversation is \d+ tokens, more than the cache holds \(--max-seq-len 64\): /reset",
                     out) and "2 tokens in" in out, out


def test_sigint_from_the_shell(ckpt, tmp_path):
    """A real process and a real SIGINT while it streams: exit 130, one line on stderr, what was generated on
    stdout, the --trace page of the steps so far."""
    page = tmp_path / "t.html"
    p = subprocess.Popen([sys.executable, "-u", "generate.py", "--ckpt", str(ckpt), "--draft", str(ckpt / "draft"),
                          "--prompt-ids", "1,2,3", "--raw", "--max-new-tokens", "3000", "--max-seq-len", "3100",
                          "--trace", str(page), "--quiet"], cwd=ROOT, env=CPU_ENV, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = []

    def streaming() -> bool:        # loaded, then a few tokens
        seen.append(os.read(p.stdout.fileno(), 4096))
        text = b"".join(seen)
        return b"]\n" in text and len(text.split(b"]\n", 1)[1]) >= 5
    out, err = sigint_when(p, streaming, 240)
    seen = b"".join(seen)
    assert one_line(p.returncode, err, "interrupted (Ctrl-C)", rc=130), err
    assert b"tokens in" not in seen + out and page.exists() and "DDTree trace" in page.read_text()


def test_sigint_while_torch_imports():
    """Ctrl-C in the first second, while `import torch` runs (before cli.main): one line, exit 130, no
    traceback. The signal goes once torch's library is mapped into the process, mid-import."""
    p = subprocess.Popen([sys.executable, "-u", "generate.py", "--raw", "--prompt", "x"], cwd=ROOT, env=CPU_ENV,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = sigint_when(p, lambda: "libtorch" in open(f"/proc/{p.pid}/maps").read(), 60)
    assert one_line(p.returncode, err, "interrupted (Ctrl-C)", rc=130), err


def sigint_when(p: subprocess.Popen, ready, timeout: float) -> tuple[bytes, str]:
    """Send process p a real SIGINT once ready() holds (polled); its remaining stdout and its
    stderr. p is killed if it outlives the test."""
    try:
        deadline = time.time() + timeout
        while not ready():
            assert time.time() < deadline and p.poll() is None
            time.sleep(0.005)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return out, err.decode()


def test_stdout_closed_by_the_reader():
    """`generate.py ... | head -c 20`: the process stops quietly when its reader goes (exit 141, as a shell tool
    killed by SIGPIPE), no 'Broken pipe' error, no 'Exception ignored' at exit."""
    p = subprocess.Popen([sys.executable, "-u", "generate.py", "--raw", "--prompt", "def f(x):", "--max-new-tokens",
                          "2000", "--quiet"], cwd=ROOT, env=CPU_ENV, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        os.read(p.stdout.fileno(), 20)
        p.stdout.close()
        err = p.stderr.read().decode()
        p.wait(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 141 and err.strip() == "", (p.returncode, err)


# ----------------------------------------------------------------------------------------------
# outputs that are inputs, half-written files, files that are not regular files (issue 48)

def within(seconds: int, fn):
    """fn(), which must end within `seconds` (a FIFO opened for reading would block forever): SIGALRM ends a
    wait that Python's open retries."""
    def late(*_):
        raise TimeoutError(f"still blocked after {seconds} s")
    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_outputs_never_overwrite_inputs(ckpt, tmp_path, capsys, monkeypatch):
    """--trace or bench's --out (or the plot beside it) naming a file the run reads (the prompts, a checkpoint
    file, directly or through a link) used to replace it and exit 0: now refused before any work."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n")
    link = tmp_path / "cfg.html"
    link.symlink_to(ckpt / "config.json")
    no_loading(monkeypatch)
    before = {f: f.read_bytes() for f in (prompts, ckpt / "config.json", ckpt / "draft" / "config.json")}
    for argv, words in [(["--prompts", prompts, "--raw", "--trace", prompts], f"--trace {prompts}: a file the run reads"),
                        (["--prompt-ids", "1", "--trace", ckpt / "config.json"],
                         f"--trace {ckpt / 'config.json'}: a file of {ckpt}, which the run reads"),
                        (["--prompt-ids", "1", "--trace", link],
                         f"--trace {link}: a file of {ckpt}, which the run reads (it is {ckpt / 'config.json'})"),
                        (["--prompt-ids", "1", "--trace", ckpt / "draft" / "config.json"],
                         f"a file of {ckpt / 'draft'}, which the run reads")]:
        code, _, err = run_cli(capsys, "--ckpt", ckpt, "--draft", ckpt / "draft", *argv, "--quiet")
        assert one_line(code, err, words, "name another file"), err
    sets = tmp_path / "set.json"
    sets.write_text(json.dumps({"prompts": [{"category": "code", "text": "x"}]}))
    (tmp_path / "r.png").symlink_to(sets)          # the plot beside r.json would replace the prompt set
    before[sets] = sets.read_bytes()
    for out in (sets, tmp_path / "r.json"):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["e2e", "--prompts", str(sets), "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "a file the run reads" in err and "Traceback" not in err, err
    assert all(f.read_bytes() == b for f, b in before.items())


def test_train_out_never_overwrites_the_target_it_reads(ckpt, tmp_path, monkeypatch, capsys):
    """train.py --target-from SRC --out OUT, where OUT's drafter directory is SRC: the drafter's config.json
    would replace the target's."""
    import train as TR
    src = copy_of(ckpt, tmp_path, "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / TR.DRAFT_DIR).symlink_to(src)
    monkeypatch.setattr(TR, "load_corpus", lambda *a: pytest.fail("the corpus was read before the checks"))
    code = cli.exit_code(lambda: TR.main(TR.parse_args(["--out", str(tmp_path / "out"), "--target-from", str(src)])))
    err = capsys.readouterr().err
    assert one_line(code, err, "--out", f"a file of {src}, which the run reads (it is {src / 'config.json'})"), err


def failing_open(real_open=open):
    """open() whose files take a few bytes, then fail as a full disk does."""
    import errno
    import io

    class Full(io.StringIO):
        def __init__(self, path):
            super().__init__()
            self.f = real_open(path, "w")

        def write(self, text):
            self.f.write(text[:10])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __exit__(self, *exc):
            self.f.close()
    return lambda path, mode="r", **kw: Full(path) if "w" in mode else real_open(path, mode, **kw)


def test_a_failed_write_leaves_the_old_file(ckpt, tmp_path, capsys, monkeypatch):
    """A full disk while --trace or bench's --out is written used to leave a fragment (or 0 bytes) in place of
    the old file: the write goes to a temporary file, and the old file stays whole; the error is one line."""
    import files
    page = tmp_path / "t.html"
    page.write_text("OLD PAGE")
    monkeypatch.setattr(files, "open", failing_open(), raising=False)
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--draft", ckpt / "draft", "--prompt-ids", "1,2",
                           "--max-new-tokens", "3", "--trace", page, "--quiet")
    assert one_line(code, err, f"--trace {page}: cannot write the page", "No space left on device"), err
    results = tmp_path / "r.json"
    results.write_text("OLD RESULTS")
    with pytest.raises(ValueError, match=re.escape(f"--out {results}: cannot write the results (No space left")):
        bench.write_out({"bench": "x"}, str(results))
    assert page.read_text() == "OLD PAGE" and results.read_text() == "OLD RESULTS"
    assert sorted(os.listdir(tmp_path)) == ["r.json", "t.html"]          # no temporary file left


def test_written_files_get_the_umask_permissions(ckpt, tmp_path):
    """train.py's exported model.safetensors used to be 0600 (the temporary file's mode): unreadable to the
    others sharing a checkpoint folder."""
    cfg = json.loads((ckpt / "draft" / "config.json").read_text())
    old = os.umask(0o022)
    try:
        C.write_drafter(str(tmp_path / "d"), dflash.DFlashDrafter(C.draft_args(cfg)), cfg)
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert os.stat(tmp_path / "d" / name).st_mode & 0o777 == 0o644, name


@pytest.mark.parametrize("where", ["drafter", "target", "shard", "folder", "trace"])
def test_paths_that_are_not_regular_files(ckpt, tmp_path, capsys, monkeypatch, where):
    """A FIFO model.safetensors (the drafter's, or the target's without an index) used to block forever in
    safetensors' open, and Ctrl-C could not end it; --trace to a FIFO blocked before any work; a FIFO shard was
    called missing, a folder named model.safetensors 'No such device'. Each is now `PATH: not a regular file`."""
    ck = copy_of(ckpt, tmp_path)
    args = ["--ckpt", ck, "--draft", ck / "draft", "--prompt-ids", "1,2", "--quiet"]
    if where == "drafter":
        bad = ck / "draft" / "model.safetensors"
    elif where == "target":
        (ck / "model.safetensors.index.json").unlink()
        bad = ck / "model.safetensors"
    elif where == "shard":
        bad = ck / json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"][
            "language_model.model.embed_tokens.weight"]
    elif where == "trace":
        bad = tmp_path / "t.html"
        args += ["--trace", bad]
    if where == "folder":
        (ck / "draft" / "model.safetensors").unlink()
        (ck / "draft" / "model.safetensors").mkdir()
        bad = ck / "draft" / "model.safetensors"
    else:
        if bad.exists():
            bad.unlink()
        os.mkfifo(bad)
    code, _, err = within(60, lambda: run_cli(capsys, *args))
    assert one_line(code, err, f"{bad}: not a regular file"), err


def test_ctrl_c_ends_a_wait_on_a_pipe(ckpt, tmp_path, capsys):
    """--prompts <(...) is read like a file, so its open waits for a writer: Ctrl-C ends the wait, exit 130."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        code, _, err = run_cli(capsys, "--ckpt", ckpt, "--prompts", fifo, "--raw", "--quiet")
    finally:
        timer.cancel()
    assert one_line(code, err, "interrupted (Ctrl-C)", rc=130), err


def test_tiktoken_model_without_a_single_byte(ckpt, tmp_path, capsys):
    """A tiktoken.model lacking a single-byte token passed the loader, then tiktoken panicked on encode (a
    PanicException, which no `except Exception` catches)."""
    tok = tokenizer_dir(ckpt, tmp_path)
    ranks = {bytes([i]): i for i in range(256) if i != 0x41}
    ranks = {t: r for r, t in enumerate(ranks)} | {b"AB": 255}
    write_tiktoken_model(tok / "tiktoken.model", ranks)
    with pytest.raises(ValueError, match=re.escape(str(tok / "tiktoken.model")) + ": no token for the single byte 0x41"):
        Tokenizer.from_dir(tok)
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--tokenizer", tok, "--prompt", "A", "--raw", "--quiet")
    assert one_line(code, err, "tiktoken.model: no token for the single byte 0x41"), err


@pytest.mark.parametrize("prompts,words", [
    ({"prompts": {"a": 1}}, "field prompts = {'a': 1}: expected a non-empty list of {category, text} objects"),
    ({"prompts": []}, "field prompts = []: expected a non-empty list"),
    ({"set": []}, "field prompts is missing"),
    ({"prompts": ["text"]}, "field prompts[0] must be a JSON object, got a string"),
    ({"prompts": [{"category": "code", "text": 5}]}, "field prompts[0].text = 5: expected a string"),
    ({"prompts": [{"text": "x"}]}, "field prompts[0].category is missing"),
    ({"prompts": [{"category": ["code"], "text": "x"}]}, "field prompts[0].category = ['code']: expected a string"),
])
def test_bench_prompt_set_of_the_wrong_shape(tmp_path, capsys, prompts, words):
    """A TypeError or KeyError traceback, after loading, used to be the answer."""
    f = tmp_path / "set.json"
    f.write_text(json.dumps(prompts))
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["e2e", "--prompts", str(f)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--prompts {f}: {words}" in err and "Traceback" not in err, err


def test_bench_plot_path_checked_first(tmp_path, capsys):
    """bench.py e2e --out X.json checked X.json up front but not X.png: a traceback after the whole run."""
    (tmp_path / "r.png").mkdir()
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["e2e", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--out {tmp_path / 'r.json'}: its plot {tmp_path / 'r.png'} is a directory" in err


@pytest.mark.parametrize("argv,words", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--steps", "-1"], "--steps must be >= 1, got -1"),
    (["--draft-steps", "0"], "--draft-steps must be >= 1"),
    (["--max-files", "-3"], "--max-files must be >= 0 (0: all), got -3"),
    (["--device", "tpu"], "--device 'tpu': expected cpu, cuda or cuda:N"),
    (["--out", "{tmp}/file"], "--out {tmp}/file: not a directory"),
    (["--out", "/dev/full"], "--out /dev/full: not a directory"),
    (["--out", "/proc/x/y"], "--out /proc/x/y: cannot make the directory (no such file or directory)"),
    (["--target-from", "{tmp}/nowhere"], "--target-from {tmp}/nowhere: no such directory"),
    (["--target-from", "{tmp}"], "--target-from {tmp}: no config.json"),
])
def test_train_flags_checked_first(tmp_path, capsys, monkeypatch, argv, words):
    """Every bad train.py flag used to be a traceback, some after the corpus was read."""
    import train as TR
    (tmp_path / "file").write_text("x")
    argv = [a.format(tmp=tmp_path) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out")]
    monkeypatch.setattr(TR, "load_corpus", lambda *a: pytest.fail("the corpus was read before the checks"))
    code = cli.exit_code(lambda: TR.main(TR.parse_args(out + argv)))
    err = capsys.readouterr().err
    assert one_line(code, err, words.format(tmp=tmp_path)), err
    assert not (tmp_path / "out").exists()


def test_ctrl_c_in_train_and_bench(tmp_path, capsys, monkeypatch):
    """train.py and bench.py end as generate.py does: Ctrl-C is one line and exit 130, a file that cannot be
    written one line and exit 2 (cli.exit_code)."""
    import errno
    import train as TR

    def interrupted(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(TR, "load_corpus", interrupted)
    code = cli.exit_code(lambda: TR.main(TR.parse_args(["--out", str(tmp_path / "out")])))
    assert one_line(code, capsys.readouterr().err, "interrupted (Ctrl-C)", rc=130)

    def full(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "r.json")
    monkeypatch.setattr(bench, "main", full)
    code = cli.exit_code(bench.main)
    assert one_line(code, capsys.readouterr().err, "error: [Errno 28] No space left on device: 'r.json'")


def test_train_flag_error_from_the_shell(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--out", str(tmp_path), "--steps", "0"], cwd=ROOT, env=CPU_ENV,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert one_line(r.returncode, r.stderr, "error: --steps must be >= 1, got 0"), r.stderr


@pytest.mark.parametrize("argv,words", [
    (["--trace", ""], "--trace '': expected a file name"),
    (["--prompt-ids", "1_0"], "--prompt-ids '1_0': expected comma-separated token ids"),
    (["--prompt-ids", "+1"], "--prompt-ids '+1'"),
])
def test_flags_read_as_written(ckpt, capsys, monkeypatch, argv, words):
    """--trace '' was accepted and wrote nothing; --prompt-ids 1_0 was read as token 10 (int() takes '_'),
    which tiktoken.model's ranks refuse."""
    no_loading(monkeypatch)
    argv = ["--prompt-ids", "1", *argv] if "--prompt-ids" not in argv else argv
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--draft", ckpt / "draft", *argv, "--quiet")
    assert one_line(code, err, words), err


def test_values_that_int_refuses_name_file_and_field(ckpt, tmp_path, capsys):
    """A tokenizer_config.json key "²" (str.isdigit takes it, int() does not), a 5000-digit integer in config.json
    (past Python's int-from-string limit), an eos_token_id past the vocabulary: each names its file and field."""
    tok = tokenizer_dir(ckpt, tmp_path)
    edit_json(tok / "tokenizer_config.json", lambda c: c["added_tokens_decoder"].update({"²": {"content": "x"}}))
    with pytest.raises(ValueError, match=re.escape(f"{tok / 'tokenizer_config.json'}: field added_tokens_decoder['²']")):
        Tokenizer.from_dir(tok)
    edit_json(tok / "tokenizer_config.json", lambda c: c["added_tokens_decoder"].update(
        {"9" * 5000: c["added_tokens_decoder"].pop("²")}))
    with pytest.raises(ValueError, match=re.escape(f"{tok / 'tokenizer_config.json'}: field added_tokens_decoder['999")):
        Tokenizer.from_dir(tok)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny.text_config()).replace('"hidden_size": 64', '"hidden_size": ' + "9" * 5000))
    with pytest.raises(ValueError, match=re.escape(f"{cfg}: field hidden_size = a 5000-digit integer: expected an "
                                                   f"integer >= 1")):
        C.model_args(str(tmp_path))
    (tmp_path / "second").mkdir()
    tok = tokenizer_dir(ckpt, tmp_path / "second")
    (tok / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 10**6]}))
    code, _, err = run_cli(capsys, "--ckpt", ckpt, "--tokenizer", tok, "--prompt", "x", "--raw", "--quiet")
    assert one_line(code, err, f"{tok / 'generation_config.json'}: field eos_token_id", "1000000"), err


# ----------------------------------------------------------------------------------------------
# docs/FAULTS.md: every row names a test of this file that exists

def test_faults_table_names_real_tests():
    table = open(os.path.join(ROOT, "docs", "FAULTS.md")).read()
    named = set(re.findall(r"`(test_\w+)`", table))
    tests = "".join(open(os.path.join(ROOT, "tests", f)).read() for f in os.listdir(os.path.join(ROOT, "tests"))
                    if f.startswith("test_") and f.endswith(".py"))
    defined = set(re.findall(r"^def (test_\w+)\(", tests, re.M))
    rows = [line for line in table.splitlines() if line.startswith("|") and "---" not in line][1:]
    assert named and named <= defined, named - defined
    assert all(re.search(r"`test_\w+`", row) for row in rows), [r for r in rows if not re.search(r"`test_", r)]
