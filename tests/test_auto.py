"""--budget auto (autobudget.py): AutoBudget picks, before each step, a tree of AUTO_BUDGET nodes or one token, and
AutoStep.catch_up gives the drafter the tokens it missed (a block at most) before a tree that follows one-token steps.
Greedy auto == greedy autoregressive token for token, whatever the switches (scripted or the real controller),
alone, in a batch and at the cache end; catch_up's context rows are the target's own hidden states on the missed
tokens; sampling keeps the target's distribution; the loop adds no host read; the controller moves to one token
per step when trees never pay, probes rarely, and hands back to trees when they pay; bench.py e2e reports auto
beside the fixed budgets; the CLI takes --budget auto and refuses it with --chain and --trace.
Run: python -m pytest -q tests/test_auto.py"""
import itertools
import sys
import types

import pytest
import torch

import autobudget as A
import checkpoint as C
import cli
import draft as dflash
import generate as G
import runner
import tiny
from test_generate import StubDrafter, count_syncs

PROMPT = [7, 3, 9, 1, 4]
T, F = True, False
# a first one-token stretch longer than the block (4), trees right after trees, stretches shorter than a block
# (1, 2: the drafter then takes just them) and of a block and more (4, 6: it takes the last block)
SCRIPT = [F] * 9 + [T, T, T, F, T, F, F, T, T, F, F, F, F, T, F, F, F, F, F, F, T]


@pytest.fixture(scope="module")
def target():
    return tiny.random_model(tiny.text_config(), seed=11)


@pytest.fixture(scope="module")
def drafter(target):
    d = dflash.DFlashDrafter(C.draft_args(C.tiny_draft_config(target.args)))   # block_size 4
    tiny.randomize_(d, seed=5, std=0.3)
    return d


@pytest.fixture(scope="module")
def ar(target):
    return G.generate(target, PROMPT, 80, max_seq_len=160)


def script(monkeypatch, picks):
    """AutoBudget.tree follows `picks` (cycled; True: a tree); observe stays the real one."""
    it = itertools.cycle(picks)
    monkeypatch.setattr(A.AutoBudget, "tree", lambda self: next(it))


def spy_steps(monkeypatch):
    """Records, in order, each step the loop runs (True: a tree) and the state right after each catch_up the loop
    runs (not the rehearsal when AutoStep is made): (start, recent, ctx_feats, new_ctx_len), cloned."""
    kinds, catch_ups, rehearsing = [], [], [False]
    run, catch_up, init = G.Step.run, A.AutoStep.catch_up, A.AutoStep.__init__

    def step_run(self, fn, hook=None):
        kinds.append(fn.__name__ == "tree_step")
        return run(self, fn, hook)

    def tapped(self, hook=None):
        catch_up(self, hook)
        if not rehearsing[0]:
            s = self.step.state
            catch_ups.append(tuple(t.clone() for t in (s.start, self.recent, s.ctx_feats, s.new_ctx_len)))

    def tracked_init(self, step):
        rehearsing[0] = True
        try:
            init(self, step)
        finally:
            rehearsing[0] = False
    monkeypatch.setattr(G.Step, "run", step_run)
    monkeypatch.setattr(A.AutoStep, "catch_up", tapped)
    monkeypatch.setattr(A.AutoStep, "__init__", tracked_init)
    return kinds, catch_ups


@pytest.mark.quick
def test_greedy_scripted_switches_equal_autoregressive(target, drafter, ar, monkeypatch):
    """Trees and one-token stretches in any order commit the autoregressive tokens; a catch_up runs before each tree
    that follows one-token steps (and only then), over the last block of committed tokens, and leaves in ctx_feats
    the target's uncached hidden states on the tokens the stretch committed (a block at most): new_ctx_len of them."""
    script(monkeypatch, SCRIPT)
    kinds, catch_ups = spy_steps(monkeypatch)
    kept = runner.Steps()
    st = G.Stats()
    assert G.generate(target, PROMPT, 80, drafter=drafter, budget="auto", max_seq_len=160, stats=st, steps=kept) == ar
    assert set(st.budgets) == {0, G.AUTO_BUDGET} and sum(st.budgets.values()) == len(kinds)
    assert st.budgets[0] == kinds.count(False) and st.budgets[G.AUTO_BUDGET] == kinds.count(True)
    assert len(catch_ups) == sum(cur and not prev for prev, cur in zip(kinds, kinds[1:])) >= 5
    (step,) = kept.values()
    bs, seq = drafter.block_size, PROMPT + ar
    with torch.no_grad():
        _, hidden = target(torch.tensor([seq]), hidden_layers=step.taps)                 # [1, T, taps*D]
    missed, gap = [], 0                                   # one-token steps before each catch_up, a block at most
    for prev, cur in zip([True] + kinds, kinds):
        if cur and not prev:
            missed.append(min(gap, bs))
        gap = 0 if cur else gap + 1
    assert [int(c[3][0]) for c in catch_ups] == missed and min(missed) < bs == max(missed)
    for start, recent, ctx_feats, n_new in catch_ups:
        s, n = int(start[0]), int(n_new[0])               # committed cache length: the window is seq[s - bs:s]
        assert recent[0].tolist() == seq[s - bs:s]
        assert torch.allclose(ctx_feats[0, :n], hidden[0, s - n:s], atol=1e-4), s


def test_auto_batch_short_prompt_and_cache_end(target, drafter, monkeypatch):
    """A batch of three prompt lengths under scripted switches decodes each row as alone (autoregressive), through
    the cache end (each row stops there, one token a step once a tree no longer fits). Its 2-token prompt meets a
    catch_up with fewer committed tokens than a block (the window padded, at position 0)."""
    script(monkeypatch, [F, T, T] + [F] * 6 + [T, F, F, T, T] + [F] * 5 + [T])
    kinds, catch_ups = spy_steps(monkeypatch)
    prompts = [PROMPT, [2, 7], [5] * 9]
    alone = [G.generate(target, p, 80, max_seq_len=50) for p in prompts]
    kept = runner.Steps()
    st = G.Stats()
    assert G.generate_batch(target, prompts, 80, drafter=drafter, budget="auto", max_seq_len=50, stats=st,
                            steps=kept) == alone
    assert all(len(p) + len(o) == 51 for p, o in zip(prompts, alone)) and "cache full" in st.stopped
    assert set(st.budgets) == {0, G.AUTO_BUDGET} and catch_ups
    start, recent, _, _ = catch_ups[0]                    # after one token: row 1 holds 3 tokens, padded with 0
    assert int(start[1]) == 3 and recent[1].tolist() == [2, 7, alone[1][0], 0]


@pytest.mark.parametrize("drafts", ["random", "perfect"])
def test_greedy_auto_with_the_real_controller(target, ar, drafts):
    """The unscripted controller, with drafts never or always right: still the autoregressive tokens."""
    kept = runner.Steps()
    stub = StubDrafter(drafts, 96, reference=PROMPT + ar)
    st = G.Stats()
    assert G.generate(target, PROMPT, 80, drafter=stub, budget="auto", max_seq_len=160, stats=st, steps=kept) == ar
    assert sum(st.budgets.values()) == len(st.accept_lens) and set(st.budgets) <= {0, G.AUTO_BUDGET}


@pytest.mark.parametrize("drafts", ["adversarial", "perfect"])
def test_loop_moves_to_one_token_when_trees_do_not_pay(target, ar, drafts, monkeypatch):
    """Through the loop, on a clock where a tree step costs 1.5 one-token steps (AutoStep times them on it): drafts
    never accepted (the true token ranked last) -> one token per step after the first tries; drafts always right
    -> a tree every step. Both still the autoregressive tokens."""
    now = [0.0]
    monkeypatch.setattr(A, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    launch = G.Step.launch

    def timed(self, fn, hook=None):
        now[0] += {"tree_step": 1.5, "token_step": 1.0, "catch_up": 0.5}[fn.__name__]
        launch(self, fn, hook)
    monkeypatch.setattr(G.Step, "launch", timed)
    kept = runner.Steps()
    st = G.Stats()
    stub = StubDrafter(drafts, 96, reference=PROMPT + ar)
    assert G.generate(target, PROMPT, 80, drafter=stub, budget="auto", max_seq_len=160, stats=st, steps=kept) == ar
    (step,) = kept.values()
    assert step.auto.control.ratio == pytest.approx(1.5)
    share = st.budgets[0] / sum(st.budgets.values())
    assert share > 0.8 if drafts == "adversarial" else share == 0, st.budgets    # probes: MIN_RUN trees each


def test_auto_sampling_keeps_the_target_distribution(target, drafter, monkeypatch):
    """At temperature 1 (top-3) many rows of one prompt decode together while the step switches between trees and
    one token, a catch_up (it rewrites the window's KV) before the second step's tree: the first
    committed tokens follow the target's own conditionals, given the tokens before them (chi-square on every
    context with enough rows)."""
    script(monkeypatch, [F, T, F, T, T])
    rows, prompt, topk = 1500, [3, 1, 4, 1, 5], 3
    kept = runner.Steps()
    outs = G.generate_batch(target, [prompt] * rows, 4, drafter=drafter, budget="auto", temperature=1.0,
                            top_k=topk, max_seq_len=32, seed=1, steps=kept)
    checked = 0
    for depth in (1, 2, 3):
        groups = {}
        for o in outs:
            groups.setdefault(tuple(o[:depth]), []).append(o[depth])
        for ctx, nxt in groups.items():
            if len(nxt) < 150:
                continue
            with torch.no_grad():
                logits = target(torch.tensor([prompt + list(ctx)])).logits[0, -1]         # [V]
            kth = logits.topk(topk).values[-1]
            p = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
            freq = torch.bincount(torch.tensor(nxt), minlength=p.numel()).float()
            assert freq[p == 0].sum() == 0, ctx
            e = p[p > 0] * len(nxt)
            chi2 = ((freq[p > 0] - e) ** 2 / e).sum()
            assert chi2 < 16.3, (ctx, freq[p > 0], e)          # 2 dof: p < 0.0003
            checked += 1
    assert checked >= 4


def test_auto_adds_no_host_read(target, drafter, monkeypatch):
    """The loop reads the device once per step (the committed tokens) and once for the first token, whatever auto
    picks, catch_up included (its window is a host-to-device write); eager mode's stage clock syncs after each
    stage, the others once per step, as for a fixed budget. Counted on a clock that believes it runs on CUDA, and on
    every host read made from generate.py and autobudget.py, in a call whose Step already has its controller (made by
    a first call)."""
    syncs, reads = count_syncs(monkeypatch), []
    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name):
            if sys._getframe(1).f_code.co_filename in (G.__file__, A.__file__):
                reads.append(_name)
            return _orig(self, *a)
        monkeypatch.setattr(torch.Tensor, name, spy)
    script(monkeypatch, SCRIPT)
    kinds, catch_ups = spy_steps(monkeypatch)
    kept = runner.Steps()
    for mode in ("eager", "static"):
        G.generate(target, PROMPT, 10, drafter=drafter, budget="auto", max_seq_len=160, mode=mode,
                   steps=kept)                                                          # the controller
        syncs.clear(), reads.clear(), kinds.clear(), catch_ups.clear()
        st = G.Stats()
        G.generate(target, PROMPT, 60, drafter=drafter, budget="auto", max_seq_len=160, stats=st, mode=mode, steps=kept)
        steps = sum(st.budgets.values())
        assert catch_ups and set(st.budgets) == {0, G.AUTO_BUDGET}
        per_step = sum(k * (4 if b else 1) for b, k in st.budgets.items()) if mode == "eager" else steps
        assert len(syncs) == 3 + per_step, mode       # + prefill, the lap after attach and the final lap
        assert reads == ["tolist"] * (1 + steps), (mode, reads)


# ---- the controller alone, on synthetic feeds: `tokens` per tree step, one per one-token step


def drive(c, steps, tokens, rows=1):
    """Run c for `steps` steps of `rows` rows on a text where a tree commits `tokens` a row (a one-token step: 1);
    returns the picks and c.since_tree before each pick."""
    picks, gaps = [], []
    for _ in range(steps):
        gaps.append(c.since_tree)
        picks.append(c.tree())
        c.observe(picks[-1], tokens if picks[-1] else 1, rows)
    return picks, gaps


def stretches(picks):
    """Lengths of the runs of one-token steps that end in a tree."""
    return [len(list(g)) for k, g in itertools.groupby(picks[:len(picks) - picks[::-1].index(True)]) if not k]


def test_controller_leaves_trees_that_never_pay():
    """Trees that commit 1 token where a tree costs 1.6 one-token steps: MIN_RUN trees first (nothing known yet),
    then one token per step, with rare probes (MIN_RUN trees each); the stretch doubles to MAX_STRETCH; every stretch
    lasts a block at least, and a tree comes only after a whole block of one-token steps (or none)."""
    c = A.AutoBudget(1.6, 4)
    picks, gaps = drive(c, 2000, 1)
    assert picks[:c.MIN_RUN + 4] == [True] * c.MIN_RUN + [False] * 4
    assert picks[100:].count(False) / 1900 > 0.97 and picks[100:].count(True) >= 3          # probes, rare
    assert c.stretch == c.max_stretch
    runs = stretches(picks)
    assert min(runs) >= c.min_stretch and max(runs) == c.max_stretch and runs == sorted(runs)
    assert all(g == 0 or g >= c.min_stretch for p, g in zip(picks, gaps) if p)


@pytest.mark.parametrize("ratio, rows", [(1.6, 1), (6.8, 1), (40.0, 1), (6.8, 64)])
def test_controller_probes_cost_a_small_share_where_trees_never_pay(ratio, rows):
    """Trees that commit 1 token where a tree costs `ratio` one-token steps (6.8: K2.6 at 64 requests; 1.6: the bundled
    pair at one): once the stretches have grown, the decoding time (a tree counted as `ratio` one-token steps, each
    catch_up as one more tree) stays within PROBE_SHARE of one token a step; at a small ratio the longest stretch is
    MAX_STRETCH (the probes come as often as before), at a large one it is longer, less so for a batch, whose
    probes are one tree each."""
    c = A.AutoBudget(ratio, 16, rows)
    steps = 4 * c.max_stretch
    drive(c, steps, 1, rows)                                         # the stretches grow to max_stretch
    assert c.stretch == c.max_stretch
    assert (c.max_stretch == c.MAX_STRETCH) == (ratio == 1.6)
    assert (c.max_stretch < A.AutoBudget(ratio, 16).max_stretch) == (rows > 1)
    picks, gaps = drive(c, steps, 1, rows)
    probes = sum(1 for p, g in zip(picks, gaps) if p and g > 0)     # each after a stretch: one catch_up
    time = picks.count(False) + ratio * (picks.count(True) + probes)
    assert probes >= 2 and time / steps <= 1 + c.PROBE_SHARE


@pytest.mark.parametrize("rows, run", [(1, 3), (2, 2), (3, 1), (64, 1)])
def test_controller_judges_a_batch_by_its_rows(rows, run):
    """Each row of a batch is a text of its own, one sample of what a tree commits: trees that never pay are left after
    MIN_RUN rows' tree steps (3 steps at one row, 2 at two rows, 1 at three or more), and each probe is as long."""
    c = A.AutoBudget(6.8, 4, rows)
    picks, _ = drive(c, 40, 1, rows)
    assert picks[:run + 4] == [True] * run + [False] * 4
    assert all(n == run for n in (len(list(g)) for k, g in itertools.groupby(picks) if k))


def test_controller_hands_back_to_trees_when_they_pay():
    """After a long stretch of hard text the text gets easy (a tree commits 4): the next probe sees it and trees
    take over; the stretch stays long until trees have paid for a block of steps after the probe, then resets to a
    block."""
    c = A.AutoBudget(1.6, 4)
    drive(c, 2000, 1)
    assert c.stretch == c.max_stretch
    picks, _ = drive(c, 600, 4)
    first = picks.index(True)
    assert first <= c.max_stretch and picks[first:].count(True) / len(picks[first:]) > 0.9
    assert picks[-300:] == [True] * 300 and c.stretch == c.min_stretch
    c = A.AutoBudget(1.6, 4)
    drive(c, 2000, 1)
    while not c.tree():                                   # to the next probe
        c.observe(False, 1)
    for i in range(1 + c.min_stretch):                       # the probe and a block of trees that pay: a reset
        assert c.stretch == c.max_stretch, i
        c.observe(True, 4)
        assert c.tree()
    assert c.stretch == c.min_stretch


def test_controller_one_lucky_probe_does_not_reset_the_stretch():
    """On hard text (trees commit 1, a tree costs 1.6 one-token steps) one probe that happens to commit 4 tokens,
    then trees back to 1: the stretch stays at MAX_STRETCH, and the next stretch is that long."""
    c = A.AutoBudget(1.6, 4)
    drive(c, 2000, 1)
    while not c.tree():
        c.observe(False, 1)
    c.observe(True, 4)                                    # the lucky probe
    while c.tree():                                       # trees on, while the mean still pays
        c.observe(True, 1)
    assert c.stretch == c.max_stretch
    c.observe(False, 1)
    picks, _ = drive(c, 2 * c.max_stretch, 1)
    assert 1 + picks.index(True) >= c.max_stretch


def test_controller_stretches_a_block_after_a_new_prefill():
    """A stretch that runs over into the next call (the controller lives on the Step): attach sets since_tree = 0
    after its prefill; when the stretch's last steps are fewer than a block, one-token steps go on until a block
    of them, so catch_up has a whole block of new tokens."""
    c = A.AutoBudget(1.6, 4)
    drive(c, 12, 1)                       # trees fail (3), a stretch of 4, a probe fails (3): a stretch of 8 begins
    while c.stretch_left != 2:
        assert not c.tree()
        c.observe(False, 1)
    c.since_tree = 0                                             # a new call's prefill
    picks, gaps = drive(c, 10, 1)
    assert picks[:c.min_stretch + 1] == [False] * c.min_stretch + [True] and gaps[c.min_stretch] == c.min_stretch


def test_bench_e2e_reports_auto_beside_fixed_budgets(capsys):
    """bench.py e2e --budgets auto,4: an auto row (lossless when greedy) with the budget mix it chose (0 and
    AUTO_BUDGET only), and the line comparing it with the fastest fixed mode."""
    import bench
    res = bench.main(["e2e", "--device", "cpu", "--budgets", "auto,4", "--n-prompts", "1", "--max-new-tokens", "12",
                      "--warmup", "2", "--temperature", "0", "--no-chain"])
    printed = capsys.readouterr().out
    runs = res["e2e"]["runs"]
    assert [(r["mode"], r["budget"]) for r in runs] == [("ar", None), ("auto", None), ("ddtree", 4)]
    auto = runs[1]
    assert auto["lossless"] is True and auto["tokens"] == 11
    shares = dict(x.split(":") for x in auto["budget_mix"].split())
    assert set(shares) <= {"0", str(G.AUTO_BUDGET)} and 99 <= sum(int(v[:-1]) for v in shares.values()) <= 101
    assert f"auto at temperature 0: steps per budget {auto['budget_mix']} (0: one token); " in printed
    assert "x the fastest fixed mode (" in printed


def test_stats_budget_mix():
    st = G.Stats()
    assert st.budget_mix() == ""
    st.budgets.update({8: 1, 0: 3})
    assert st.budget_mix() == "0:75% 8:25%"


def test_cli_budget_auto(target, drafter):
    """--budget takes a node count or auto (anything else: a ValueError naming --budget); auto with --chain or
    --trace is refused by name (both need every step drafted), and so is generate_batch's chain=True."""
    p = cli.build_parser()
    assert p.parse_args(["--budget", "auto"]).budget == "auto" and p.parse_args(["--budget", "4"]).budget == 4
    with pytest.raises(ValueError, match="--budget"):
        p.parse_args(["--budget", "many"])
    cli.check_args(p.parse_args(["--budget", "auto", "--prompt", "x"]))          # accepted
    with pytest.raises(ValueError, match=r"--budget must be in \[0, 1024\] or auto"):
        cli.check_args(p.parse_args(["--budget", "-1", "--prompt", "x"]))
    for flag in (["--chain"], ["--trace", "t.html"]):
        a = p.parse_args(["--budget", "auto", *flag, "--prompt", "x"])
        with pytest.raises(ValueError, match=f"{flag[0]} with --budget auto"):
            cli.check_args(a)
    with pytest.raises(ValueError, match="not with --chain"):
        G.generate_batch(target, [PROMPT], 4, drafter=drafter, budget="auto", chain=True, max_seq_len=32)
