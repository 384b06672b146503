"""Tree verification for DDTree: the lossless acceptance rule, and the commit of the accepted path
into the compressed KV cache.

Invariants:
  * one target forward verifies the whole tree (generate.Step.tree_step: the tree's tokens, its
    ancestor mask, positions start + depths): node i sits at position start + depth_i and attends
    to the committed prefix plus its own ancestors, so its logits are exactly the logits
    autoregressive decoding would compute after the path root..i;
  * acceptance follows the target's own decoding rule (argmax, or one sample per node at
    temperature T), so the committed tokens are distributed exactly as autoregressive decoding
    (greedy: token for token);
  * after commit, cache slots [start, start + path_len) hold the accepted path's KV in order,
    i.e. the cache equals the cache of an autoregressive run over the same tokens;
  * tensor ops only (no .item(), no per-node Python loop), so a whole step can be captured in a
    CUDA graph.

accept and commit_kv are marked @kernels.fast: on a GPU each is one Triton launch (kernels.py),
equal to the PyTorch written here.

Run the tests: python -m pytest -q tests/test_verify.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from tree import Tree


NO_TOKEN = -1           # sample() where a row has no token: no tree node has it, so none matches it
# The least temperature above 0: fp32 logits / T stays finite while |logits| < 3.4e34 (any working
# model's); below it sampling is greedy but for near-ties anyway. generate and cli refuse less.
MIN_TEMPERATURE = 1e-4


TEMPERATURE_RULE = f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}"


def temperature_ok(temperature: float) -> bool:
    """TEMPERATURE_RULE: 0, or a finite temperature >= MIN_TEMPERATURE (NaN fails both)."""
    return temperature == 0 or MIN_TEMPERATURE <= temperature < float("inf")


def check_temperature(temperature: float, what: str = "temperature") -> None:
    """A ValueError naming `what` unless temperature_ok."""
    if not temperature_ok(temperature):
        raise ValueError(f"{what} must be {TEMPERATURE_RULE}, got {temperature}")


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> the distribution sample() draws from: softmax(logits / T) restricted to
    the top-k / top-p set; at temperature 0 the argmax, one-hot."""
    if temperature <= 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()                    # [..., V]
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1)[0][..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        p = sorted_logits.softmax(-1)
        drop = p.cumsum(-1) - p >= top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(dim=-1)                                                        # [..., V]


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of logits [..., V] (fp32): argmax at temperature 0, else a sample from
    sampling_probs with no host sync: argmax(p / E), E ~ Exponential(1), is distributed as p. A row
    with a NaN or +inf logit, only -inf, or logits / T past fp32 has no token: NO_TOKEN."""
    if temperature <= 0:
        top, tok = logits.max(dim=-1)     # one pass: argmax (first of ties), max (NaN if any is)
        return torch.where(top.isfinite(), tok, NO_TOKEN)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    tok = (probs / torch.empty_like(probs).exponential_(1, generator=generator)).argmax(dim=-1)
    return torch.where(probs[..., 0].isnan(), NO_TOKEN, tok)   # softmax makes such rows all NaN


@kernels.fast
def accept(tree: Tree, target_tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The longest root-to-node path whose every token is the target's token after its parent:
    tree [B, N], target_tokens [B, N] -> accepted [B, N] (the path, root first, its last node
    repeated), path_len [B] (its nodes = tokens committed, bonus included), bonus [B]."""
    B, N = tree.tokens.shape
    parent_target = target_tokens.gather(1, tree.parents.clamp(min=0))              # [B, N]
    match = (tree.tokens == parent_target) & tree.valid                             # [B, N]
    # on the path iff every ancestor below the root matches (bools: mask <= match = "implies")
    ok = (tree.ancestor_mask[:, :, 1:] <= match[:, None, 1:]).all(dim=-1)           # [B, N]
    # siblings carry distinct tokens: at most one child matches, the ok nodes form one chain
    deepest = torch.where(ok, tree.depths, -1).argmax(dim=-1, keepdim=True)         # [B, 1]
    # each path node to its depth (the others to a dump column N); the rest repeat the deepest
    accepted = deepest.repeat(1, N + 1)                                             # [B, N+1]
    node_ids = torch.arange(N, device=tree.tokens.device).expand(B, N)              # [B, N]
    accepted.scatter_(1, torch.where(ok, tree.depths, N), node_ids)
    bonus = target_tokens.gather(1, deepest).squeeze(1)                             # [B]
    return accepted[:, :N], ok.sum(dim=-1), bonus                 # path_len [B]: the chain's nodes


@kernels.fast
def commit_kv(kv_cache: torch.Tensor, start_pos: torch.Tensor | int, accepted: torch.Tensor,
              path_len: torch.Tensor) -> None:
    """The accepted path's KV from slots start + node to start + [0, path_len), every layer at
    once (kv_cache [n_layers, Bmax, S, C]). No recompute: node i sat at position start + depth_i,
    its new slot, and saw only its ancestors. Slots past path_len copy onto themselves."""
    B, N = accepted.shape
    start = torch.as_tensor(start_pos, device=accepted.device).view(-1, 1).expand(B, 1)  # [B, 1]
    j = torch.arange(N, device=accepted.device)                                           # [N]
    src = start + torch.where(j < path_len.view(B, 1), accepted, j)                     # [B, N]
    kv = kv_cache[:, :B]                                                       # [n_layers, B, S, C]
    slots = lambda t: t[None, :, :, None].expand(len(kv), B, N, kv.shape[3])  # [n_layers, B, N, C]
    kv.scatter_(2, slots(start + j), kv.gather(2, slots(src)))  # gathered first: no aliasing
