"""
tree.py: the DDTree draft tree (Ringel & Romano, arXiv 2604.12989), built from one drafter pass.

    python tree.py                          # a small tree, printed with its legend
    python -m pytest -q tests/test_tree.py  # the fixed-shape builder == the heap, bit for bit

The drafter (DFlash) gives per-position marginals for the L = block_size - 1 tokens after the root (the previous
bonus token). DDTree drafts the B most probable prefixes under the factorized distribution Q(y) = prod_d q_d(y_d);
the target then verifies all of them in one forward. Definitions, shared bit for bit by both builders:

  draft_logits [L, V]  row d-1 predicts the token at depth d (the root has depth 0)
  logp_d     = log_softmax(draft_logits[d-1].float()), where a non-finite value counts as -inf
  ranks      tokens of each depth ordered by (logp_d desc, token id asc); keep K = min(B, V)  (rank_topk)
  prefix     a tuple of ranks (r_1..r_d); score = ((0 + logp_1[r_1]) + logp_2[r_2]) + ..., accumulated in
             depth order in float32 (so every builder rounds identically)
  key        (-score, rank tuple), compared like Python tuples: a proper prefix sorts before its extensions
  tree       the first B prefixes by key (B = budget, the root is not counted), numbered 1..B in key order

Invariant: node 0 is the root; every node's parent has a smaller index, depths <= L, scores never increase with
the node index, and a tree always has exactly N = B + 1 nodes (fixed shapes for CUDA graphs). When V is so small
that fewer than B prefixes exist, the tail is padding: valid = False, token = root token, parent = -1, depth 0,
score -inf, ancestor_mask row = itself. A padding node is nobody's child, so verify never accepts it; whether a
node is padding depends only on (V, L, B), never on the logit values.

Any drafter output makes a valid tree. A NaN or +inf logit, an all -inf row or a bf16/fp16
overflow gives NaN in log_softmax; rank_topk ranks every non-finite logp as -inf (a NaN would
rank first and push the root out of node 0). So every score is finite or -inf, never NaN, and
the root (score 0, the empty tuple) stays node 0: a broken drafter costs acceptance, never a
token (verify checks every node against the target).

Reading order: Tree; rank_topk; build_tree_heap (the paper's Algorithm 1, the reference); ddtree_search (the
same tree in fixed-shape tensor ops, no host sync: what a decode step runs; kernels.py has it as one Triton
launch under the same name); build_tree / build_tree_batched (what generate.py calls); chain_tree (DFlash's
chain in the same format); format_tree and LEGEND.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import kernels
import model as M


@dataclass
class Tree:
    tokens: torch.Tensor         # [..., N] int64 token ids; tokens[0] = root (previous bonus token)
    parents: torch.Tensor        # [..., N] int64 parent node index; -1 for the root and padding
    depths: torch.Tensor         # [..., N] int64 0 for root and padding; verify uses start + depths
    scores: torch.Tensor         # [..., N] float32 log Q(prefix); 0 for root, -inf for padding
    valid: torch.Tensor          # [..., N] bool, False only for padding nodes
    ancestor_mask: torch.Tensor  # [..., N, N] bool, row i: i's ancestors (root included) and i
    # [..., N] int64: ancestor_mask's rows packed (bit j of word i = ancestor_mask[i, j], bit 63 the sign bit), the
    # form the target's attention and the accept kernel take; None when N > 64
    mask_bits: torch.Tensor | None = None

    def __getitem__(self, i) -> Tree:
        """Index the batch dim: tree[b] is row b of a batched tree."""
        return self._map(lambda t: t[i])

    def to(self, device: torch.device | str) -> Tree:
        return self._map(lambda t: t.to(device))

    def _map(self, fn) -> Tree:
        return Tree(*(None if (t := getattr(self, f.name)) is None else fn(t) for f in fields(self)))


def pack_rows(mask: torch.Tensor) -> torch.Tensor | None:
    """The tree's mask rows packed as the target's attention takes them (model.tree_mask_bits): [..., N, N] bool ->
    [..., N] int64, or None when N > 64 (one word per row)."""
    return M.tree_mask_bits(mask) if mask.shape[-1] <= M.MASK_WORD_BITS else None


# -----------------------------------------------------------------------------
# Ranking: the K best tokens of each depth, in the tree's order.

@kernels.fast
def rank_topk(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logp [..., V] float32 -> (lp, tok) [..., k]: the k best tokens of each row by (logp desc, token id asc),
    and their logp. Each token gets one int64 key that orders like that pair (the float's bits made
    order-preserving in the high word, V-1-token in the low one): the keys are unique, so topk has no tie to
    break its own way, and no sort of the whole vocabulary is needed.
    A non-finite logp counts as -inf, in the order and in lp (module doc: any drafter output)."""
    V = logp.shape[-1]
    logp = torch.where(logp.isfinite(), logp, float("-inf"))   # NaN's bits would rank it first
    bits = (logp + 0.0).view(torch.int32).long()           # + 0.0 turns -0.0 into 0.0, which must tie with it
    high = bits ^ ((bits >> 31) & 0x7FFFFFFF)              # negative floats: flip the magnitude bits
    keys = (high << 32) | (V - 1 - torch.arange(V, device=logp.device))                       # [..., V] int64
    tok = keys.topk(k, dim=-1).indices                                                         # [..., k]
    return logp.gather(-1, tok), tok


def rank_tokens(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits [..., L, V] -> (lp, tok) [..., L, k]: log_softmax in float32, then rank_topk."""
    return rank_topk(F.log_softmax(draft_logits.float(), dim=-1), k)


# -----------------------------------------------------------------------------
# The reference: the best-first heap of the paper (Algorithm 1). Python on the CPU; tests and teaching.

@np.errstate(over="ignore")   # huge logp sum to -inf, silently, as in the tensor builders
def build_tree_heap(draft_logits: torch.Tensor, root: int | torch.Tensor, budget: int) -> Tree:
    """[L, V] logits -> the DDTree of `budget` nodes below the root, by best-first search over rank tuples (as in
    liranringel/ddtree). Returns CPU tensors.

    Each pop emits the next node, then pushes its next sibling and its first child. Pushed keys never precede
    the popped key (logp <= 0), so pops come out in key order and the first B pops are the tree."""
    L, V = draft_logits.shape
    B, K = budget, min(budget, V)
    assert B >= 0
    lp, tok = rank_tokens(draft_logits, K)
    lp, tok = lp.cpu().numpy(), tok.cpu().tolist()  # [L, K] each; numpy keeps float32 arithmetic
    zero = np.float32(0.0)
    tokens, parents, depths, scores = [int(root)], [-1], [0], [zero]
    # heap entry: (-score, rank tuple, parent node, parent score); the tuple breaks score ties
    heap = [(-(zero + lp[0, 0]), (0,), 0, zero)] if K > 0 and L > 0 else []
    while heap and len(tokens) <= B:
        neg_score, ranks, parent, parent_score = heapq.heappop(heap)
        score, d, r, node = -neg_score, len(ranks), ranks[-1], len(tokens)
        tokens.append(tok[d - 1][r]); parents.append(parent); depths.append(d); scores.append(score)
        if r + 1 < K:  # next sibling: parent_score + logp, never score - logp[r] + logp[r+1] (rounding)
            sib = parent_score + lp[d - 1, r + 1]
            heapq.heappush(heap, (-sib, ranks[:-1] + (r + 1,), parent, parent_score))
        if d < L:  # first child
            heapq.heappush(heap, (-(score + lp[d, 0]), ranks + (0,), node, score))
    # pad to the fixed size B + 1 (only happens when fewer than B prefixes exist)
    n, N = len(tokens), B + 1
    tokens += [int(root)] * (N - n); parents += [-1] * (N - n); depths += [0] * (N - n)
    scores += [np.float32(-np.inf)] * (N - n)
    mask = torch.zeros(N, N, dtype=torch.bool)  # [N, N]: a node's row is its parent's row plus itself
    for i in range(N):
        if 0 < i < n:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    return Tree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                scores=torch.tensor(np.array(scores, dtype=np.float32)), valid=torch.arange(N) < n,
                ancestor_mask=mask, mask_bits=pack_rows(mask))


# -----------------------------------------------------------------------------
# The same tree in fixed-shape tensor ops: no host round trip, so a CUDA graph can capture it.

@kernels.fast
def ddtree_search(lp: torch.Tensor, tok: torch.Tensor, roots: torch.Tensor, budget: int) -> tuple:
    """Ranked drafts lp / tok [b, L, K] (rank_tokens; K = min(budget, V)), roots [b] int64 -> the node fields of
    N = budget + 1 nodes: (tokens, parents, depths [b, N] int64, scores [b, N] float32, valid [b, N] bool,
    ancestor_mask [b, N, N] bool, mask_bits [b, N] int64 or None when N > 64), build_tree_heap's tree bit for bit.

    Per-depth top-B expansion. The best B prefixes overall form a prefix-closed set, and each of their depth-d
    members has fewer than B better prefixes at depth d, so it survives a top-B cut among the children of the
    depth d-1 survivors. Merging all depths' survivors and taking the first B by key gives the heap's tree, in
    the heap's order."""
    bsz, L, K = lp.shape
    B, dev = budget, lp.device
    assert B >= 0
    if B == 0 or L == 0 or K == 0:  # root-only tree (plus padding)
        empty = torch.zeros(bsz, 0, dtype=torch.long, device=dev)  # [b, 0]
        return _astuple(_assemble(roots, empty, empty, empty, empty.float(), B, L))
    p = _plan(B, K, L, dev)
    W = p.digits.shape[-1]

    # 1) Per-depth expansion. Each depth's survivors are kept in lexicographic order of their rank tuples, so
    # children laid out as (parent, rank) row-major are lexicographic too, and a stable sort by score puts them
    # in key order: ties fall back to the tuple order for free. (A frontier kept in *score* order would break
    # ties between children of parents with different scores the wrong way: see
    # test_frontier_lex_order_regression.) Depth 1 keeps all K children of the root, already in key order. Per
    # candidate: score, packed rank tuple (key) and index among its parents' children (keep = parent * K + rank).
    # (0 + logp like every builder: it also turns a -0.0 logp into the heap's 0.0)
    f_score, f_key = p.zero + lp[:, 0], p.digits[0].expand(bsz, K, W)   # [b, K], [b, K, W]
    scores = [p.zero.expand(bsz, 1), f_score]                          # the root, depth 1, ...
    keys, keeps = [p.head_key.expand(bsz, -1, W)], [p.head_keep.expand(bsz, -1)]    # the root and depth 1, ...
    for d in range(1, L):
        cand = (f_score[:, :, None] + lp[:, d, None, :]).flatten(1)  # [b, n_prev*K] f32, lex order
        best = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :p.sizes[d]]  # key order
        keep = best.sort(dim=1).values                               # [b, n_keep] back to lex order
        f_score = cand.gather(1, keep)                               # [b, n_keep]
        f_key = (f_key[:, :, None] + p.digits[d]).flatten(1, 2).gather(1, keep[:, :, None].expand(-1, -1, W))
        scores.append(f_score)
        keys.append(f_key)
        keeps.append(keep)
    score, key, keep = torch.cat(scores, 1), torch.cat(keys, 1), torch.cat(keeps, 1)   # [b, 1+M](, W)

    # 2) Merge the depths: stable sort by score on top of the global lexicographic order. The root (score 0,
    # empty tuple) comes first; fewer than B real nodes only when V is tiny (static shapes).
    lex = _lex_order(key)                                                            # [b, 1+M]
    n = p.node_ids.shape[0]                                                          # 1 + min(B, M)
    by_key = torch.sort(score.gather(1, lex), dim=1, descending=True, stable=True).indices[:, :n]
    sel = lex.gather(1, by_key)                       # [b, n] candidate ids in node order 0..n-1

    # 3) Node fields. Parents: candidate id -> node index (every selected node's parent is selected); the extra
    # last slot is the root's parent, -1.
    node_of = torch.full((bsz, key.shape[1] + 1), -1, device=dev).scatter_(
        1, sel, p.node_ids.expand(bsz, n))                                          # [b, 2+M]
    parents = node_of.gather(1, (keep // K + p.parent_base).gather(1, sel))          # [b, n]
    tok_all = torch.cat([roots[:, None, None].expand(bsz, 1, K), tok], 1).flatten(1)  # [b, (1+L)*K]
    tokens = tok_all.gather(1, (keep % K + p.token_base).gather(1, sel))             # [b, n]
    depths = p.depth[sel]                                                            # [b, n]
    # ancestor mask: j is an ancestor of i (or i) iff i's rank tuple starts with j's, i.e. i's key with
    # everything past depth_j cleared equals j's key
    node_key = key.gather(1, sel[:, :, None].expand(-1, -1, W))                     # [b, n, W]
    mask = ((node_key[:, :, None] & p.prefix[depths][:, None]) == node_key[:, None]).all(-1)  # [b, n, n]
    valid = torch.ones(bsz, n, dtype=torch.bool, device=dev)                         # [b, n]
    return _astuple(_pad(Tree(tokens, parents, depths, score.gather(1, sel), valid, mask), B + 1))


def _lex_order(keys: torch.Tensor) -> torch.Tensor:
    """Permutation that sorts packed rank tuples [b, M, W] like Python tuples (see _Plan.digits).

    LSD radix sort: one stable sort per word, from the last (least significant) word to word 0."""
    order = keys[..., -1].sort(dim=1, stable=True).indices                        # [b, M]
    for w in range(keys.shape[-1] - 2, -1, -1):
        order = order.gather(1, keys[..., w].gather(1, order).sort(dim=1, stable=True).indices)
    return order


@dataclass
class _Plan:
    """What the expansion looks like for one (B, K, L): survivor counts and constant tensors, built once per
    shape on the device instead of on every step. Candidates are numbered root first (id 0), then depth 1's
    survivors, depth 2's, ...: the per-candidate tables below are laid out that way ([1+M])."""
    sizes: list[int]            # survivors per depth: all K children of the root, then min(B, previous * K)
    digits: torch.Tensor        # [L, K, W] int64: rank r at depth d+1 as the digit r+1, shifted into its word
    prefix: torch.Tensor        # [L+1, W] int64: the bits of a tuple's first e digits (ancestor test)
    head_key: torch.Tensor      # [1, 1+K, W] the root's key (0: empty tuple) and depth 1's
    head_keep: torch.Tensor     # [1, 1+K] the root and depth 1 as "kept" indices (0, then ranks 0..K-1)
    zero: torch.Tensor          # [1, 1] float32: the root's score
    depth: torch.Tensor         # [1+M] int64
    parent_base: torch.Tensor   # [1+M] id of the first candidate one depth up (root: id M+1, a -1 slot)
    token_base: torch.Tensor    # [1+M] offset of the candidate's depth in [root x K, tok[:, 0], tok[:, 1], ...]
    node_ids: torch.Tensor      # [n+1] 0..n, n = min(B, M) real non-root nodes


_PLANS: dict = {}   # (B, K, L, device) -> _Plan; never evicted: captured CUDA graphs keep reading these


def _plan(B: int, K: int, L: int, device: torch.device) -> _Plan:
    """The cached _Plan of (B, K, L) on `device` (host work, once per shape: before any graph capture)."""
    if (B, K, L, device) in _PLANS:
        return _PLANS[B, K, L, device]
    sizes = [K]
    for _ in range(1, L):
        sizes.append(min(B, sizes[-1] * K))
    M, first = sum(sizes), [1 + sum(sizes[:d]) for d in range(L)]   # first: id of depth d+1's first candidate
    # a rank tuple (r_1..r_d) packed as digits r_i+1 (0 = absent, so a prefix sorts first), most significant
    # first, `per` digits of `bits` bits to an int64 word (below 2^62: no sign bit), W words
    bits = K.bit_length()
    per = max(1, 62 // bits)
    W = -(-L // per)
    digits = torch.zeros(L, K, W, dtype=torch.long)                                      # [L, K, W]
    prefix = torch.zeros(L + 1, W, dtype=torch.long)                                     # [L+1, W]
    for d in range(L):
        shift = bits * (per - 1 - d % per)
        digits[d, :, d // per] = (torch.arange(K) + 1) << shift
        prefix[d + 1:, d // per] |= ((1 << bits) - 1) << shift
    depth, parent_base, token_base = [0], [M + 1], [0]
    for d, n_d in enumerate(sizes):
        depth += [d + 1] * n_d
        parent_base += [first[d - 1] if d else 0] * n_d
        token_base += [(1 + d) * K] * n_d
    head_key = torch.cat([torch.zeros(1, W, dtype=torch.long), digits[0]])[None]         # [1, 1+K, W]
    head_keep = torch.tensor([0] + list(range(K)))[None]                                 # [1, 1+K]
    on = lambda t: torch.as_tensor(t).to(device)
    _PLANS[B, K, L, device] = p = _Plan(
        sizes, on(digits), on(prefix), on(head_key), on(head_keep), on(torch.zeros(1, 1)), on(depth),
        on(parent_base), on(token_base), on(list(range(min(B, M) + 1))))
    return p


def _ancestor_mask(parents: torch.Tensor, depth_limit: int) -> torch.Tensor:
    """[b, N] parents (-1 = none) -> [b, N, N] bool: row i = i and all of its ancestors."""
    b, N = parents.shape
    eye = torch.eye(N, dtype=torch.bool, device=parents.device).expand(b, N, N)  # [b, N, N]
    has_parent = (parents >= 0)[:, :, None]                                      # [b, N, 1]
    idx = parents.clamp(min=0)[:, :, None].expand(b, N, N)                       # [b, N, N]
    mask = eye
    for _ in range(depth_limit):  # after k rounds every row of depth <= k is complete
        mask = eye | (mask.gather(1, idx) & has_parent)  # row i |= row parent(i)
    return mask


def ancestor_mask(parents) -> torch.Tensor:
    """A parent list (parents[i] < i, -1 for the root) -> [N, N] bool verify mask: row i = i and its ancestors."""
    p = torch.as_tensor(parents, dtype=torch.long).view(1, -1)                   # [1, N]
    return _ancestor_mask(p, max(p.shape[1] - 1, 0))[0]                          # [N, N]


def _assemble(roots: torch.Tensor, tok: torch.Tensor, par: torch.Tensor, dep: torch.Tensor,
              score: torch.Tensor, budget: int, depth_limit: int) -> Tree:
    """Prepend the root, build the ancestor mask, pad to N = budget + 1 (_pad).

    tok/par/dep/score are [b, n] for the n <= budget real non-root nodes, in node order 1..n."""
    b, n = tok.shape
    col = lambda v, dt: torch.full((b, 1), v, dtype=dt, device=tok.device)             # [b, 1]
    parents = torch.cat([col(-1, torch.long), par], dim=1)                              # [b, n+1]
    tokens = torch.cat([roots[:, None], tok], dim=1)                                    # [b, n+1]
    depths = torch.cat([col(0, torch.long), dep], dim=1)                                # [b, n+1]
    scores = torch.cat([col(0.0, torch.float32), score], dim=1)                         # [b, n+1]
    valid = torch.ones(b, n + 1, dtype=torch.bool, device=tok.device)                  # [b, n+1]
    return _pad(Tree(tokens, parents, depths, scores, valid, _ancestor_mask(parents, depth_limit)), budget + 1)


def _pad(tr: Tree, N: int) -> Tree:
    """Append padding nodes up to N (see the module doc; only when V is tiny) and pack the mask rows."""
    b, n = tr.tokens.shape
    if n < N:
        pad = lambda t, v: F.pad(t, (0, N - n), value=v)                             # [b, N]
        eye = torch.eye(N, dtype=torch.bool, device=tr.tokens.device)                # [N, N]
        tr = Tree(torch.cat([tr.tokens, tr.tokens[:, :1].expand(b, N - n)], 1), pad(tr.parents, -1),
                  pad(tr.depths, 0), pad(tr.scores, float("-inf")), pad(tr.valid, False),
                  F.pad(tr.ancestor_mask, (0, N - n, 0, N - n)) | eye)
    tr.mask_bits = pack_rows(tr.ancestor_mask)                                       # [b, N] or None
    return tr


def _astuple(tr: Tree) -> tuple:
    return tuple(getattr(tr, f.name) for f in fields(tr))


# -----------------------------------------------------------------------------
# What a decode step calls.

def build_tree_batched(draft_logits: torch.Tensor, roots: torch.Tensor | Sequence[int], budget: int) -> Tree:
    """[b, L, V] logits, [b] roots -> Tree with fields [b, B+1] (mask [b, B+1, B+1]): rank, then search."""
    bsz, L, V = draft_logits.shape
    roots = torch.as_tensor(roots, dtype=torch.long, device=draft_logits.device).reshape(bsz)  # [b]
    lp, tok = rank_tokens(draft_logits, min(budget, V))                                        # [b, L, K]
    return Tree(*ddtree_search(lp, tok, roots, budget))


def build_tree(draft_logits: torch.Tensor, root: int | torch.Tensor, budget: int) -> Tree:
    """[L, V] logits and a root token (int or 0-d tensor) -> Tree with fields [B+1]."""
    return build_tree_batched(draft_logits[None], torch.as_tensor(root).reshape(1), budget)[0]


# -----------------------------------------------------------------------------
# DFlash chain: the top-1 token at each depth, in the same Tree format.

def chain_tree_batched(draft_logits: torch.Tensor, roots: torch.Tensor | Sequence[int], length: int) -> Tree:
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
    par = torch.arange(n, device=dev).expand(bsz, n)                           # node i+1 -> i
    return _assemble(roots, tok, par, par + 1, score, length, L)


def chain_tree(draft_logits: torch.Tensor, root: int | torch.Tensor, length: int) -> Tree:
    """[L, V] logits -> the DFlash chain (top-1 per depth) as a Tree with fields [length+1]."""
    return chain_tree_batched(draft_logits[None], torch.as_tensor(root).reshape(1), length)[0]


# -----------------------------------------------------------------------------
# Teaching view

LEGEND = ("[i] token  q=0.42  node i and its token; q = exp(score), the drafter's probability of the path from\n"
          "                  the root to node i (score: the sum of the path's log-probabilities; it orders the nodes)\n"
          "root              node 0: the last committed token (the previous step's bonus)\n"
          "*                 the accepted path: each of its tokens is the target's own choice after its parent\n"
          "bonus             the target's token after the accepted path; a step commits the path and the bonus")


def format_tree(tree: Tree, decode: Callable[[int], str] | None = None,
                accepted: Sequence[int] | torch.Tensor | None = None, bonus: int | None = None) -> str:
    """Indented view of one (unbatched) tree, most probable child first (LEGEND says what it shows).
    `accepted`: node indices marked '*' (verify's accepted path); `bonus`: the target's token after it."""
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
        lines.append(f"{'*' if i in marked else ' '} {indent}{branch}[{i}] {show(tokens[i])}  {prob}")
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
               accepted: Sequence[int] | torch.Tensor | None = None, bonus: int | None = None) -> None:
    print(format_tree(tree, decode, accepted, bonus))


if __name__ == "__main__":
    # A toy drafter over a 10-word vocabulary: peaked at depth 1, more uncertain deeper down.
    words = ["the", "cat", "dog", "sat", "ran", "on", "mat", "away", ".", "a"]
    torch.manual_seed(0)
    logits = torch.randn(4, len(words)) * torch.tensor([[4.0], [3.0], [2.0], [1.5]])  # [L=4, V=10]
    tree = build_tree(logits, root=0, budget=12)
    heap = build_tree_heap(logits, 0, 12)
    assert all(torch.equal(a, b) for a, b in zip(_astuple(tree), _astuple(heap)))
    deepest = int(tree.depths.argmax())          # pretend the target agreed with the deepest node's path
    accepted = tree.ancestor_mask[deepest].nonzero()[:, 0]
    print(LEGEND + "\n")
    print(f"DDTree, L={logits.shape[0]}, V={len(words)}, budget=12")
    print_tree(tree, decode=words.__getitem__, accepted=accepted, bonus=8)
    print("\nDFlash chain, length 4")
    print_tree(chain_tree(logits, 0, 4), decode=words.__getitem__)
