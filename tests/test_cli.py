"""generate.py as a user runs it: a tiny K2.6-layout checkpoint with a Kimi-layout tokenizer; every user
mistake gives one line naming the culprit and a non-zero exit, never a traceback (unless --debug).
Run: python -m pytest -q tests/test_cli.py"""
import json

import pytest

import draft as D
import generate as G
import model as M
import tiny
from tokenizer import KIMI_SPECIAL_TOKENS, write_tiktoken_model, write_tokenizer_config

VOCAB = 512     # 256 byte tokens + 256 special ids, as the real K2.6 layout (163584 + 256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    ref = tiny.write_k26(d, tiny.text_config(vocab_size=VOCAB), seed=9)
    write_tiktoken_model(d / "tiktoken.model", {bytes([i]): i for i in range(256)})
    write_tokenizer_config(d / "tokenizer_config.json", KIMI_SPECIAL_TOKENS(256))
    dd = d / "draft"
    D.write_drafter(str(dd), D.DFlashDrafter(D.DraftArgs.from_config(D.tiny_draft_config(ref.args))).state_dict(),
                    D.tiny_draft_config(ref.args))
    return d


def run(capsys, *argv):
    code = G.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generates_and_reports(ckpt, capsys):
    code, out, err = run(capsys, "--ckpt", str(ckpt), "--draft", str(ckpt / "draft"), "--prompt", "def f(x):",
                         "--raw", "--max-new-tokens", "12", "--quiet")
    assert code == 0
    assert "tok/s" in out and "mean accept length" in out and "peak host RSS" in out
    code, out, _ = run(capsys, "--ckpt", str(ckpt), "--prompt-ids", "1,2,3", "--budget", "0", "--max-new-tokens", "5",
                       "--quiet")
    assert code == 0 and "5 tokens" in out


@pytest.mark.parametrize("argv,word", [
    (["--prompt", "", "--raw"], "empty prompt"),
    (["--prompt-ids", "1,2,9999"], "prompt token ids must lie in [0, 512)"),
    (["--prompt", "x" * 80, "--raw", "--max-seq-len", "40"], "does not fit the cache (--max-seq-len 40)"),
    (["--prompt-ids", "1,2", "--cuda-graph", "--compile", "--device", "cpu"], "--cuda-graph needs a CUDA device"),
])
def test_generation_errors_are_one_line(ckpt, capsys, argv, word):
    code, out, err = run(capsys, "--ckpt", str(ckpt), "--quiet", *argv)
    assert code == 2 and word in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag,value,word", [("--budget", "-1", "--budget"), ("--temperature", "-0.5", "--temperature"),
                                             ("--top-p", "0", "--top-p"), ("--top-p", "1.5", "--top-p"),
                                             ("--budget", "5000", "--budget")])
def test_bad_flags(ckpt, capsys, flag, value, word):
    with pytest.raises(SystemExit) as e:
        G.main(["--ckpt", str(ckpt), flag, value])
    assert e.value.code == 2 and word in capsys.readouterr().err


def test_checkpoint_errors(ckpt, tmp_path, capsys):
    code, _, err = run(capsys, "--ckpt", str(tmp_path / "nope"), "--prompt-ids", "1")
    assert code == 2 and "nope" in err
    (tmp_path / "config.json").write_text("{oops")
    code, _, err = run(capsys, "--ckpt", str(tmp_path), "--tokenizer", str(ckpt), "--prompt-ids", "1")
    assert code == 2 and "config.json" in err and "not valid JSON" in err
    # a drafter built for another target: rejected before any compute, naming the field
    other = tmp_path / "bad_draft"
    cfg = D.tiny_draft_config(M.ModelArgs.from_config(tiny.text_config(vocab_size=VOCAB)))
    cfg["dflash_config"]["target_layer_ids"] = [0, 7]
    (other).mkdir()
    (other / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "--ckpt", str(ckpt), "--draft", str(other), "--prompt-ids", "1", "--quiet")
    assert code == 2 and "target_layer_ids" in err


def test_debug_shows_traceback(ckpt, capsys):
    with pytest.raises(ValueError, match="empty prompt"):
        G.main(["--ckpt", str(ckpt), "--prompt", "", "--raw", "--debug", "--quiet"])


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
    code, out, _ = run(capsys, "--ckpt", str(ckpt), "--draft", str(ckpt / "draft"), "--prompt-ids", "1,2,3",
                       "--budget", "4", "--max-new-tokens", "4", "--show-tree", "--quiet")
    assert code == 0 and "*" in out           # each step's tree with the accepted path marked


def test_interactive_session(monkeypatch, capsys):
    """Multi-turn: history kept, /reset clears it, Ctrl-C abandons only the current answer, /exit ends."""
    lines = iter(["hello", "again", "/reset", "boom", "after", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    seen = []

    class Tok:
        stop_ids = {0}

        def apply_chat_template(self, history, thinking=False):
            seen.append([m["content"] for m in history])
            return [1]

        def decode(self, ids):
            return "ok"

    def run(ids):
        if seen[-1][-1] == "boom":
            raise KeyboardInterrupt
        return [5, 0]
    G.interactive(Tok(), run, thinking=False)
    assert seen == [["hello"], ["hello", "ok", "again"], ["boom"], ["after"]]
    assert "[interrupted]" in capsys.readouterr().out


def test_interactive_eof_ends(monkeypatch):
    def eof(prompt=""):
        raise EOFError
    monkeypatch.setattr("builtins.input", eof)
    G.interactive(None, None, thinking=False)       # returns cleanly


def test_truncated_shard(ckpt, tmp_path, capsys):
    import shutil
    bad = tmp_path / "ck"
    shutil.copytree(ckpt, bad)
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    code, _, err = run(capsys, "--ckpt", str(bad), "--prompt-ids", "1", "--quiet")
    assert code == 2 and shard.name in err and "safetensors" in err
