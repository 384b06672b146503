"""The decoding loop: greedy DDTree / DFlash chain == greedy autoregressive, token for token, and the KV
cache after commits equals the autoregressive cache; sampling keeps the target's distribution.
Run: python -m pytest -q tests/test_generate.py"""
import itertools

import pytest
import torch

import autobudget as A
import checkpoint as C
import generate as G
import runner
import tiny
import tree as ddtree
import verify

torch.set_default_dtype(torch.float32)


class StubDrafter:
    """Drafter stand-in with arbitrary logits: 'perfect' (knows the greedy continuation), 'random', or
    'adversarial' (puts the true next token last). Exercises every acceptance length. It takes the real
    drafter's fixed-shape call (per-row ctx_len and n_valid tensors) and reads them on the host: eager only."""
    target_layer_ids = (0, 2)

    def __init__(self, kind, vocab, reference=None, block_size=5, seed=0):
        self.kind, self.vocab, self.ref, self.block_size = kind, vocab, reference, block_size
        self.g = torch.Generator().manual_seed(seed)
        self.calls = []
        self.ctx_cache, self.max_ctx_len = torch.zeros(1, 1, 1), 0     # [.., .., batch]: one row

    def setup_cache(self, b, s):
        self.max_ctx_len = s

    def append_context(self, ctx_feats, ctx_len, row=0):
        pass

    def draft_logits(self, target, last_token, ctx_feats, ctx_len, n_valid):
        start = int(ctx_len[0] + n_valid[0])          # position of last_token
        self.calls.append((start, int(n_valid[0])))
        L = self.block_size - 1
        logits = torch.randn(1, L, self.vocab, generator=self.g)
        if self.kind in ("perfect", "adversarial") and self.ref is not None:
            for d in range(L):
                if start + 1 + d < len(self.ref):
                    tok = self.ref[start + 1 + d]
                    logits[0, d, tok] = 10.0 if self.kind == "perfect" else -10.0
        return logits


def _greedy_ar(model, prompt, n, **kw):
    return G.generate(model, prompt, n, **kw)


@pytest.fixture(scope="module")
def target():
    return tiny.random_model(tiny.text_config(), seed=11)


PROMPTS = [(0, 1), (1, 9), (2, 30)]       # (seed, prompt length)


@pytest.fixture(scope="module")
def ar_runs(target):
    """Greedy autoregressive reference for each prompt: (prompt, tokens, KV cache of the committed part)."""
    runs = []
    for seed, plen in PROMPTS:
        prompt = torch.randint(0, 96, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
        ar = _greedy_ar(target, prompt, 32, max_seq_len=128)
        runs.append((prompt, ar, target.kv_cache[:, 0, :len(prompt) + len(ar) - 1].clone()))
    return runs


@pytest.mark.parametrize("budget", [pytest.param(1, marks=pytest.mark.quick), 2, pytest.param(8, marks=pytest.mark.quick),
                                    16, 32])
@pytest.mark.parametrize("kind", ["perfect", "random", "adversarial"])
def test_greedy_ddtree_equals_autoregressive(target, ar_runs, budget, kind):
    for seed, (prompt, ar, ar_cache) in enumerate(ar_runs):
        drafter = StubDrafter(kind, 96, reference=prompt + ar, seed=seed)
        stats = G.Stats()
        dd = G.generate(target, prompt, 32, drafter=drafter, budget=budget, max_seq_len=128, stats=stats)
        assert dd == ar, (kind, budget, seed)
        n = min(ar_cache.shape[1], len(prompt) + sum(stats.accept_lens))
        assert torch.allclose(target.kv_cache[:, 0, :n], ar_cache[:, :n], atol=1e-5, rtol=1e-5)
        if kind == "perfect":
            assert stats.mean_accept > 1.5
        assert sum(stats.accept_lens) + 1 >= len(dd)


@pytest.mark.quick
def test_chain_mode_and_stops(target):
    prompt = [3, 4, 5, 6]
    ar = _greedy_ar(target, prompt, 30, max_seq_len=96)
    full = prompt + ar
    stats = G.Stats()
    chain = G.generate(target, prompt, 30, drafter=StubDrafter("perfect", 96, full), chain=True,
                       max_seq_len=96, stats=stats)
    assert len(ar) == 30 and chain == ar and stats.mean_accept > 2
    assert max(stats.accept_lens) == 5        # a perfect chain commits its whole block: 4 drafted + the bonus
    stop = ar[7]
    first = ar.index(stop)
    for budget in (0, 4, 16):
        got = G.generate(target, prompt, 30, drafter=StubDrafter("perfect", 96, full), budget=budget,
                         stop_ids=[stop], max_seq_len=96)
        assert got == ar[:first + 1]


@pytest.mark.quick
def test_cache_limit_never_overflows(target):
    """Trees while they fit, then one token a step, then "cache full": no write past max_seq_len (the cache is made
    exactly that long here, so a slot past it raises) and the output of AR."""
    prompt = list(range(10))
    stats = G.Stats()
    target.kv_cache = None                    # fit_caches makes it max_seq_len slots, not a longer earlier one
    out = G.generate(target, prompt, 500, drafter=StubDrafter("random", 96), budget=8, max_seq_len=40, stats=stats)
    assert len(prompt) + len(out) <= 40 + 1 and "cache full" in stats.stopped
    ar = G.generate(target, prompt, 500, max_seq_len=40)
    assert out == ar


def test_streaming_callback_sees_every_token(target):
    seen = []
    out = G.generate(target, [1, 2, 3], 25, drafter=StubDrafter("random", 96), budget=4, on_tokens=seen.extend,
                     max_seq_len=64)
    assert seen == out and len(out) == 25


@pytest.mark.quick
def test_sampling_distribution_matches_target():
    """Temperature-1 DDTree acceptance commits tokens distributed as the target: the first token follows
    p(x1), and the second, given the first, follows p(x2 | x1). Vectorised over many independent rows with
    target conditionals given by a table (so the expected distribution is exact)."""
    torch.manual_seed(0)
    V_, N_rows = 5, 40000
    g = torch.Generator().manual_seed(3)
    draft = torch.randn(1, 3, V_, generator=g)
    tr = ddtree.build_tree_batched(draft.expand(N_rows, -1, -1), torch.zeros(N_rows, dtype=torch.long), 6)
    p1 = torch.randn(V_, generator=g).softmax(-1)                     # p(x1 | root)
    p2 = torch.randn(V_, V_, generator=g).softmax(-1)                 # p(x2 | x1)
    # the target's logits at each node depend only on the node's own token (depth >= 1) or the root
    node_tok = tr.tokens
    logits = torch.where((tr.depths == 0).unsqueeze(-1), p1.log().expand(N_rows, tr.tokens.shape[1], V_),
                         p2.log()[node_tok])
    targets = verify.sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(5))
    accepted, path_len, bonus = verify.accept(tr, targets)
    path_tok = tr.tokens.gather(1, accepted)
    x1 = torch.where(path_len >= 2, path_tok[:, 1], bonus)
    freq = torch.bincount(x1, minlength=V_).float() / N_rows
    chi2 = (((freq - p1) ** 2) / p1).sum() * N_rows
    assert chi2 < 20.5, (freq, p1)        # chi-square, 4 dof: p < 0.0005
    for a in range(V_):
        rows = (path_len >= 2) & (x1 == a)
        if rows.sum() < 2000:
            continue
        x2 = torch.where(path_len[rows] >= 3, path_tok[rows, 2], bonus[rows])
        f2 = torch.bincount(x2, minlength=V_).float() / rows.sum()
        chi2 = (((f2 - p2[a]) ** 2) / p2[a]).sum() * rows.sum()
        assert chi2 < 20.5, (a, f2, p2[a])


@pytest.fixture(scope="module")
def real_drafter(target):
    import draft as dflash
    d = dflash.DFlashDrafter(C.draft_args(C.tiny_draft_config(target.args)))
    tiny.randomize_(d, seed=5, std=0.3)
    return d


@pytest.mark.parametrize("budget,chain", [pytest.param(1, False, marks=pytest.mark.quick), (4, False), (16, False),
                                          (70, False), pytest.param(0, True, marks=pytest.mark.quick)])
def test_step_equals_autoregressive_with_or_without_the_clock(target, real_drafter, budget, chain):
    """The one step, called with eager's stage clock or without it ("static": what --compile and --cuda-graph wrap),
    commits the autoregressive tokens in the same steps; budget 70 (> 64: the attention takes the reference path)
    and the chain included."""
    prompt = [7, 3, 9, 1, 4]
    ar = G.generate(target, prompt, 30, max_seq_len=160)
    eager, static = G.Stats(), G.Stats()
    a = G.generate(target, prompt, 30, drafter=real_drafter, budget=budget, chain=chain, max_seq_len=160, stats=eager)
    b = G.generate(target, prompt, 30, drafter=real_drafter, budget=budget, chain=chain, max_seq_len=160,
                   stats=static, mode="static")
    assert a == b == ar and eager.accept_lens == static.accept_lens


def test_sampling_is_seeded(target, real_drafter):
    """At temperature 1 every sample draws from the default generator, seeded per call: the same seed gives the same
    tokens with or without the stage clock, another seed other tokens; the step count adds up."""
    kw = dict(drafter=real_drafter, budget=8, temperature=1.0, max_seq_len=96)
    st = G.Stats()
    out = G.generate(target, [1, 2, 3], 20, stats=st, mode="static", **kw)
    assert len(out) == 20 and all(0 <= t < 96 for t in out) and sum(st.accept_lens) + 1 >= 20
    assert G.generate(target, [1, 2, 3], 20, **kw) == out
    assert G.generate(target, [1, 2, 3], 20, seed=1, **kw) != out


def count_syncs(monkeypatch) -> list:
    """A list that gets an entry per torch.cuda.synchronize, on a stage clock that believes it runs on CUDA."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    init = G._Clock.__init__

    def cuda_clock(self, device, stats):
        init(self, device, stats)
        self.cuda = True
    monkeypatch.setattr(G._Clock, "__init__", cuda_clock)
    return syncs


def test_stage_clock_syncs_only_in_eager_mode(target, real_drafter, monkeypatch):
    """Eager mode times each stage, so the step's hook syncs the device after draft, tree, verify and commit; every
    other mode passes no hook, and nothing inside the step waits for the device (the loop's one lap per step is
    after the step's host read, which waits anyway). Counted on a clock that believes it runs on CUDA."""
    syncs = count_syncs(monkeypatch)
    for mode, per_step in (("eager", 4), ("static", 1), ("compile", 1)):
        syncs.clear()
        st = G.Stats()
        G.generate(target, [7, 3, 9, 1, 4], 12, drafter=real_drafter, budget=8, max_seq_len=96, stats=st, mode=mode)
        assert len(syncs) == 2 + per_step * len(st.accept_lens), mode        # + prefill and the final lap
        assert all(v > 0 for v in st.stage_s.values()) if mode == "eager" else st.stage_s["draft"] == 0


def test_on_step_reads_each_steps_tree_and_path(target, real_drafter):
    """on_step (--show-tree, --trace) reads the step's View after the step: the accepted paths, root first, laid end
    to end spell the output (each step's root is the token the step before committed last), and each step's
    committed tokens are its path's tokens after the root, then the target's token at the path's end."""
    seen = []
    st = G.Stats()

    def on_step(b, view, new):
        tr, path = view.tree[b], view.accepted[b, :len(new)]
        assert new == tr.tokens[path[1:]].tolist() + [int(view.targets[b, path[-1]])]
        assert view.logits.shape[:2] == view.targets.shape and view.draft_logits.shape[1] == real_drafter.block_size - 1
        seen.append((tr, path.tolist()))
    out = G.generate(target, [2, 7, 1], 20, drafter=real_drafter, budget=8, max_seq_len=96, stats=st, on_step=on_step)
    assert len(seen) == len(st.accept_lens) and all(tr.tokens.shape == (9,) for tr, _ in seen)
    assert [len(path) for _, path in seen] == st.accept_lens
    spelled = [t for tr, path in seen for t in tr.tokens[path].tolist()]
    n = min(len(spelled), len(out))                   # the last step's bonus roots no step; a cut may end it
    assert spelled[:n] == out[:n] and n >= len(out) - 1


def test_steps_are_kept_by_their_owner(target, real_drafter):
    """One Step per shape and setting, kept in the caller's runner.Steps and reused by the next call with the same
    ones; a new Steps starts empty (and still decodes the same tokens). Without one, the model keeps its own."""
    kept = runner.Steps()
    steps = lambda: list(kept.values())
    kw = dict(drafter=real_drafter, budget=4, max_seq_len=96)
    a = G.generate(target, [1, 2, 3], 8, **kw, steps=kept)
    (first,) = steps()
    assert G.generate(target, [1, 2, 3], 8, **kw, steps=kept) == a and steps() == [first]
    G.generate(target, [1, 2, 3], 8, **dict(kw, budget=2), steps=kept)
    assert len(steps()) == 2 and steps()[0] is first
    kept = runner.Steps()
    assert G.generate(target, [1, 2, 3], 8, **kw, steps=kept) == a and steps()[0] is not first
    own = runner.steps_of(target)
    assert G.generate(target, [1, 2, 3], 8, **kw) == a and first not in own.values()
    kept_before = own.values()
    assert G.generate(target, [1, 2, 3], 8, **kw) == a and own.values() == kept_before


def test_no_host_sync_in_step_functions():
    import inspect
    import verify
    for fn in (G.Step.tree_step, G.Step.token_step, G.Step._commit, A.AutoStep.catch_up, verify.sample, verify.accept,
               verify.commit_kv, ddtree.build_tree_batched, ddtree.chain_tree_batched):
        src = inspect.getsource(fn)
        for bad in (".item()", ".tolist()", ".cpu()", "int(", ".numpy()"):
            assert bad not in src, (fn.__qualname__, bad)


@pytest.mark.parametrize("budget", [1, 4, pytest.param(8, marks=pytest.mark.quick), 16, 32])
def test_real_drafter_ddtree_equals_autoregressive(target, real_drafter, ar_runs, budget):
    """The real DFlash drafter (random weights) through the real loop: same tokens as AR, with prompts of
    several lengths, runs that end at the length limit and at a stop token."""
    for prompt, ar, _ in ar_runs:
        assert G.generate(target, prompt, 32, drafter=real_drafter, budget=budget, max_seq_len=128) == ar
        stop = ar[9]
        cut = ar[:ar.index(stop) + 1]
        assert G.generate(target, prompt, 32, drafter=real_drafter, budget=budget, max_seq_len=128,
                          stop_ids=[stop]) == cut


# -----------------------------------------------------------------------------
# Lossless under any drafter: drafts broken at random places never change a token.

HOSTILE_RUNS = {"budget 1": dict(budget=1), "budget 8": dict(budget=8), "budget 16": dict(budget=16),
                "chain": dict(chain=True), "auto": dict(budget="auto"), "auto, scripted": dict(budget="auto")}


def _references(runs) -> torch.Tensor:
    """[B, S] each run's prompt and autoregressive continuation, zero-padded: the HostileDrafter's oracle."""
    seqs = [prompt + ar for prompt, ar, _ in runs]
    return torch.tensor([s + [0] * (max(map(len, seqs)) - len(s)) for s in seqs])


@pytest.mark.parametrize("run", list(HOSTILE_RUNS))
def test_hostile_drafter_costs_no_token(target, real_drafter, ar_runs, run, monkeypatch):
    """Greedy DDTree (budgets 1, 8, 16), the chain and --budget auto (its own choices, or a script of one-token
    stretches, catch_ups and trees) commit the autoregressive tokens whatever the drafter returns: its logits are
    broken at random places (tiny.corrupt_logits: NaN rows and spots, +-inf, all -inf, +-3e38, all equal), between
    rows that the target accepts. The broken drafts reach the tree, and drafts are still accepted."""
    if run == "auto, scripted":
        picks = itertools.cycle([False] * 6 + [True, True] + [False] * 2 + [True] + [False] * 9 + [True] * 3)
        monkeypatch.setattr(A.AutoBudget, "tree", lambda self: next(picks))
    trees = []          # per tree step: were some of its drafts non-finite, and the tokens it committed
    on_step = lambda b, view, new: trees.append((not view.draft_logits[b].isfinite().all(), len(new)))
    for i, (prompt, ar, _) in enumerate(ar_runs):
        drafter = tiny.HostileDrafter(real_drafter, _references(ar_runs[i:i + 1]))
        out = G.generate(target, prompt, 32, drafter=drafter, max_seq_len=128, on_step=on_step, **HOSTILE_RUNS[run])
        assert out == ar, (run, i)
    broken, accept = sum(b for b, _ in trees), sum(n for _, n in trees) / len(trees)
    assert broken >= len(trees) // 3 and len(trees) >= 12 and accept > 1.2, (broken, len(trees), accept)


@pytest.mark.parametrize("kw", [dict(budget=8), dict(budget=16), dict(chain=True), dict(budget="auto")])
def test_hostile_drafter_batch(target, real_drafter, ar_runs, kw):
    """A batch of prompts of different lengths, each row's drafts broken on its own: every row commits its
    autoregressive tokens."""
    prompts = [prompt for prompt, _, _ in ar_runs]
    drafter = tiny.HostileDrafter(real_drafter, _references(ar_runs))
    out = G.generate_batch(target, prompts, 32, drafter=drafter, max_seq_len=128, **kw)
    assert out == [ar for _, ar, _ in ar_runs]


def test_sampling_distribution_survives_a_hostile_drafter():
    """At temperature 1 the committed tokens follow the target whatever the drafter says: 40000 rows, each with its
    own drafts broken at random places (tiny.corrupt_logits over the right marginals, so paths through them are
    accepted), the real tree builder and acceptance, the target's conditionals from a table (as in
    test_sampling_distribution_matches_target): x1 ~ p1, and x2 | x1, x3 | x2 ~ p2. Every tree keeps its root."""
    torch.manual_seed(0)                                               # corrupt_logits draws from it
    V_, N_rows = 5, 40000
    g = torch.Generator().manual_seed(3)
    p1 = torch.randn(V_, generator=g).softmax(-1)                     # p(x1 | root)
    p2 = torch.randn(V_, V_, generator=g).softmax(-1)                 # p(x_d+1 | x_d)
    marginals = torch.stack([p1, p1 @ p2, p1 @ p2 @ p2]).log()        # [3, V] the drafter's, right per depth
    draft = tiny.corrupt_logits(marginals.expand(N_rows, 3, V_))      # [N_rows, 3, V]
    assert (~draft.isfinite()).any(-1).float().mean() > 0.15                # rows holding NaN or inf
    tr = ddtree.build_tree_batched(draft, torch.zeros(N_rows, dtype=torch.long), 6)
    assert (tr.tokens[:, 0] == 0).all() and (tr.parents[:, 0] == -1).all() and (tr.depths[:, 0] == 0).all()
    assert not tr.scores.isnan().any()
    logits = torch.where((tr.depths == 0).unsqueeze(-1), p1.log().expand(N_rows, tr.tokens.shape[1], V_),
                         p2.log()[tr.tokens])
    targets = verify.sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(5))
    accepted, path_len, bonus = verify.accept(tr, targets)
    assert (path_len >= 3).float().mean() > 0.1                      # deep paths through the broken drafts
    path_tok = tr.tokens.gather(1, accepted)
    for d in (1, 2, 3):                                                # x_d, for the rows whose x_d-1 was a node
        rows = path_len >= d
        x = torch.where(path_len[rows] > d, path_tok[rows, d], bonus[rows])
        prev = path_tok[rows, d - 1]
        for a in range(V_) if d > 1 else [None]:
            sel = torch.ones_like(prev, dtype=torch.bool) if a is None else prev == a
            if sel.sum() < 2000:
                continue
            want = p1 if a is None else p2[a]
            freq = torch.bincount(x[sel], minlength=V_).float() / sel.sum()
            chi2 = (((freq - want) ** 2) / want).sum() * sel.sum()
            assert chi2 < 20.5, (d, a, freq, want)                     # chi-square, 4 dof: p < 0.0005


# -----------------------------------------------------------------------------
# Logits with no token to give stop the run, by name.

NO_TOKEN_RUNS = {"autoregressive": dict(budget=0), "budget 1": dict(budget=1), "budget 8": dict(budget=8),
                 "chain": dict(chain=True), "auto": dict(budget="auto")}


@pytest.mark.parametrize("run", list(NO_TOKEN_RUNS))
def test_nonfinite_logits_stop_the_run(target, real_drafter, ar_runs, run, monkeypatch):
    """The target's logits NaN after one token of the autoregressive output: every mode streams exactly the tokens up
    to it, then stops with an error naming the decoding step and that token's position (autoregressive: its step
    number too). NaN logits after a token that is drafted but never committed (the lowest id not in the output,
    which the broken rows draft first) are never read. Sampled (temperature 1): NaN from a position on, named."""
    prompt, ar, _ = ar_runs[1]
    k = next(j for j in range(8, len(ar)) if ar[j] not in prompt + ar[:j])       # ar[k]'s first occurrence
    never = min(set(range(96)) - set(prompt + ar))
    tiny.nan_logits_where(target, monkeypatch, lambda tokens, pos: (tokens == ar[k]) | (tokens == never))
    drafter = tiny.HostileDrafter(real_drafter, _references(ar_runs[1:2]))
    seen, drafted = [], []
    on_step = lambda b, view, new: drafted.append(bool((view.tree.tokens[b] == never).any()))
    step = k + 1 if run == "autoregressive" else r"\d+"
    with pytest.raises(RuntimeError, match=rf"^decoding step {step}: the target's logits after position "
                                           rf"{len(prompt) + k} give no token \(NaN or inf\); --debug names"):
        G.generate(target, prompt, 32, drafter=drafter, max_seq_len=128, on_tokens=seen.extend, on_step=on_step,
                   **NO_TOKEN_RUNS[run])
    assert seen == ar[:k + 1]
    assert any(drafted) or run == "autoregressive", drafted
    monkeypatch.undo()
    tiny.nan_logits_where(target, monkeypatch, lambda tokens, pos: pos >= len(prompt) + 6)
    seen.clear()
    with pytest.raises(RuntimeError, match=rf": the target's logits after position {len(prompt) + 6} give no token "
                                           r"\(NaN or inf, or past float32 divided by the temperature 1\)"):
        G.generate(target, prompt, 32, drafter=drafter, max_seq_len=128, on_tokens=seen.extend, temperature=1.0,
                   **NO_TOKEN_RUNS[run])
    assert len(seen) == 7
    monkeypatch.undo()                         # a batch: the row that reaches position 40 first is named
    tiny.nan_logits_where(target, monkeypatch, lambda tokens, pos: pos >= 40)
    runs, rows = [ar_runs[0], ar_runs[2]], [[], []]                # prompts of 1 and 30 tokens
    with pytest.raises(RuntimeError, match=r"^decoding step \d+, prompt 1: the target's logits after position 40 "):
        G.generate_batch(target, [p for p, _, _ in runs], 32, drafter=tiny.HostileDrafter(real_drafter,
                         _references(runs)), max_seq_len=128, on_tokens=lambda b, t: rows[b].extend(t),
                         **NO_TOKEN_RUNS[run])
    assert rows[1] == runs[1][1][:11] and rows[0] == runs[0][1][:len(rows[0])]


def test_nonfinite_weights_stop_at_prefill(target, real_drafter):
    """A NaN weight put into the target after loading: the first token already has no logits to come from, for one
    prompt or a batch (the prompt named), autoregressive or drafted; the temperature does not matter."""
    bad = tiny.random_model(tiny.text_config(), seed=11)          # the target fixture's weights, its own copy
    with torch.no_grad():
        bad.layers[1].self_attn.o_proj.weight[0, 0] = float("nan")
    for kw in (dict(budget=0), dict(drafter=real_drafter, budget=8), dict(drafter=real_drafter, chain=True)):
        with pytest.raises(RuntimeError, match=r"^prefill: the target's logits after position 2 give no token"):
            G.generate(bad, [1, 2, 3], 8, max_seq_len=64, **kw)
        with pytest.raises(RuntimeError, match=r"^prefill, prompt 0: the target's logits after position 3 give"):
            G.generate_batch(bad, [[4, 5, 6, 7], [1, 2]], 8, max_seq_len=64, temperature=0.5, **kw)


def test_temperature_overflow_stops_and_tiny_temperatures_are_refused(target, ar_runs):
    """Finite logits that overflow float32 once divided by the temperature: the error says so (greedy decodes them
    as ever). A temperature below verify.MIN_TEMPERATURE (or not finite, or negative) is refused up front."""
    prompt, ar, _ = ar_runs[0]
    huge = tiny.random_model(tiny.text_config(), seed=11)         # the target fixture's weights, its own copy
    with torch.no_grad():
        huge.lm_head.weight.mul_(1e37)                  # logits near 1e37: finite, past float32 when divided by 1e-4
    assert G.generate(huge, prompt, 32, max_seq_len=128) == ar
    with pytest.raises(RuntimeError, match=r"^prefill: .* \(NaN or inf, or past float32 divided by the temperature "
                                           r"0.0001\)"):
        G.generate(huge, prompt, 8, max_seq_len=128, temperature=1e-4)
    for t in (1e-30, 5e-5, float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match=r"^temperature must be 0 \(greedy\) or a finite number >= 0.0001, "
                                             rf"got {t}$"):
            G.generate(target, prompt, 4, max_seq_len=128, temperature=t)


def test_greedy_with_cache_equals_recompute(target):
    """Greedy decoding with the KV cache == greedy decoding that recomputes the whole sequence each step."""
    seq = [4, 8, 15, 16, 23, 42]
    with torch.no_grad():
        for _ in range(20):
            seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    assert G.generate(target, seq[:6], 20, max_seq_len=64) == seq[6:]


def test_compiled_step_equals_eager(target, real_drafter):
    """--compile (torch.compile of the fixed-shape step; on a GPU it is also what --cuda-graph --compile
    captures) commits the eager loop's tokens: the step has no host sync or data-dependent Python branch. A second
    budget in the same process recompiles the same step for its own fixed shapes (dynamic=False)."""
    prompt = [7, 3, 9, 1, 4]
    for drafter, budget in ((None, 0), (real_drafter, 8), (real_drafter, 3)):
        eager, compiled = G.Stats(), G.Stats()
        a = G.generate(target, prompt, 12, drafter=drafter, budget=budget, max_seq_len=96, stats=eager)
        b = G.generate(target, prompt, 12, drafter=drafter, budget=budget, max_seq_len=96, stats=compiled,
                       mode="compile")
        assert a == b and eager.accept_lens == compiled.accept_lens


TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.skipif(TORCH_VERSION < (2, 13), reason="before torch 2.13 inductor's CPU code ignores "
                    "emulate_precision_casts; test_gpu checks the GPU path, which honours it")
def test_compiled_bf16_forward_rounds_like_eager():
    """In bf16 torch.compile must round where eager rounds (runner.COMPILE_OPTIONS): inductor otherwise keeps fused
    intermediates in fp32, a slightly different target, and the bundled drafter, distilled against the eager one,
    drafts worse for it. Bundled target, bf16, a code prompt: the compiled forward's logits match eager's (the bound
    leaves room for another CPU's summation order)."""
    import bench
    target = C.load_model(G.BUNDLED_TARGET, torch.device("cpu"), torch.bfloat16, progress=False)
    prompt = bench.encode_prompts(bench.load_prompts(bench.PROMPTS_FILE, 1), G.BUNDLED_TARGET,
                                  target.args.vocab_size, False)[0][0]
    x = torch.tensor([prompt])                                                   # [1, T]
    with torch.no_grad():
        eager = target(x).logits.float()                                         # [1, T, vocab]
        compiled = torch.compile(target.forward, dynamic=False, options=runner.compile_options())(x).logits.float()
    rel = ((compiled - eager).abs().max() / eager.abs().max()).item()
    agree = (compiled.argmax(-1) == eager.argmax(-1)).float().mean().item()
    assert rel <= 0.003 and agree >= 0.99, (rel, agree)


def test_compile_options_this_torch_lacks_are_dropped_with_a_warning(monkeypatch):
    """torch.compile raises on an option its inductor does not know (torch >= 2.4 is allowed): such options are left
    out, with a warning that names them, instead of breaking --compile."""
    monkeypatch.setattr(runner, "COMPILE_OPTIONS", {"emulate_precision_casts": True, "no_such_inductor_option": 1})
    with pytest.warns(UserWarning, match="no_such_inductor_option"):
        assert runner.compile_options() == {"emulate_precision_casts": True}


def test_cuda_graph_refuses_reference_kernels(target, monkeypatch):
    """--cuda-graph --no-triton is refused by name: the reference MoE reads its expert ids on the host, which a
    capture cannot do (it would fail inside the capture with a CUDA error)."""
    import kernels
    monkeypatch.setattr(kernels, "ENABLED", False)
    with pytest.raises(ValueError, match="--no-triton"):
        G.generate(target, [1, 2, 3], 4, mode="graph")
