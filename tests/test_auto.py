"""--budget auto: the controller (generate.AutoBudget) and the one Step that runs any budget. Greedy auto == greedy
autoregressive token for token, whatever budgets it switches between; the drafter's context stays complete across
one-token steps; sampling keeps the target's distribution; the loop adds no host read; the controller moves to one
token per step when drafts are never accepted and stays on a tree when they are.
Run: python -m pytest -q tests/test_auto.py"""
import itertools
import sys
import types

import pytest
import torch

import draft as D
import generate as G
import tiny
from test_generate import StubDrafter

PROMPT = [7, 3, 9, 1, 4]


@pytest.fixture(scope="module")
def target():
    return tiny.random_model(tiny.text_config(), seed=11)


@pytest.fixture(scope="module")
def drafter(target):
    d = D.DFlashDrafter(D.DraftArgs.from_config(D.tiny_draft_config(target.args)))   # block_size 4
    tiny.randomize_(d, seed=5, std=0.3)
    return d


@pytest.fixture(scope="module")
def ar(target):
    return G.generate(target, PROMPT, 80, max_seq_len=160)


def script(monkeypatch, budgets):
    """AutoBudget.pick follows `budgets` (cycled; one token where a budget does not fit the cache)."""
    it = itertools.cycle(budgets)
    monkeypatch.setattr(G.AutoBudget, "pick", lambda self, fits: (lambda b: b if b in fits else 0)(next(it)))


# one-token streaks longer than ctx_feats' 4 blocks (a feed), a draft after more than a block of them (a feed
# first), every budget after every other
SCRIPT = [0] * 20 + [4] + [0] * 6 + [16, 8, 0, 16, 0, 0, 4, 8, 8, 0]


def test_greedy_auto_equals_autoregressive_and_keeps_the_drafter_context(target, drafter, ar, monkeypatch):
    """Switching budgets between steps commits the autoregressive tokens, and after the run the drafter's cache holds
    the K/V of every committed position (and ctx_feats the pending ones) as if computed from the whole sequence:
    one-token steps feed it too."""
    script(monkeypatch, SCRIPT)
    G.Step.cache.clear()
    st = G.Stats()
    assert G.generate(target, PROMPT, 80, drafter=drafter, budget="auto", max_seq_len=160, stats=st) == ar
    (step,) = G.Step.cache.values()
    assert set(st.budgets) == {0, 4, 8, 16} and "feed" in step.ran
    ctx_len, n_ctx = int(step.ctx_len[0]), int(step.n_ctx[0])
    seq = PROMPT + ar[:-1]                                   # every token whose KV the target has cached
    assert ctx_len + n_ctx == len(seq)
    with torch.no_grad():
        _, hidden = target(torch.tensor([seq]), hidden_layers=step.taps)            # [1, T, taps*D]
        got = drafter.ctx_cache[:, :, :1, :ctx_len].clone()
        drafter.append_context(hidden[:, :ctx_len], 0)                             # the reference rows
    assert torch.allclose(got, drafter.ctx_cache[:, :, :1, :ctx_len], atol=1e-4)
    assert torch.allclose(step.ctx_feats[0, :n_ctx], hidden[0, ctx_len:], atol=1e-4)


def test_auto_batch_and_cache_end(target, drafter, ar, monkeypatch):
    """A batch under the scripted switches decodes each row as alone, and near the cache end auto keeps to the
    budgets that fit, then one token per step."""
    script(monkeypatch, SCRIPT)
    prompts = [PROMPT, [2, 7, 1], [5] * 9]
    alone = [G.generate(target, p, 80, max_seq_len=50) for p in prompts]
    st = G.Stats()
    assert G.generate_batch(target, prompts, 80, drafter=drafter, budget="auto", max_seq_len=50, stats=st) == alone
    assert all(len(p) + len(o) == 51 for p, o in zip(prompts, alone)) and "cache full" in st.stopped


@pytest.mark.parametrize("drafts", ["random", "perfect"])
def test_greedy_auto_with_the_real_controller(target, ar, drafts):
    """The unscripted controller, with drafts never or always right: still the autoregressive tokens."""
    G.Step.cache.clear()
    stub = StubDrafter(drafts, 96, reference=PROMPT + ar)
    assert G.generate(target, PROMPT, 80, drafter=stub, budget="auto", max_seq_len=160) == ar


def test_auto_sampling_keeps_the_target_distribution(target, drafter, monkeypatch):
    """At temperature 1 (top-3) many rows of one prompt decode together while the step switches between trees and
    one token: the first committed tokens follow the target's own conditionals, given the tokens before them
    (chi-square on every context with enough rows)."""
    script(monkeypatch, [16, 0, 4, 0, 8])
    rows, prompt, topk = 1500, [3, 1, 4, 1, 5], 3
    outs = G.generate_batch(target, [prompt] * rows, 4, drafter=drafter, budget="auto", temperature=1.0,
                            top_k=topk, max_seq_len=32, seed=1)
    checked = 0
    for depth in (1, 2, 3):
        groups = {}
        for o in outs:
            groups.setdefault(tuple(o[:depth]), []).append(o[depth])
        for ctx, nxt in groups.items():
            if len(nxt) < 150:
                continue
            with torch.no_grad():
                logits = target(torch.tensor([prompt + list(ctx)]))[0, -1]                # [V]
            kth = logits.topk(topk).values[-1]
            p = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
            freq = torch.bincount(torch.tensor(nxt), minlength=p.numel()).float()
            assert freq[p == 0].sum() == 0, ctx
            e = p[p > 0] * len(nxt)
            chi2 = ((freq[p > 0] - e) ** 2 / e).sum()
            assert chi2 < 16.3, (ctx, freq[p > 0], e)          # 2 dof: p < 0.0003
            checked += 1
    assert checked >= 4
    G.Step.cache.clear()                                       # the 1500-row caches


def test_auto_adds_no_host_read(target, drafter, monkeypatch):
    """The loop reads the device once per step (the committed tokens) and once for the first token, whatever auto
    picks; eager mode's stage clock syncs after each stage, the others once per step, as for a fixed budget.
    Counted on a clock that believes it runs on CUDA, and on every host read made from generate.py."""
    syncs, reads = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    init = G._Clock.__init__

    def cuda_clock(self, device, stats):
        init(self, device, stats)
        self.cuda = True
    monkeypatch.setattr(G._Clock, "__init__", cuda_clock)
    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__"):
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name):
            if sys._getframe(1).f_code.co_filename == G.__file__:
                reads.append(_name)
            return _orig(self, *a)
        monkeypatch.setattr(torch.Tensor, name, spy)
    script(monkeypatch, SCRIPT)
    for mode in ("eager", "static"):
        syncs.clear(), reads.clear()
        st = G.Stats()
        G.generate(target, PROMPT, 60, drafter=drafter, budget="auto", max_seq_len=160, stats=st, mode=mode)
        steps = sum(st.budgets.values())
        per_step = sum(k * (4 if b else 1) for b, k in st.budgets.items()) if mode == "eager" else steps
        assert len(syncs) == 2 + per_step, mode                       # + prefill and the final lap
        assert reads == ["tolist"] * (1 + steps), (mode, reads)


def test_controller_leaves_a_tree_that_loses_and_comes_back(monkeypatch):
    """Synthetic feeds: each budget once first; on text where drafts are never accepted one token per step, with
    rare probes of the trees; when the text gets easier the probes see it, and a tree takes over."""
    c = G.AutoBudget((0, 4, 8))
    cost = {0: 1.0, 4: 1.5, 8: 1.8}

    def run(steps, tokens):
        picks = []
        for _ in range(steps):
            picks.append(c.pick([0, 4, 8]))
            c.observe(picks[-1], tokens[picks[-1]], cost[picks[-1]])
        return picks
    hard = run(600, {0: 1, 4: 1, 8: 1})
    assert hard[:3] == [0, 4, 8]
    assert hard[100:].count(0) / 500 > 0.97 and {4, 8} <= set(hard[100:])       # probes, rare
    easy = run(600, {0: 1, 4: 3, 8: 4.5})                                        # 8: 2.5 tokens/s, 4: 2, AR: 1
    assert easy[-300:].count(8) / 300 > 0.9
    # a stretch of hard text: one token per step, the tree probed often (its record is good); then back to it soon
    hard = run(150, {0: 1, 4: 1, 8: 1})
    assert hard[-75:].count(0) / 75 > 0.7
    easy = run(100, {0: 1, 4: 3, 8: 4.5})
    assert easy[25:].count(8) / 75 > 0.9


@pytest.mark.parametrize("drafts", ["adversarial", "perfect"])
def test_loop_moves_to_one_token_when_drafts_fail(target, ar, drafts, monkeypatch):
    """Through the loop, on a clock where a tree step costs 1.5-1.8 one-token steps: drafts never accepted (the true
    token ranked last) -> one token per step after the first tries; drafts always right -> a tree."""
    now = [0.0]
    monkeypatch.setattr(G, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    run = G.Step.run

    def timed(self, budget, hook=None):
        now[0] += 1.0 if budget == 0 else 1.5 + budget / 50
        run(self, budget, hook)
    monkeypatch.setattr(G.Step, "run", timed)
    G.Step.cache.clear()
    st = G.Stats()
    stub = StubDrafter(drafts, 96, reference=PROMPT + ar)
    assert G.generate(target, PROMPT, 80, drafter=stub, budget="auto", max_seq_len=160, stats=st) == ar
    share = st.budgets[0] / sum(st.budgets.values())
    assert share > 0.9 if drafts == "adversarial" else share < 0.1, st.budgets


def test_controller_times_a_budget_from_its_second_run():
    """A step that compiled or captured a graph is not timed: its budget runs again before the controller trusts
    it; the first choice among what fits."""
    c = G.AutoBudget((0, 4))
    c.observe(0, 1, 0.01)
    c.observe(4, 3, 9.0, timed=False)                  # a capture
    assert c.pick([0, 4]) == 4 and c.pick([0]) == 0
    c.observe(4, 3, 0.02)
    assert c.pick([0, 4]) == 4                         # 150 tokens/s against 100


def test_bench_e2e_reports_auto_beside_fixed_budgets(capsys):
    """bench.py e2e --budgets auto,4: an auto row (lossless when greedy) with the budget mix it chose."""
    import bench
    res = bench.main(["e2e", "--device", "cpu", "--budgets", "auto,4", "--n-prompts", "1", "--max-new-tokens", "12",
                      "--warmup", "2", "--temperature", "0", "--no-chain"])
    printed = capsys.readouterr().out
    runs = res["e2e"]["runs"]
    assert [(r["mode"], r["budget"]) for r in runs] == [("ar", None), ("auto", None), ("ddtree", 4)]
    auto = runs[1]
    assert auto["lossless"] is True and auto["tokens"] == 11
    shares = dict(x.split(":") for x in auto["budget_mix"].split())
    assert set(shares) <= {str(b) for b in G.AUTO_BUDGETS} and 99 <= sum(int(v[:-1]) for v in shares.values()) <= 101
    assert f"auto at temperature 0: steps per budget {auto['budget_mix']}" in printed


def test_cli_budget_auto(monkeypatch):
    p = G.build_parser()
    assert p.parse_args(["--budget", "auto"]).budget == "auto" and p.parse_args(["--budget", "4"]).budget == 4
    with pytest.raises(ValueError, match="--budget"):
        p.parse_args(["--budget", "many"])
    a = p.parse_args(["--budget", "auto", "--chain", "--prompt", "x"])
    with pytest.raises(ValueError, match="--chain with --budget auto"):
        G.check_args(a)
    a = p.parse_args(["--budget", "auto", "--trace", "t.html", "--prompt", "x"])
    with pytest.raises(ValueError, match="--trace with --budget auto"):
        G.check_args(a)
