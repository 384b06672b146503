"""
Tests for tree.py: the fixed-shape DDTree builder (ddtree_search) must equal the paper's heap bit for bit.

    python -m pytest -q tests/test_tree.py
"""
import ast
import inspect
import itertools
import os
import sys
import textwrap

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tree as ddtree  # noqa: E402
from tree import (Tree, build_tree, build_tree_batched, build_tree_heap, chain_tree,  # noqa: E402
                  chain_tree_batched, format_tree)

FIELDS = ["tokens", "parents", "depths", "scores", "valid", "ancestor_mask"]


def assert_same_tree(a: Tree, b: Tree, msg: str = "") -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        x, y = x.cpu(), y.cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, f"{f}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)} {msg}"
        if f == "scores":  # bit-identical, -inf padding included
            x, y = x.view(torch.int32), y.view(torch.int32)
        assert torch.equal(x, y), f"{f} differs {msg}\n{x}\n{y}"


def random_logits(g: torch.Generator, L: int, V: int, kind: str) -> torch.Tensor:
    if kind == "gauss":
        return torch.randn(L, V, generator=g) * float(torch.rand(1, generator=g)) * 6
    if kind == "ints":  # few distinct values: lots of exact ties within and across depths
        return torch.randint(0, 3, (L, V), generator=g).float()
    if kind == "uniform":
        return torch.zeros(L, V)
    if kind == "peaked":  # one dominant token + ties below it; some -inf
        x = torch.randint(-2, 1, (L, V), generator=g).float()
        x[torch.rand(L, V, generator=g) < 0.2] = float("-inf")
        x[:, 0] = 5.0  # every row keeps a finite max
        return x
    raise ValueError(kind)


def check_invariants(t: Tree, L: int, B: int) -> None:
    N = B + 1
    assert t.tokens.shape == (N,) and t.ancestor_mask.shape == (N, N)
    assert t.parents[0] == -1 and t.depths[0] == 0 and t.scores[0] == 0 and t.valid[0]
    n = int(t.valid.sum())
    assert t.valid[:n].all() and not t.valid[n:].any()  # padding only at the tail
    for i in range(1, N):
        p = int(t.parents[i])
        if t.valid[i]:
            assert 0 <= p < i and t.valid[p]  # parents precede children: prefix-closed
            assert t.depths[i] == t.depths[p] + 1 <= L
            assert t.scores[i] <= t.scores[i - 1]  # key order
        else:  # padding conventions
            assert p == -1 and t.depths[i] == 0 and t.tokens[i] == t.tokens[0]
            assert t.scores[i] == float("-inf")
    # ancestor mask == walk up the parent chain
    for i in range(N):
        row, j = torch.zeros(N, dtype=torch.bool), i
        while j >= 0:
            row[j] = True
            j = int(t.parents[j])
        assert torch.equal(t.ancestor_mask[i], row), i


# -----------------------------------------------------------------------------


def test_rank_tokens_tie_order():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4, (5, 37), generator=g).float()  # [L, V], many ties
    lp, tok = ddtree.rank_tokens(x, 37)
    logp = torch.log_softmax(x, -1)
    for d in range(5):
        want = sorted(range(37), key=lambda v: (-logp[d, v].item(), v))
        assert tok[d].tolist() == want
        assert torch.equal(lp[d], logp[d, want])


def test_ref_matches_bruteforce():
    # the heap's pop order == sort of all prefixes by (-score, depth, rank tuple): checks the reference itself
    g = torch.Generator().manual_seed(2)
    for trial in range(60):
        L, V = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g))
        B = int(torch.randint(1, 12, (1,), generator=g))
        x = random_logits(g, L, V, ["gauss", "ints", "uniform"][trial % 3])
        K = min(B, V)
        lp, tok = ddtree.rank_tokens(x, K)
        lp = lp.numpy()
        prefixes = []
        for d in range(1, L + 1):
            for ranks in itertools.product(range(K), repeat=d):
                s = np.float32(0)
                for i, r in enumerate(ranks):
                    s = s + lp[i, r]
                prefixes.append((-s, d, ranks))
        prefixes.sort()
        ref = build_tree_heap(x, 7, B)
        n = min(B, len(prefixes))
        assert int(ref.valid.sum()) == n + 1
        for node, (neg, _, ranks) in enumerate(prefixes[:n], start=1):
            assert ref.tokens[node] == tok[len(ranks) - 1, ranks[-1]]
            assert ref.depths[node] == len(ranks) and ref.scores[node] == -neg


@pytest.mark.quick
def test_hand_built():
    # depth 1: q(2)=.6 q(0)=.3 q(1)=.1   depth 2: q(1)=.7 q(0)=.2 q(2)=.1
    # best prefixes: (2) .6, (2,1) .42, (0) .3, (0,1) .21, then (2,0) .12 is cut by B=4
    x = torch.tensor([[0.3, 0.1, 0.6], [0.2, 0.7, 0.1]]).log()
    for t in (build_tree(x, 9, 4), build_tree_heap(x, 9, 4)):
        assert t.tokens.tolist() == [9, 2, 1, 0, 1]
        assert t.parents.tolist() == [-1, 0, 1, 0, 3]
        assert t.depths.tolist() == [0, 1, 2, 1, 2]
        assert t.valid.all()
        assert t.ancestor_mask.int().tolist() == [[1, 0, 0, 0, 0],
                                                  [1, 1, 0, 0, 0],
                                                  [1, 1, 1, 0, 0],
                                                  [1, 0, 0, 1, 0],
                                                  [1, 0, 0, 1, 1]]
        assert np.allclose(t.scores.exp().numpy(), [1, 0.6, 0.42, 0.3, 0.21])


@pytest.mark.quick
def test_worked_example_in_the_search_docstring():
    """ddtree_search's docstring works an example through its three steps, and runs it: the run prints what the
    text says (doctest), and the heap builds the same tree."""
    import doctest
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    (test,) = finder.find(ddtree.ddtree_search.ref, "ddtree_search", globs=vars(ddtree).copy())
    runner.run(test)
    assert runner.summarize(verbose=False) == (0, len(test.examples)) and len(test.examples) >= 6
    q = torch.tensor([[.10, .60, .25, .05], [.50, .10, .30, .10], [.80, .10, .05, .05]])
    assert_same_tree(build_tree(q.log(), 7, 4), build_tree_heap(q.log(), 7, 4))
    assert build_tree(q.log(), 7, 4).tokens.tolist() == [7, 1, 0, 2, 0]


def test_ancestor_mask_is_the_walk_up():
    """The one mask builder: row i marks the nodes on the walk up from i; a batch of parent lists, padding nodes
    (-1) alone in their rows, and the depth bound (fewer steps than the tree is deep leave rows short)."""
    assert ddtree.ancestor_mask([-1, 0, 0, 1, 3]).int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                                                                 [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    batch = torch.tensor([[-1, 0, 1, 2, -1], [-1, 0, 0, 2, -1]])
    m = ddtree.ancestor_mask(batch, 3)
    assert m.shape == (2, 5, 5) and m[0, 3].tolist() == [True] * 4 + [False]
    assert m[1, 3].tolist() == [True, False, True, True, False] and m[:, 4].int().tolist() == [[0, 0, 0, 0, 1]] * 2
    assert torch.equal(ddtree.ancestor_mask(batch, 2)[0, 3], torch.tensor([False, True, True, True, False]))


def test_hand_built_cross_depth_tie():
    # depth 1 uniform over 2 tokens, depth 2 certain (logp 0 for token 0, -inf for token 1):
    # (0), (1), (0,0), (1,0) all score log .5 exactly; the shallower first, then the tuple order
    x = torch.tensor([[0.0, 0.0], [0.0, float("-inf")]])
    for t in (build_tree(x, 5, 4), build_tree_heap(x, 5, 4)):
        assert t.tokens.tolist() == [5, 0, 1, 0, 0]
        assert t.parents.tolist() == [-1, 0, 0, 1, 2]
        assert t.depths.tolist() == [0, 1, 1, 2, 2]
    # uniform everywhere: depth-1 nodes first, then depth 2 in tuple order
    t = build_tree(torch.zeros(2, 2), 5, 4)
    assert t.tokens.tolist() == [5, 0, 1, 0, 1] and t.parents.tolist() == [-1, 0, 0, 1, 1]


def test_padding():
    # V=2, L=2: only 2 + 4 = 6 prefixes exist, budget 10 -> 4 padding nodes, shape stays 11
    x = torch.randn(2, 2, generator=torch.Generator().manual_seed(3))
    t = build_tree(x, 3, 10)
    assert_same_tree(t, build_tree_heap(x, 3, 10))
    assert t.valid.tolist() == [True] * 7 + [False] * 4
    assert t.parents[7:].tolist() == [-1] * 4 and t.depths[7:].tolist() == [0] * 4
    assert t.tokens[7:].tolist() == [3] * 4
    assert torch.equal(t.ancestor_mask[7:, :], torch.eye(11, dtype=torch.bool)[7:])
    check_invariants(t, 2, 10)


def test_degenerate_sizes():
    x = torch.randn(3, 5)
    for t in (build_tree(x, 4, 0), build_tree_heap(x, 4, 0)):  # budget 0: root only
        assert t.tokens.tolist() == [4] and t.ancestor_mask.tolist() == [[True]]
    empty = torch.zeros(0, 5)  # L = 0: root plus padding
    assert_same_tree(build_tree(empty, 4, 3), build_tree_heap(empty, 4, 3))
    assert build_tree(empty, 4, 3).valid.tolist() == [True, False, False, False]
    one = torch.randn(4, 1)  # V = 1: a chain of the only token
    t = build_tree(one, 2, 3)
    assert_same_tree(t, build_tree_heap(one, 2, 3))
    assert t.parents.tolist() == [-1, 0, 1, 2] and t.tokens.tolist() == [2, 0, 0, 0]


@pytest.mark.quick
@pytest.mark.parametrize("kind", ["gauss", "ints", "uniform", "peaked"])
def test_matches_ref_random(kind):
    g = torch.Generator().manual_seed(["gauss", "ints", "uniform", "peaked"].index(kind))
    for trial in range(500):
        L = int(torch.randint(1, 16, (1,), generator=g))
        B = int(torch.randint(1, 65, (1,), generator=g))
        V = int(torch.randint(2, 301, (1,), generator=g)) if trial % 3 else int(torch.randint(2, 6, (1,), generator=g))
        x = random_logits(g, L, V, kind)
        root = int(torch.randint(0, V, (1,), generator=g))
        t = build_tree(x, root, B)
        assert_same_tree(t, build_tree_heap(x, root, B), f"{kind} L={L} V={V} B={B} trial={trial}")
        if trial % 20 == 0:
            check_invariants(t, L, B)


@pytest.mark.quick
def test_frontier_lex_order_regression():
    # Children of parents with *different* scores can tie. Here (1,0) outscores (0,1) at depth 2,
    # yet x = (0,1,0) must precede its 7 tied cousins (1,0,j): lexicographic tuple order, not the
    # parents' score order. A builder that keeps each depth's frontier in score order cuts x at B=16.
    x = torch.full((3, 9), -30.0)  # [L=3, V=9]
    x[0, :2] = 0.0                  # depth 1: two tied tokens
    x[1, :2] = torch.tensor([0.0, -1.0])
    x[2, :8] = torch.tensor([0.0] + [-1.0] * 7)
    for B in (15, 16, 17):
        assert_same_tree(build_tree(x, 0, B), build_tree_heap(x, 0, B), f"B={B}")


@pytest.mark.quick
def test_matches_ref_exact_ties(monkeypatch):
    # Feed integer logp tables directly (skip log_softmax): float sums are then exact, so ties
    # between different paths, within and across depths, are frequent rather than lucky.
    def rank_exact(x, k):
        lp, tok = torch.sort(x.float(), dim=-1, descending=True, stable=True)
        return lp[..., :k], tok[..., :k]
    monkeypatch.setattr(ddtree, "rank_tokens", rank_exact)
    g = torch.Generator().manual_seed(7)
    for trial in range(800):
        L, V = int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(2, 16, (1,), generator=g))
        B = int(torch.randint(4, 65, (1,), generator=g))
        if trial % 2:  # random levels {0, -1, -2, -3}
            x = -torch.randint(0, 4, (L, V), generator=g).float()
        else:  # a top token (sometimes two), some at -1, the rest tied at -2
            x = torch.full((L, V), -2.0)
            x[torch.rand(L, V, generator=g) < 0.3] = -1.0
            x[:, 0] = 0.0
            x[:, 1] = -(torch.rand(L, generator=g) < 0.5).float()
        assert_same_tree(build_tree(x, 0, B), build_tree_heap(x, 0, B), f"L={L} V={V} B={B} trial={trial}")


def test_batched_equals_rows():
    g = torch.Generator().manual_seed(4)
    for L, V, B, kind in [(7, 50, 16, "gauss"), (3, 3, 20, "ints"), (15, 200, 64, "ints"), (5, 2, 40, "uniform")]:
        x = torch.stack([random_logits(g, L, V, kind) for _ in range(4)])  # [b, L, V]
        roots = torch.randint(0, V, (4,), generator=g)
        bt = build_tree_batched(x, roots, B)
        assert bt.tokens.shape == (4, B + 1) and bt.ancestor_mask.shape == (4, B + 1, B + 1)
        for i in range(4):
            assert_same_tree(bt[i], build_tree(x[i], roots[i], B))
        ct = chain_tree_batched(x, roots, L)
        for i in range(4):
            assert_same_tree(ct[i], chain_tree(x[i], roots[i], L))


def test_root_as_tensor():
    x = torch.randn(3, 10)
    assert_same_tree(build_tree(x, torch.tensor(6), 5), build_tree(x, 6, 5))


def test_chain_tree():
    g = torch.Generator().manual_seed(5)
    x = random_logits(g, 6, 30, "ints")
    t = chain_tree(x, 1, 6)
    check_invariants(t, 6, 6)
    logp = torch.log_softmax(x, -1)
    want = [min(range(30), key=lambda v: (-logp[d, v].item(), v)) for d in range(6)]
    assert t.tokens.tolist() == [1] + want
    assert t.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5] and t.depths.tolist() == list(range(7))
    # a dominant top-1 at every depth: the DDTree of budget L is exactly the chain
    peaked = torch.randn(6, 30, generator=g)
    peaked[torch.arange(6), torch.randint(0, 30, (6,), generator=g)] = 30.0
    assert_same_tree(build_tree(peaked, 1, 6), chain_tree(peaked, 1, 6))
    # longer than L: padded like the tree
    t = chain_tree(x, 1, 9)
    assert t.valid.tolist() == [True] * 7 + [False] * 3
    check_invariants(t, 6, 9)


def test_format_tree():
    x = torch.tensor([[0.3, 0.1, 0.6], [0.2, 0.7, 0.1]]).log()
    words = ["a", "b", "c", "r"]
    s = format_tree(build_tree(x, 3, 4), decode=words.__getitem__, accepted=[0, 1, 2])
    lines = s.splitlines()
    assert len(lines) == 5 and lines[0].startswith("* [0] 'r'")
    assert sum(line.startswith("*") for line in lines) == 3
    assert "q=0.4200" in s
    s = format_tree(build_tree(torch.randn(2, 2), 0, 10))
    assert "(+ 4 padding nodes)" in s
    s = format_tree(build_tree(x, 3, 4), decode=words.__getitem__, accepted=[0, 1, 2], bonus=0)
    assert s.splitlines()[-1] == "  bonus 'a'"
    for term in ("q=", "score", "*", "bonus", "root"):     # the legend explains every mark the tree shows
        assert term in ddtree.LEGEND


def test_builder_op_count():
    """Where the search kernel does not fit, the tensor-op builder is launch-bound (tiny tensors, about one kernel
    per aten op): it stays at about ten ops per depth plus a constant. Counts the non-view aten ops of one budget-8,
    L=7 search from ranked drafts, the ancestor mask included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += not func.is_view
            return func(*args, **(kwargs or {}))

    lp, tok = ddtree.rank_tokens(torch.randn(1, 7, 4352), 8)
    roots = torch.tensor([1])
    ddtree.ddtree_search.ref(lp, tok, roots, 8)
    with Count():
        ddtree.ddtree_search.ref(lp, tok, roots, 8)
    assert Count.n <= 100, Count.n


def test_rank_tokens_keys_equal_stable_sort():
    """rank_topk takes a top-k of packed (logp, token) keys instead of sorting the vocabulary: the same tokens in
    the same order as a stable sort, the same logp bits, through exact ties, all-equal rows and -inf."""
    g = torch.Generator().manual_seed(0)
    for trial in range(120):
        L, V = int(torch.randint(1, 8, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
        k = int(torch.randint(1, V + 1, (1,), generator=g))
        x = torch.randn(2, L, V, generator=g) * 3
        if trial % 4 == 1:
            x = x.round()
        elif trial % 4 == 2:
            x = torch.zeros(2, L, V)
        elif trial % 4 == 3:
            x[torch.rand(2, L, V, generator=g) < 0.3] = float("-inf")
            x[..., 0] = 1.0
        lp, tok = ddtree.rank_tokens(x, k)
        want_lp, want_tok = torch.sort(torch.log_softmax(x, -1), dim=-1, descending=True, stable=True)
        assert torch.equal(tok, want_tok[..., :k]), f"trial {trial}"
        assert torch.equal(lp.view(torch.int32), want_lp[..., :k].view(torch.int32)), f"trial {trial}"


def code_of(fn) -> str:
    """fn's source without its docstring (ddtree_search's runs an example that reads the host)."""
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    if ast.get_docstring(node) is not None:
        node.body = node.body[1:]
    return ast.unparse(node)


HOSTILE = ["nan_one", "nan_row", "pos_inf", "neg_inf_row", "huge", "equal", "fp16_overflow", "mixed"]


def hostile_logits(g: torch.Generator, shape: tuple, kind: str) -> torch.Tensor:
    """What a broken drafter may return: NaN (one, or a whole row), +inf, all -inf rows, values near the float32
    limit, all-equal rows, an fp16 overflow, or all of these at random places over random logits."""
    x = torch.randn(shape, generator=g) * 3
    row = lambda: tuple(int(torch.randint(0, n, (1,), generator=g)) for n in shape[:-1])
    if kind == "nan_one":
        x[row() + (int(torch.randint(0, shape[-1], (1,), generator=g)),)] = float("nan")
    elif kind == "nan_row":
        x[row()] = float("nan")
    elif kind == "pos_inf":
        x[torch.rand(shape, generator=g) < 0.05] = float("inf")
    elif kind == "neg_inf_row":
        x[row()] = float("-inf")
    elif kind == "huge":
        x = torch.where(torch.rand(shape, generator=g) < 0.5, 3e38, -3e38) * torch.rand(shape, generator=g).round()
    elif kind == "equal":
        x = torch.full(shape, 7.0)
    elif kind == "fp16_overflow":    # an fp16 drafter's logits past 65504 are inf
        x = (x * 3e4).half()
    else:
        palette = torch.tensor([float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 0.0, -float("nan")])
        pick = torch.randint(0, len(palette), shape, generator=g)
        x = torch.where(torch.rand(shape, generator=g) < 0.2, palette[pick], x)
        x[row()] = 1.0                                                           # an all-equal row
    return x


@pytest.mark.parametrize("kind", HOSTILE)
def test_any_drafter_output_keeps_the_root(kind):
    """Whatever the drafter returns, node 0 is the root and no score is NaN (a NaN ranked first would push the root
    out of node 0); the search equals the heap bit for bit, the chain takes each depth's rank-0 token, and the tree
    holds every invariant. The issue's case first: one NaN among the logits."""
    x = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    x[2, 5] = float("nan")
    assert build_tree(x, 220, 8).tokens[0] == 220 and build_tree_heap(x, 220, 8).tokens[0] == 220
    g = torch.Generator().manual_seed(HOSTILE.index(kind))
    for trial in range(40):
        L, V = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(2, 120, (1,), generator=g))
        B = int(torch.randint(1, 40, (1,), generator=g))
        x = hostile_logits(g, (2, L, V), kind)
        roots = torch.randint(0, V, (2,), generator=g)
        bt, ct = build_tree_batched(x, roots, B), chain_tree_batched(x, roots, L)
        lp, tok = ddtree.rank_tokens(x, 1)
        for i in range(2):
            msg = f"{kind} L={L} V={V} B={B} trial={trial} row={i}"
            t = bt[i]
            assert_same_tree(t, build_tree_heap(x[i], roots[i], B), msg)
            assert_same_tree(ct[i], chain_tree(x[i], roots[i], L), msg)
            for tr in (t, ct[i]):
                assert tr.tokens[0] == roots[i] and not tr.scores.isnan().any(), msg
                check_invariants(tr, L, tr.tokens.shape[0] - 1)
            assert ct[i].tokens[1:].tolist() == tok[i, :, 0].tolist(), msg
            logp = torch.log_softmax(x[i].float(), -1)
            if not logp.isfinite().all():        # non-finite logp ranks as -inf; the rest keeps its order
                clean = torch.where(logp.isfinite(), logp, float("-inf"))
                want_lp, want_tok = torch.sort(clean, dim=-1, descending=True, stable=True)
                lp_i, tok_i = ddtree.rank_tokens(x[i], V)
                assert torch.equal(tok_i, want_tok) and torch.equal(lp_i.view(torch.int32),
                                                                     want_lp.view(torch.int32)), msg


def test_no_host_sync_in_builder():
    for fn in (ddtree.build_tree, ddtree.build_tree_batched, ddtree.ddtree_search, ddtree.rank_tokens, ddtree.rank_topk,
               ddtree._expand, ddtree._tree, ddtree.ancestor_mask, ddtree.chain_tree, ddtree.chain_tree_batched):
        src = code_of(fn)
        for bad in (".item(", ".tolist(", ".cpu(", ".numpy(", "nonzero("):
            assert bad not in src, f"{fn.__name__} calls {bad}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_ref():
    g = torch.Generator().manual_seed(6)
    for trial in range(200):
        L, V, B = int(torch.randint(1, 9, (1,))), int(torch.randint(2, 300, (1,))), int(torch.randint(1, 65, (1,)))
        x = random_logits(g, L, V, ["gauss", "ints", "uniform", "peaked"][trial % 4]).cuda()
        t = build_tree(x, 1, B)
        assert t.tokens.is_cuda
        assert_same_tree(t, build_tree_heap(x, 1, B), f"L={L} V={V} B={B}")
    x = torch.randn(2, 7, 163840, device="cuda")  # Kimi-sized vocab, batched
    bt = build_tree_batched(x, torch.tensor([1, 2], device="cuda"), 16)
    for i in range(2):
        assert_same_tree(bt[i], build_tree_heap(x[i], i + 1, 16))
    for trial in range(80):       # a broken drafter's logits through the rank and search kernels
        kind = HOSTILE[trial % len(HOSTILE)]
        L, V, B = int(torch.randint(1, 9, (1,))), int(torch.randint(2, 300, (1,))), int(torch.randint(1, 65, (1,)))
        x, roots = hostile_logits(g, (2, L, V), kind).cuda(), torch.tensor([1, 0], device="cuda")
        bt, ct = build_tree_batched(x, roots, B), chain_tree_batched(x, roots, L)
        for i in range(2):
            assert_same_tree(bt[i], build_tree_heap(x[i], i ^ 1, B), f"{kind} L={L} V={V} B={B}")
            assert_same_tree(ct[i], chain_tree(x[i].cpu(), i ^ 1, L), f"{kind} chain L={L} V={V}")
