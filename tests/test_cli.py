"""generate.py as a user runs it: a tiny K2.6-layout checkpoint with a Kimi-layout tokenizer and chat template.
Every user mistake gives one line on stderr naming the flag or file and exit code 2, never a traceback (unless
--debug); a terminal with no prompt chats; --help shows every flag with its default.
Run: python -m pytest -q tests/test_cli.py"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import checkpoint as C
import cli
import draft as dflash
import generate as G
import model as M
import tiny
import tree as ddtree
from tokenizer import Tokenizer

VOCAB = 512     # 256 byte tokens + 256 special ids, as the real K2.6 layout (163584 + 256)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # moe_intermediate_size 64: the target splits over 2 ranks (x group size 32), for the torchrun test
    cfg = tiny.text_config(vocab_size=VOCAB, moe_intermediate_size=64)
    return tiny.write_cli_pair(tmp_path_factory.mktemp("cli"), cfg, seed=9)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code, err, word):
    return code == 2 and word in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_generates_and_reports(ckpt, capsys):
    code, out, err = run(capsys, "--ckpt", str(ckpt), "--draft", str(ckpt / "draft"), "--prompt", "def f(x):",
                         "--raw", "--max-new-tokens", "12", "--quiet")
    assert code == 0, err
    assert "tok/s" in out and "mean accept length" in out and "peak host RSS" in out
    code, out, _ = run(capsys, "--ckpt", str(ckpt), "--prompt-ids", "1,2,3", "--budget", "0", "--max-new-tokens", "5",
                       "--quiet")
    assert code == 0 and "5 tokens" in out


@pytest.mark.parametrize("argv,word", [
    (["--ckpt", "/nonexistent/path"], "--ckpt /nonexistent/path: no such checkpoint directory"),
    (["--prompts", "/"], "--prompts / is a directory"),
    (["--device", "cuda"], "--device cuda"),
    (["--prompt-ids", "1,a,3"], "--prompt-ids '1,a,3': expected comma-separated token ids"),
    (["--prompt-ids", ""], "--prompt-ids '': expected comma-separated token ids"),
    (["--max-seq-len", "1000000000"], "--max-seq-len 1000000000: the KV caches need"),
    (["--top-k", "-5"], "--top-k must be >= 0"),
    (["--top-k", "abc"], "argument --top-k: invalid int value"),
    (["--budget", "-1"], "--budget must be in [0, 1024]"), (["--budget", "5000"], "--budget"),
    (["--temperature", "-0.5"], "--temperature"), (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"),
    (["--temperature", "1e-30"], "--temperature must be 0 (greedy) or a finite number >= 0.0001, got 1e-30"),
    (["--temperature", "inf"], "--temperature must be 0 (greedy) or a finite number >= 0.0001, got inf"),
    (["--chain", "--budget", "0"], "--chain needs a drafter (--draft) and --budget >= 1, got --budget 0"),
    (["--show-tree", "--budget", "0"], "--show-tree needs a drafter"),
    (["--prompt", "x", "--raw", "--system", "be brief"], "--system"),
    (["--cuda-graph", "--device", "cpu"], "--cuda-graph needs a CUDA device"),
])
def test_bad_input_fails_before_loading(ckpt, capsys, monkeypatch, argv, word):
    """Each is one line naming the flag or file, exit code 2, and comes before any weight is read."""
    def no_load(*a, **k):
        raise AssertionError("loaded the model before checking the flags")
    monkeypatch.setattr(C, "load_model", no_load)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)       # a CPU-only machine, on a GPU host too
    base = ["--ckpt", str(ckpt), "--draft", str(ckpt / "draft"), "--quiet"]
    if not {"--prompt", "--prompt-ids", "--prompts"} & set(argv):
        base += ["--prompt-ids", "1"]
    code, out, err = run(capsys, *base, *argv)
    assert one_line_error(code, err, word), err


def test_cache_memory_error_says_how_much(ckpt, capsys):
    code, _, err = run(capsys, "--ckpt", str(ckpt), "--prompt-ids", "1", "--max-seq-len", "1000000000")
    m = re.search(r"need ([\d.]+) GiB, but cpu has ([\d.]+) GiB free", err)
    # 3 layers x (32 + 8) latent + rope floats x 4 bytes x 1e9 slots
    assert code == 2 and m and abs(float(m[1]) - 3 * 40 * 4 * 1e9 / 2**30) < 0.1, err


@pytest.mark.parametrize("argv,word", [
    (["--prompt", "", "--raw"], "empty prompt"),
    (["--prompt-ids", "1,2,9999"], "prompt token ids must lie in [0, 512)"),
    (["--prompt", "x" * 80, "--raw", "--max-seq-len", "40"], "does not fit the cache (--max-seq-len 40)"),
])
def test_generation_errors_are_one_line(ckpt, capsys, argv, word):
    code, out, err = run(capsys, "--ckpt", str(ckpt), "--quiet", *argv)
    assert one_line_error(code, err, word), err


def test_missing_checkpoint_from_the_shell():
    """The process itself: exit code 2 and one line, no traceback."""
    r = subprocess.run([sys.executable, "generate.py", "--ckpt", "/nonexistent/path"], cwd=ROOT, env=CPU_ENV,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert one_line_error(r.returncode, r.stderr, "/nonexistent/path: no such checkpoint directory"), r.stderr


def test_checkpoint_errors(ckpt, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{oops")
    code, _, err = run(capsys, "--ckpt", str(tmp_path), "--tokenizer", str(ckpt), "--prompt-ids", "1")
    assert one_line_error(code, err, "config.json") and "not valid JSON" in err
    # a drafter built for another target: rejected before any compute, naming the field
    other = tmp_path / "bad_draft"
    cfg = C.tiny_draft_config(C.model_args(tiny.text_config(vocab_size=VOCAB)))
    cfg["dflash_config"]["target_layer_ids"] = [0, 7]
    other.mkdir()
    (other / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "--ckpt", str(ckpt), "--draft", str(other), "--prompt-ids", "1", "--quiet")
    assert one_line_error(code, err, "target_layer_ids")


def test_truncated_shard(ckpt, tmp_path, capsys):
    bad = tmp_path / "ck"
    shutil.copytree(ckpt, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    code, _, err = run(capsys, "--ckpt", str(bad), "--prompt-ids", "1", "--quiet")
    assert one_line_error(code, err, shard.name) and "safetensors" in err


def test_nan_weights_name_the_tensor(ckpt, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "nan"
    shutil.copytree(ckpt, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    name = next(k for k, v in tensors.items() if v.is_floating_point() and "layernorm" in k)
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    code, _, err = run(capsys, "--ckpt", str(bad), "--prompt-ids", "1", "--quiet")
    assert one_line_error(code, err, name), err


def test_nan_drafter_weights_name_the_tensor(ckpt, tmp_path, capsys):
    """One NaN in one element of a drafter norm: refused at load, naming the tensor and its file (a drafter may
    cost speed, never a token; the tree would survive its NaN drafts, but a broken file is the user's to know)."""
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "draft"
    shutil.copytree(ckpt / "draft", bad)
    tensors = load_file(bad / "model.safetensors")
    name = next(k for k in tensors if "norm" in k)
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run(capsys, "--ckpt", str(ckpt), "--draft", str(bad), "--prompt-ids", "1,2", "--quiet")
    assert one_line_error(code, err, f"tensor {name} in model.safetensors holds NaN or inf"), err


def test_logits_with_no_token_stop_in_one_line(ckpt, tmp_path, capsys):
    """Finite weights whose logits overflow float32 once divided by the temperature: one line naming the step, the
    position and the temperature, exit 2, instead of token 0 over and over (greedy decodes the same weights)."""
    from safetensors.torch import load_file, save_file
    huge = tmp_path / "huge"
    shutil.copytree(ckpt, huge)
    for shard in huge.glob("model-*.safetensors"):
        tensors = load_file(shard)
        if any(k.endswith("lm_head.weight") for k in tensors):
            name = next(k for k in tensors if k.endswith("lm_head.weight"))
            tensors[name] = tensors[name] * 1e37                      # logits near 1e37: finite
            save_file(tensors, shard, metadata={"format": "pt"})
    argv = ["--ckpt", str(huge), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--quiet"]
    code, out, err = run(capsys, *argv, "--temperature", "0.0001")
    assert one_line_error(code, err, "prefill: the target's logits after position 2 give no token (NaN or inf, or "
                                     "past float32 divided by the temperature 0.0001)"), err
    code, out, err = run(capsys, *argv)
    assert code == 0 and "4 tokens" in out, err


def test_debug_shows_traceback(ckpt, capsys):
    with pytest.raises(ValueError, match="empty prompt"):
        cli.main(["--ckpt", str(ckpt), "--prompt", "", "--raw", "--debug", "--quiet"])


def test_cache_end_stops_cleanly(ckpt, capsys):
    code, out, _ = run(capsys, "--ckpt", str(ckpt), "--draft", str(ckpt / "draft"), "--prompt-ids", "1,2,3",
                       "--max-new-tokens", "100", "--max-seq-len", "30", "--quiet")
    assert code == 0 and "cache full (--max-seq-len 30)" in out


def test_prompts_file_batch(ckpt, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("def f(x):\nclass A:\n\nimport os\n")
    code, out, err = run(capsys, "--ckpt", str(ckpt), "--draft", str(ckpt / "draft"), "--prompts", str(f), "--raw",
                         "--max-new-tokens", "6", "--quiet")
    assert code == 0 and out.count("--- ") == 3 and "3 prompts" in out, err


def test_show_tree(ckpt, capsys):
    """The legend once; then per step its tree followed by the tokens it committed, never streamed text."""
    code, out, _ = run(capsys, "--ckpt", str(ckpt), "--draft", str(ckpt / "draft"), "--prompt-ids", "1,2,3",
                       "--budget", "4", "--max-new-tokens", "6", "--show-tree", "--quiet")
    assert code == 0 and out.count(ddtree.LEGEND) == 1
    body = out.split(ddtree.LEGEND)[1].split("\n[6 tokens")[0]
    lines = [line for line in body.splitlines() if line.strip()]
    kinds = ["tree" if re.match(r"[* ] .*\[\d+\] |  bonus ", line) else "committed" if line.startswith("committed: ")
             else line for line in lines]
    assert set(kinds) == {"tree", "committed"}, kinds              # nothing else in between
    assert kinds[0] == "committed" and kinds[-1] == "committed"     # the prefill's token; the last step's tokens
    steps = "".join("t" if k == "tree" else "c" for k in kinds)
    assert re.fullmatch(r"c(t+c)+", steps) and any(line.startswith("*") for line in lines)


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    for flag, default in [("--budget", "8"), ("--max-new-tokens", "200"), ("--max-seq-len", "4096"),
                          ("--temperature", "0.0"), ("--top-k", "0"), ("--top-p", "1.0"), ("--seed", "0")]:
        assert f"(default: {default})" in out.split(f" {flag} ")[1].split(" --")[0], flag
    assert "terminal on stdin starts a chat" in out and "code model, not an assistant" in out
    assert all(a.help for a in cli.build_parser()._actions)


class Terminal:
    def isatty(self):
        return True


def test_no_prompt_and_a_terminal_chats_with_the_bundled_model(monkeypatch, capsys):
    lines = iter(["def fib(n):", "/exit"])
    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    code, out, err = run(capsys, "--max-new-tokens", "3", "--quiet")
    assert code == 0, err
    assert "[chat:" in out and "code model, not an assistant" in out and "3 tokens" in out


def test_other_stdin_is_the_prompt(ckpt, monkeypatch, capsys):
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):"))
    code, out, _ = run(capsys, "--ckpt", str(ckpt), "--raw", "--max-new-tokens", "4", "--quiet")
    assert code == 0 and "]\ndef f(x):" in out and "4 tokens" in out and "[chat:" not in out


def test_system_and_thinking_reach_the_template(ckpt, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(G, "generate", lambda target, ids, *a, **k: seen.append(ids) or [])
    tok = Tokenizer.from_dir(ckpt)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    # transformers renders the same template file: the CLI's prompt is that string, token for token
    from tokenizers import Tokenizer as HFTokenizer, models
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                 unk_token="[UNK]")
    hf.chat_template = tok.chat_template
    for flags, kw in [([], {}), (["--thinking"], {"thinking": True}), (["--no-thinking"], {"thinking": False})]:
        assert cli.main(["--ckpt", str(ckpt), "--prompt", "hi", "--system", "be brief", "--quiet", *flags]) == 0
        assert seen[-1] == tok.apply_chat_template(msgs, **kw), flags
        assert tok.decode(seen[-1]) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    assert seen[1] != seen[2] and "be brief" in tok.decode(seen[0])


def test_interactive_session(monkeypatch, capsys):
    """Multi-turn through the template: history kept (reasoning apart), the system message survives /reset,
    Ctrl-C abandons only the current answer, /exit ends."""
    lines = iter(["hello", "again", "/reset", "boom", "after", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    seen = []

    class Tok:
        stop_ids = {0}

        def apply_chat_template(self, history, **kw):
            seen.append(([dict(m) for m in history], kw))
            return [1]

        def decode(self, ids):
            return "plan</think> ok"

    def run(ids):
        if seen[-1][0][-1]["content"] == "boom":
            raise KeyboardInterrupt
        return [5, 0]
    system = [{"role": "system", "content": "S"}]
    cli.interactive(Tok(), run, {"thinking": True}, system)
    answer = {"role": "assistant", "content": "ok", "reasoning_content": "plan"}
    contents = [[m["content"] for m in h] for h, _ in seen]
    assert contents == [["S", "hello"], ["S", "hello", "ok", "again"], ["S", "boom"], ["S", "after"]]
    assert seen[1][0][2] == answer and all(kw == {"thinking": True} for _, kw in seen)
    assert "[interrupted]" in capsys.readouterr().out


def test_interactive_eof_ends(monkeypatch):
    def eof(prompt=""):
        raise EOFError
    monkeypatch.setattr("builtins.input", eof)
    cli.interactive(None, None, {})       # returns cleanly


def test_torchrun_drafter_error_once(ckpt, tmp_path):
    """2 ranks (gloo) and a drafter whose 3 kv heads don't split in 2: the error once, from rank 0, and no
    torchrun traceback."""
    cfg = C.tiny_draft_config(C.model_args(str(ckpt)), num_attention_heads=6, num_key_value_heads=3)
    odd = dflash.DFlashDrafter(C.draft_args(cfg))
    C.write_drafter(str(tmp_path / "odd"), odd.state_dict(), cfg)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "generate.py", "--ckpt", str(ckpt), "--draft", str(tmp_path / "odd"), "--prompt-ids", "1,2",
                        "--device", "cpu", "--quiet"], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=300)
    both = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in both and both.count("error:") == 1, both
    assert "does not divide drafter num_key_value_heads=3" in r.stderr


@pytest.mark.parametrize("argv", [[], ["--help"]])
def test_kernels_script_on_cpu_points_elsewhere(argv):
    r = subprocess.run([sys.executable, "kernels.py", *argv], cwd=ROOT, env=CPU_ENV, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=300)
    text = (r.stdout + r.stderr).strip()
    assert r.returncode in (0, 2) and "Traceback" not in text and len(text.splitlines()) == 1, text
    assert "bench.py" in text
