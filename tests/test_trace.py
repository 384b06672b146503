"""--trace: the page a run writes (trace_page.py) with the bundled tiny model on the CPU. It parses as HTML with balanced
tags, holds one tree per step with the step's node count, highlights the path the step committed, and shows token
text as text (a token holding `<script>` or `&` cannot become markup).
Run: python -m pytest -q tests/test_trace.py"""
from collections import Counter
from html.parser import HTMLParser

import pytest
import torch

import checkpoint as C
import cli
import draft as dflash
import generate as G
from tokenizer import Tokenizer
from trace_page import Trace

VOID = {"meta", "br", "hr", "img", "input", "link"}      # HTML elements with no end tag


class Page(HTMLParser):
    """The parts of a trace page the tests read, with a check that every element is closed in order."""

    def __init__(self, text: str):
        super().__init__()
        self.in_target_line = False
        self.stack, self.tags, self.trees, self.data, self.target_lines = [], Counter(), [], [], []
        self.feed(text)
        self.close()
        assert not self.stack, f"unclosed elements: {self.stack}"

    def handle_starttag(self, tag, attrs):
        a, self.tags[tag] = dict(attrs), self.tags[tag] + 1
        if tag not in VOID:
            self.stack.append(tag)
        cls = (a.get("class") or "").split()
        self.in_target_line = tag == "text" and "v" in cls       # a node's "→ token p": the target's
        if tag == "svg" and "tree" in cls:
            self.trees.append(dict(nodes=int(a["data-nodes"]), drawn=[], path=[], stop=[], bonus=None))
        elif tag == "g" and "n" in cls:
            node = (int(a["data-i"]), int(a["data-tok"]))
            self.trees[-1]["drawn"].append(node)
            self.trees[-1]["path"] += [node] if "acc" in cls else []
            self.trees[-1]["stop"] += [node] if "stop" in cls else []
        elif tag == "g" and "bonus" in cls:
            self.trees[-1]["bonus"] = int(a["data-tok"])

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()

    def handle_data(self, data):
        self.data.append(data)
        if self.in_target_line:
            self.target_lines.append(data)


@pytest.fixture(scope="module")
def pair():
    cpu = torch.device("cpu")
    target = C.load_model(G.BUNDLED_TARGET, cpu, torch.float32, progress=False)
    return target, C.load_drafter(G.BUNDLED_DRAFT, target.args, cpu, torch.float32), \
        Tokenizer.from_dir(G.BUNDLED_TARGET)


def traced(pair, decode=None, temperature=0.0, budget=6, prompt="def fib(n):", n=12):
    """A traced run: the page, the parsed page, each step's (committed tokens, valid node count), the output."""
    target, drafter, tok = pair
    seen = []
    trace = Trace(decode or tok.decode, {"budget": budget, "temperature": temperature},
                  then=lambda b, view, new: seen.append((list(new), int(view.tree.valid[b].sum()))))
    prompt_ids, stats = tok.encode(prompt), G.Stats()
    trace.begin([prompt_ids], stats)
    out = G.generate(target, prompt_ids, n, drafter, budget=budget, temperature=temperature, seed=1,
                     on_step=trace.on_step, stats=stats, max_seq_len=128)
    page = trace.page()
    return page, Page(page), seen, out


def test_one_tree_per_step_with_the_committed_path(pair):
    page, p, seen, out = traced(pair)
    assert len(seen) >= 3 and len(p.trees) == len(seen) and p.tags["details"] == len(seen) + 2   # + legend, prompt
    assert out[1:] == [t for new, _ in seen for t in new][:len(out) - 1]     # the run's output, step by step
    for tree, (new, n_valid) in zip(p.trees, seen):
        assert tree["nodes"] == n_valid == len(tree["drawn"]) and [i for i, _ in tree["drawn"]] == list(range(n_valid))
        path = sorted(tree["path"])
        assert path[0][0] == 0 and tree["stop"] == [path[-1]]               # from the root to where the walk stopped
        assert [t for _, t in path[1:]] + [tree["bonus"]] == new           # the path's tokens, then the bonus
    assert any(len(new) > 1 for new, _ in seen)                             # some step accepted a drafted token
    assert "mean accept length" in page and "budget <b>6</b>" in page and "temperature <b>0.0</b>" in page


def test_token_text_is_escaped(pair):
    page, p, seen, _ = traced(pair, decode=lambda ids: "".join(f"<script>x{t}</script>&amp;" for t in ids), n=6)
    assert p.tags["script"] == 1 and page.count("<script") == 1          # the page's own navigation script only
    text = "".join(p.data)
    tok = seen[0][0][-1]                                                    # the first step's bonus
    assert f"<script>x{tok}</script>&amp;" in text                          # shown as text, once unescaped
    assert "&amp;amp;" in page and "&lt;script&gt;" in page


def test_temperature_shows_the_sampled_tokens(pair):
    page, p, seen, out = traced(pair, temperature=1.0, n=10)
    assert len(p.trees) == len(seen) >= 2 and "temperature <b>1.0</b>" in page
    for tree, (new, n_valid) in zip(p.trees, seen):
        path = sorted(tree["path"])
        assert tree["nodes"] == n_valid and [t for _, t in path[1:]] + [tree["bonus"]] == new
    probs = [float(line.split()[-1]) for line in p.target_lines]
    assert len(probs) == sum(n for _, n in seen) and all(0 < q <= 1 for q in probs)


def test_cli_writes_the_page(tmp_path, capsys):
    """One prompt, and a --prompts batch (one section per prompt); a bad --trace fails before loading."""
    one, many = tmp_path / "one.html", tmp_path / "many.html"
    assert cli.main(["--raw", "--prompt", "def f(x):", "--max-new-tokens", "5", "--budget", "4", "--quiet",
                   "--trace", str(one)]) == 0
    p = Page(one.read_text())
    assert len(p.trees) >= 1 and p.tags["section"] == 1
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nimport os\n")
    assert cli.main(["--raw", "--prompts", str(prompts), "--max-new-tokens", "5", "--budget", "4", "--quiet",
                   "--trace", str(many)]) == 0
    p = Page(many.read_text())
    assert p.tags["section"] == 2 and p.tags["h2"] == 2 and len(p.trees) >= 2
    capsys.readouterr()
    for argv, word in [(["--trace", str(tmp_path / "no" / "x.html")], "no such directory"),
                       (["--trace", str(one), "--budget", "0"], "--trace needs a drafter")]:
        assert cli.main(["--prompt", "x", "--quiet"] + argv) == 2
        err = capsys.readouterr().err
        assert word in err and len(err.strip().splitlines()) == 1, err
