"""verify.py on a hand-built tree: the verify mask, the acceptance walk and the KV commit against hand-written
answers. Run: python -m pytest -q tests/test_verify.py"""
import pytest
import torch

import verify
from tree import Tree


def five_node_tree() -> Tree:
    """root r=10 (node 0); children a=11 (1) and b=12 (2); a's child c=13 (3); c's child d=14 (4).
        10 ─┬─ 11 ── 13 ── 14
            └─ 12                                                                """
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    depths = torch.tensor([[0, 1, 1, 2, 3]])
    mask = torch.tensor([[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0],
                         [1, 0, 1, 0, 0],
                         [1, 1, 0, 1, 0],
                         [1, 1, 0, 1, 1]], dtype=torch.bool)[None]
    return Tree(tokens=torch.tensor([[10, 11, 12, 13, 14]]), parents=parents, depths=depths,
                scores=torch.zeros(1, 5), valid=torch.ones(1, 5, dtype=torch.bool), ancestor_mask=mask)


def test_mask():
    """The target sees the tree's tokens at positions start + depth (siblings share one) under its ancestor mask:
    each node's row marks the root, its ancestors and itself."""
    from tree import ancestor_mask
    assert torch.equal(ancestor_mask([-1, 0, 0, 1, 3]), five_node_tree().ancestor_mask[0])


def test_walks():
    tr = five_node_tree()
    # target token after each node: root->11 (a matches), a->13 (c matches), c->99 (no child): path 0,1,3
    cases = [([11, 13, 0, 99, 0], [0, 1, 3], 99),
             ([12, 0, 5, 0, 0], [0, 2], 5),                    # sibling b accepted, bonus from b
             ([11, 13, 0, 14, 42], [0, 1, 3, 4], 42),          # the whole spine, bonus after the leaf
             ([50, 13, 0, 14, 42], [0], 50)]                   # nothing matches: root only, bonus = 50
    for target, path, bonus in cases:
        acc, n, b = verify.accept(tr, torch.tensor([target]))
        assert acc[0, :int(n)].tolist() == path and int(b) == bonus
        assert acc[0, int(n):].tolist() == [path[-1]] * (5 - int(n))     # padding repeats the deepest node


def test_padding_nodes_never_accepted():
    tr = five_node_tree()
    tr.valid[0, 4] = False
    acc, n, b = verify.accept(tr, torch.tensor([[11, 13, 0, 14, 42]]))
    assert acc[0, :int(n)].tolist() == [0, 1, 3] and int(b) == 14


def test_commit_moves_path_kv():
    cache = torch.arange(2 * 1 * 16 * 3, dtype=torch.float32).view(2, 1, 16, 3)     # [layers, B, S, C]
    before = cache.clone()
    start = 7
    acc = torch.tensor([[0, 1, 3, 3, 3]])
    verify.commit_kv(cache, start, acc, torch.tensor([3]))
    assert torch.equal(cache[:, 0, 7], before[:, 0, 7]) and torch.equal(cache[:, 0, 8], before[:, 0, 8])
    assert torch.equal(cache[:, 0, 9], before[:, 0, 10])                            # node 3 -> slot start+2
    assert torch.equal(cache[:, 0, :7], before[:, 0, :7])                           # the prefix is untouched


def test_commit_per_row_start():
    """A tensor start_pos (the fixed-shape step's form): each row moves its own path from its own start; rows past
    the batch (cache row 2) are untouched."""
    cache = torch.randn(2, 3, 16, 4)                                                  # [layers, Bmax, S, C]
    before = cache.clone()
    start, acc, n = torch.tensor([2, 5]), torch.tensor([[0, 2, 4, 4], [0, 1, 3, 3]]), torch.tensor([3, 2])
    verify.commit_kv(cache, start, acc, n)
    assert torch.equal(cache[:, 0, 3], before[:, 0, 4]) and torch.equal(cache[:, 0, 4], before[:, 0, 6])
    assert torch.equal(cache[:, 1, 5:7], before[:, 1, 5:7])                         # a contiguous path stays
    want = before.clone()
    want[:, 0, 3:5] = before[:, 0, [4, 6]]
    assert torch.equal(cache, want)


def test_accept_batched_rows_independent():
    tr = five_node_tree()
    two = Tree(*(torch.cat([t, t]) for t in (tr.tokens, tr.parents, tr.depths, tr.scores, tr.valid,
                                            tr.ancestor_mask)))
    acc, n, b = verify.accept(two, torch.tensor([[11, 13, 0, 14, 42], [12, 0, 5, 0, 0]]))
    assert n.tolist() == [4, 2] and b.tolist() == [42, 5]
    assert acc.tolist() == [[0, 1, 3, 4, 4], [0, 2, 2, 2, 2]]


@pytest.mark.quick
def test_sample_top_k_top_p():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    s = verify.sample(logits, 1.0, top_k=2, generator=g)
    assert set(s.tolist()) == {2, 3}
    p = logits.softmax(-1)[0]
    s = verify.sample(logits, 1.0, top_p=float(p[3]) + 1e-3, generator=g)   # keeps the two most likely tokens
    assert set(s.tolist()) == {2, 3}
    assert torch.equal(verify.sample(logits[:1], 0.0), torch.tensor([3]))


def test_sampling_probs_is_what_verify_samples():
    logits = torch.randn(12, generator=torch.Generator().manual_seed(0)) * 2                 # [V]
    assert torch.equal(verify.sampling_probs(logits, 0.0), torch.nn.functional.one_hot(logits.argmax(), 12).float())
    g = torch.Generator().manual_seed(1)
    for temp, k, p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)):
        probs = verify.sampling_probs(logits, temp, k, p)
        draws = verify.sample(logits.expand(40000, 12), temp, k, p, generator=g)                   # [40000]
        freq = torch.bincount(draws, minlength=12).float() / 40000
        assert (freq - probs).abs().max() < 0.01 and torch.equal(probs > 0, freq > 0)


def test_rows_with_no_token_sample_to_no_token():
    """A row with a NaN or an inf logit, only -inf, or logits that overflow float32 once divided by the temperature
    has nothing to sample from: NO_TOKEN, greedy or sampled (top-k, top-p too); other rows, -inf entries included,
    sample as ever (greedy: the argmax, first of ties). A tree path ends at a node whose token is NO_TOKEN."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [0.0, nan, 1.0, 2.0], [0.0, inf, 1.0, 2.0], [-inf] * 4,
                           [-inf, 1.0, -inf, 0.5], [3e38, 1.0, 0.0, 0.0], [-nan, 0.0, 0.0, 0.0]])
    bad = [False, True, True, True, False, False, True]
    g = torch.Generator().manual_seed(0)
    greedy = verify.sample(logits, 0.0)
    assert greedy.tolist() == [1, verify.NO_TOKEN, verify.NO_TOKEN, verify.NO_TOKEN, 1, 0, verify.NO_TOKEN]
    for temp, k, p in ((1.0, 0, 1.0), (0.5, 2, 1.0), (1.0, 0, 0.9)):
        s = verify.sample(logits[:5], temp, k, p, generator=g)
        assert [t == verify.NO_TOKEN for t in s.tolist()] == bad[:5] and s[4] in (1, 3)
    assert verify.sample(logits[5:6], 1.0, generator=g).tolist() == [0]                  # huge but finite: fine
    assert verify.sample(logits[5:6] / 1e4, 1e-4, generator=g).tolist() == [0]
    assert verify.sample(logits[5:6] / 1e4, 2e-5, generator=g).tolist() == [verify.NO_TOKEN]   # past float32 / T
    tr = five_node_tree()
    acc, n, b = verify.accept(tr, torch.tensor([[11, verify.NO_TOKEN, 0, 99, 0]]))       # node 1 (token 11) had none
    assert acc[0, :int(n)].tolist() == [0, 1] and int(b) == verify.NO_TOKEN
