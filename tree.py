"""
tree.py: the DDTree draft tree (Ringel & Romano, arXiv 2604.12989), built from one drafter pass.

    python tree.py                          # a small tree, printed with its legend
    python -m pytest -q tests/test_tree.py  # the fixed-shape builder == the heap, bit for bit

The drafter (DFlash) gives per-position marginals for the L = block_size - 1 tokens after the root
(the previous bonus token). DDTree drafts the `budget` most probable prefixes under the factorized
distribution Q(y) = prod_d q_d(y_d); the target then verifies all of them in one forward.
Definitions, shared bit for bit by both builders:

  draft_logits [L, V]  row d-1 predicts the token at depth d (the root has depth 0)
  logp_d     = log_softmax(draft_logits[d-1].float()); a non-finite value counts as -inf
  ranks      tokens of each depth ordered by (logp_d desc, token id asc); keep K = min(budget, V)
             (rank_topk)
  prefix     a tuple of ranks (r_1..r_d); score = ((0 + logp_1[r_1]) + logp_2[r_2]) + ...,
             accumulated in depth order in float32 (so every builder rounds identically)
  key        (-score, depth, rank tuple), compared like Python tuples: of equally probable
             prefixes the shallower comes first, then the lower ranks
  tree       the first `budget` prefixes by key (the root is not counted), numbered 1..budget in
             key order

Invariant: node 0 is the root; every node's parent has a smaller index, depths <= L, scores never
increase with the node index, and a tree always has exactly N = budget + 1 nodes (fixed shapes for
CUDA graphs). When V is so small that fewer than `budget` prefixes exist, the tail is padding:
valid = False, token = root token, parent = -1, depth 0, score -inf, ancestor_mask row = itself. A
padding node is nobody's child, so verify never accepts it; whether a node is padding depends only
on (V, L, budget), never on the logit values.

Any drafter output makes a valid tree. A NaN or +inf logit, an all -inf row or a bf16/fp16
overflow gives NaN in log_softmax; rank_topk ranks every non-finite logp as -inf (a NaN would
rank first and push the root out of node 0). So every score is finite or -inf, never NaN, and
the root (score 0, the empty tuple) stays node 0: a broken drafter costs acceptance, never a
token (verify checks every node against the target).

Reading order: Tree; rank_topk; build_tree_heap (the paper's Algorithm 1, the reference);
ddtree_search (the same tree in fixed-shape tensor ops, no host sync: what a decode step runs, in
three named steps with a worked example; kernels.py has it as one Triton launch under the same
name); ancestor_mask (the one mask builder); build_tree / build_tree_batched (what generate.py
calls); chain_tree (DFlash's chain in the same format); format_tree and LEGEND.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import kernels


@dataclass
class Tree:
    tokens: torch.Tensor         # [..., N] int64 token ids; tokens[0] = root (previous bonus token)
    parents: torch.Tensor        # [..., N] int64 parent node index; -1 for the root and padding
    depths: torch.Tensor         # [..., N] int64 0 for root and padding; verify uses start + depths
    scores: torch.Tensor         # [..., N] float32 log Q(prefix); 0 for root, -inf for padding
    valid: torch.Tensor          # [..., N] bool, False only for padding nodes
    ancestor_mask: torch.Tensor  # [..., N, N] bool, row i: i's ancestors (root included) and i

    def __getitem__(self, i) -> Tree:
        """Index the batch dim: tree[b] is row b of a batched tree."""
        return self._map(lambda t: t[i])

    def to(self, device: torch.device | str) -> Tree:
        return self._map(lambda t: t.to(device))

    def _map(self, fn) -> Tree:
        return Tree(*(fn(getattr(self, f.name)) for f in fields(self)))


# -----------------------------------------------------------------------------
# Ranking: the K best tokens of each depth, in the tree's order.

@kernels.fast
def rank_topk(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logp [..., V] float32 -> (lp, tok) [..., k]: each row's first k ranks (module doc). A unique
    int64 key per token orders like (logp desc, id asc), so topk (no sort of V) breaks no tie."""
    V = logp.shape[-1]
    logp = torch.where(logp.isfinite(), logp, float("-inf"))  # NaN's bits would rank it first
    bits = (logp + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes 0.0, which must tie with it
    high = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    keys = (high << 32) | (V - 1 - torch.arange(V, device=logp.device))  # [..., V] int64
    tok = keys.topk(k, dim=-1).indices                                    # [..., k]
    return logp.gather(-1, tok), tok


def rank_tokens(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits [..., L, V] -> (lp, tok) [..., L, k]: log_softmax in float32, then rank_topk."""
    return rank_topk(F.log_softmax(draft_logits.float(), dim=-1), k)


# -----------------------------------------------------------------------------
# The reference: the best-first heap of the paper (Algorithm 1).
# Python on the CPU; tests and teaching.

@np.errstate(over="ignore")   # huge logp sum to -inf, silently, as in the tensor builders
def build_tree_heap(draft_logits: torch.Tensor, root: int | torch.Tensor, budget: int) -> Tree:
    """[L, V] logits -> the DDTree of `budget` nodes below the root, by best-first search over rank
    tuples (as in liranringel/ddtree). Returns CPU tensors.

    Each pop emits the next node, then pushes its next sibling and its first child. Pushed keys
    never precede the popped key (logp <= 0; a child is one deeper), so pops come out in key order
    and the first `budget` pops are the tree."""
    L, V = draft_logits.shape
    K = min(budget, V)
    assert budget >= 0
    lp, tok = rank_tokens(draft_logits, K)
    lp, tok = lp.cpu().numpy(), tok.cpu().tolist()  # [L, K] each; numpy keeps float32 arithmetic
    zero = np.float32(0.0)
    tokens, parents, depths, scores = [int(root)], [-1], [0], [zero]
    # heap entry: (-score, depth, rank tuple, parent node, parent score): the key, then the rest
    heap = [(-(zero + lp[0, 0]), 1, (0,), 0, zero)] if K > 0 and L > 0 else []
    while heap and len(tokens) <= budget:
        neg_score, d, ranks, parent, parent_score = heapq.heappop(heap)
        score, r, node = -neg_score, ranks[-1], len(tokens)
        tokens.append(tok[d - 1][r]); parents.append(parent); depths.append(d); scores.append(score)
        # next sibling: parent_score + logp, never score - logp[r] + logp[r+1] (rounding)
        if r + 1 < K:
            sib = parent_score + lp[d - 1, r + 1]
            heapq.heappush(heap, (-sib, d, ranks[:-1] + (r + 1,), parent, parent_score))
        if d < L:  # first child
            heapq.heappush(heap, (-(score + lp[d, 0]), d + 1, ranks + (0,), node, score))
    # pad to the fixed size budget + 1 (only when fewer than `budget` prefixes exist)
    n, N = len(tokens), budget + 1
    tokens += [int(root)] * (N - n); parents += [-1] * (N - n); depths += [0] * (N - n)
    scores += [np.float32(-np.inf)] * (N - n)
    mask = ancestor_mask(parents, L)                                                # [N, N]
    return Tree(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                depths=torch.tensor(depths),
                scores=torch.tensor(np.array(scores, dtype=np.float32)),
                valid=torch.arange(N) < n, ancestor_mask=mask)


# -----------------------------------------------------------------------------
# The same tree in fixed-shape tensor ops: no host round trip, so a CUDA graph can capture it.

@kernels.fast
def ddtree_search(lp: torch.Tensor, tok: torch.Tensor, roots: torch.Tensor, budget: int) -> tuple:
    """Ranked drafts lp / tok [b, L, K] (rank_tokens; K = min(budget, V)), roots [b] -> the Tree
    fields of N = budget + 1 nodes, build_tree_heap's tree bit for bit, in three steps:

      1. expand (_expand): depth by depth, the best `budget` children of the last survivors survive
         (a tree node has fewer than `budget` better prefixes at its depth: no cut drops it).
         Candidates are numbered: the root, then each depth's survivors in rank-tuple order.
      2. select: a stable sort by score (ties keep the numbering: key order); the first N win.
      3. fields: tokens, depths, parents as node indices; padding and the ancestor mask (_tree).

    A worked example: L = 3, tokens a b c d (ids 0-3), budget 4 (so K = 4), the drafter's q:

                   a     b     c     d      by rank
      depth 1    0.10  0.60  0.25  0.05     b c a d
      depth 2    0.50  0.10  0.30  0.10     a c b d   (b and d tie: the lower id first)
      depth 3    0.80  0.10  0.05  0.05     a b c d

    >>> q = torch.tensor([[.10, .60, .25, .05], [.50, .10, .30, .10], [.80, .10, .05, .05]])
    >>> lp, tok = rank_tokens(q.log()[None], 4)                                # [1, L, K] each
    >>> score, parent, token, depth = _expand(lp, tok, torch.tensor([7]), 4)           # 1.
    >>> [round(p, 3) for p in score[0].exp().tolist()]  # root; b c a d; ba bc ca cc; baa bca ..
    [1.0, 0.6, 0.25, 0.1, 0.05, 0.3, 0.18, 0.125, 0.075, 0.24, 0.144, 0.1, 0.06]
    >>> score.sort(descending=True, stable=True).indices[0, :5].tolist()  # 2. root b ba c baa
    [0, 1, 5, 2, 9]
    >>> tree = Tree(*ddtree_search(lp, tok, torch.tensor([7]), 4))      # 3. (the root token: 7)
    >>> tree.tokens[0].tolist(), tree.parents[0].tolist(), tree.depths[0].tolist()
    ([7, 1, 0, 2, 0], [-1, 0, 1, 0, 2], [0, 1, 2, 1, 3])
    """
    score, parent, token, depth = _expand(lp, tok, roots, budget)   # 1. every candidate [b, 1+M]
    sel = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :budget + 1]  # 2.
    # 3. a selected node's parent is selected: its candidate number becomes its node index
    node = torch.arange(sel.shape[1], device=sel.device).expand_as(sel)               # [b, n]
    node_of = torch.zeros_like(parent).scatter_(1, sel, node)        # [b, 1+M] candidate -> node
    p = parent.gather(1, sel)                                                         # [b, n]
    parents = torch.where(p >= 0, node_of.gather(1, p.clamp(min=0)), -1)             # [b, n]
    return _tree(token.gather(1, sel), parents, depth.gather(1, sel), score.gather(1, sel),
                 budget, lp.shape[1])


def _expand(lp: torch.Tensor, tok: torch.Tensor, roots: torch.Tensor, budget: int) -> list:
    """Step 1 -> each candidate's score (float32), parent (a candidate; root: -1), token and depth
    [b, 1+M], in rank-tuple order: survivors keep it, their children are laid out (parent, rank)."""
    bsz, L, K = lp.shape
    r = roots[:, None]                                                               # [b, 1]
    f_score, first = lp.new_zeros(bsz, 1), 0     # a depth's survivors, the first one's number
    score, parent, token, depth = [f_score], [torch.full_like(r, -1)], [r], [torch.zeros_like(r)]
    for d in range(L if K else 0):
        # (0 + logp at depth 1, like every builder: it turns a -0.0 logp into the heap's 0.0)
        cand = (f_score[:, :, None] + lp[:, d, None, :]).flatten(1)     # [b, n*K] tuple order
        best = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :budget]
        keep = best.sort(dim=1).values                                  # [b, n_keep] tuple order
        f_score = cand.gather(1, keep)
        score.append(f_score)
        parent.append(first + keep // K)
        token.append(tok[:, d].gather(1, keep % K))
        depth.append(torch.full_like(keep, d + 1))
        first += cand.shape[1] // K
    return [torch.cat(t, 1) for t in (score, parent, token, depth)]


def _tree(tokens, parents, depths, scores, budget: int, max_depth: int) -> tuple:
    """Node fields [b, n], root first, n <= N = budget + 1 -> the Tree's fields: padding appended
    (only when V is tiny: module doc) and the ancestor mask of a tree max_depth deep."""
    (b, n), N = tokens.shape, budget + 1
    valid = torch.arange(N, device=tokens.device).expand(b, N) < n                  # [b, N]
    if n < N:
        pad = lambda t, v: F.pad(t, (0, N - n), value=v)                             # [b, N]
        tokens = torch.cat([tokens, tokens[:, :1].expand(b, N - n)], 1)
        parents, depths, scores = pad(parents, -1), pad(depths, 0), pad(scores, float("-inf"))
    return tokens, parents, depths, scores, valid, ancestor_mask(parents, max_depth)


def ancestor_mask(parents, max_depth: int | None = None) -> torch.Tensor:
    """parents [..., N] (-1: none) -> the verify mask [..., N, N] bool: row i marks i and its walk
    up, max_depth steps (default N - 1); a node without a parent is its own, so a walk stays."""
    parents = torch.as_tensor(parents, dtype=torch.long)
    N, dev = parents.shape[-1], parents.device
    walk = [torch.arange(N, device=dev).expand_as(parents)]   # [..., N] each node, then a step up
    up = torch.where(parents >= 0, parents, walk[0])                                 # [..., N]
    for _ in range(N - 1 if max_depth is None else max_depth):
        walk.append(up.gather(-1, walk[-1]))                     # each node's next step up
    mask = torch.zeros(*parents.shape, N, dtype=torch.bool, device=dev)              # [..., N, N]
    return mask.scatter_(-1, torch.stack(walk, -1), True)


# -----------------------------------------------------------------------------
# What a decode step calls.

def build_tree_batched(draft_logits, roots, budget: int) -> Tree:
    """[b, L, V] logits, [b] roots -> Tree of N = budget + 1 nodes ([b, N]): rank, then search."""
    bsz, L, V = draft_logits.shape
    roots = torch.as_tensor(roots, dtype=torch.long, device=draft_logits.device).reshape(bsz)  # [b]
    lp, tok = rank_tokens(draft_logits, min(budget, V))                                  # [b, L, K]
    return Tree(*ddtree_search(lp, tok, roots, budget))


def build_tree(draft_logits: torch.Tensor, root: int | torch.Tensor, budget: int) -> Tree:
    """[L, V] logits and a root token (int or 0-d tensor) -> Tree with fields [budget + 1]."""
    return build_tree_batched(draft_logits[None], torch.as_tensor(root).reshape(1), budget)[0]


# -----------------------------------------------------------------------------
# DFlash chain: the top-1 token at each depth, in the same Tree format.

def chain_tree_batched(draft_logits: torch.Tensor, roots: torch.Tensor | Sequence[int],
                       length: int) -> Tree:
    """[b, L, V] -> chain of min(length, L) nodes below the root, padded to length + 1 nodes."""
    bsz, L, V = draft_logits.shape
    dev, n = draft_logits.device, min(length, L)
    roots = torch.as_tensor(roots, dtype=torch.long, device=dev).reshape(bsz)  # [b]
    lp, tok = (t[:, :, 0] for t in rank_tokens(draft_logits[:, :n], 1))     # [b, n] each: rank 0
    score, acc = [], torch.zeros(bsz, dtype=torch.float32, device=dev)
    for d in range(n):  # accumulate in depth order, like the tree builders (not cumsum: rounding)
        acc = acc + lp[:, d]
        score.append(acc)
    score = torch.stack(score, 1) if n else lp                                 # [b, n]
    tokens = torch.cat([roots[:, None], tok], 1)                               # [b, n+1]
    parents = torch.arange(-1, n, device=dev).repeat(bsz, 1)                   # [b, n+1]: i -> i-1
    depths = torch.arange(n + 1, device=dev).repeat(bsz, 1)                    # [b, n+1]
    zero = torch.zeros(bsz, 1, dtype=torch.float32, device=dev)               # [b, 1] the root's
    scores = torch.cat([zero, score], 1)                                       # [b, n+1]
    return Tree(*_tree(tokens, parents, depths, scores, length, n))


def chain_tree(draft_logits: torch.Tensor, root: int | torch.Tensor, length: int) -> Tree:
    """[L, V] logits -> the DFlash chain (top-1 per depth) as a Tree with fields [length+1]."""
    return chain_tree_batched(draft_logits[None], torch.as_tensor(root).reshape(1), length)[0]


# -----------------------------------------------------------------------------
# Teaching view

LEGEND = ("[i] token  q=0.42  node i and its token; q = exp(score), the drafter's probability of "
          "the path from\n"
          "                  the root to node i (score: the sum of the path's log-probabilities; "
          "it orders the nodes)\n"
          "root              node 0: the last committed token (the previous step's bonus)\n"
          "*                 the accepted path: each of its tokens is the target's own choice "
          "after its parent\n"
          "bonus             the target's token after the accepted path; a step commits the path "
          "and the bonus")


def format_tree(tree: Tree, decode: Callable[[int], str] | None = None,
                accepted: Sequence[int] | torch.Tensor | None = None,
                bonus: int | None = None) -> str:
    """Indented view of one (unbatched) tree, most probable child first (LEGEND says what it
    shows). `accepted`: node indices marked '*' (verify's accepted path); `bonus`: the target's
    token after it."""
    assert tree.tokens.dim() == 1, "format one tree at a time: format_tree(tree[b])"
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    scores, valid = tree.scores.tolist(), tree.valid.tolist()
    marked = set(torch.as_tensor(accepted).tolist()) if accepted is not None else set()
    show = (lambda t: repr(decode(t))) if decode else str
    children = [[] for _ in tokens]
    for i in range(1, len(tokens)):
        if valid[i]:
            children[parents[i]].append(i)   # in node (= key) order: most probable first
    lines = []

    def walk(i: int, indent: str, branch: str) -> None:
        prob = "root" if i == 0 else f"q={np.exp(scores[i]):.4f}"
        mark = "*" if i in marked else " "
        lines.append(f"{mark} {indent}{branch}[{i}] {show(tokens[i])}  {prob}")
        for j, c in enumerate(children[i]):
            last = j == len(children[i]) - 1
            walk(c, indent + ("" if i == 0 else ("    " if branch == "└── " else "│   ")),
                 "└── " if last else "├── ")

    walk(0, "", "")
    if not all(valid):
        lines.append(f"  (+ {valid.count(False)} padding nodes)")
    if bonus is not None:
        lines.append(f"  bonus {show(int(bonus))}")
    return "\n".join(lines)


def print_tree(tree: Tree, decode: Callable[[int], str] | None = None,
               accepted: Sequence[int] | torch.Tensor | None = None,
               bonus: int | None = None) -> None:
    print(format_tree(tree, decode, accepted, bonus))


if __name__ == "__main__":
    # A toy drafter over a 10-word vocabulary: peaked at depth 1, more uncertain deeper down.
    words = ["the", "cat", "dog", "sat", "ran", "on", "mat", "away", ".", "a"]
    torch.manual_seed(0)
    logits = torch.randn(4, len(words)) * torch.tensor([[4.0], [3.0], [2.0], [1.5]])  # [L=4, V=10]
    tree = build_tree(logits, root=0, budget=12)
    heap = build_tree_heap(logits, 0, 12)
    assert all(torch.equal(getattr(tree, f.name), getattr(heap, f.name)) for f in fields(Tree))
    deepest = int(tree.depths.argmax())  # pretend the target agreed with the deepest node's path
    accepted = tree.ancestor_mask[deepest].nonzero()[:, 0]
    print(LEGEND + "\n")
    print(f"DDTree, L={logits.shape[0]}, V={len(words)}, budget=12")
    print_tree(tree, decode=words.__getitem__, accepted=accepted, bonus=8)
    print("\nDFlash chain, length 4")
    print_tree(chain_tree(logits, 0, 4), decode=words.__getitem__)
