"""--budget auto: before each step, a tree of generate.AUTO_BUDGET nodes or one token, whichever
commits faster on this machine and this text. It sits beside the decoding loop, not inside it:
generate_batch attaches it to its Step after the prefill, then runs each step through
AutoStep.next_step; the step itself never meets it.

    python generate.py --raw --prompt "def fib(n):" --budget auto --temperature 1

AutoBudget decides: host arithmetic on the tokens each step committed. AutoStep carries it out: it
times a tree step against a one-token step once, and before a tree that follows one-token steps
(they leave the drafter idle) it runs catch_up, a step function of its own that gives the drafter
the context it missed. Greedy output stays the autoregressive output; sampled tokens follow the
target's distribution but, as the choices follow measured times, do not repeat for a seed.
Tests: python -m pytest -q tests/test_auto.py
"""
from __future__ import annotations

import math
import time

import torch

import model as M


def attach(step, room: int) -> AutoStep | None:
    """step's AutoStep, made on the first call (after a prefill, before the decoding clock starts)
    and kept on the step for later calls. room: free cache slots past the longest prompt; without
    room for a tree and a catch_up there is none (the loop then runs trees while they fit)."""
    if step.auto is None and room > step.width + step.drafter.block_size:
        step.auto = AutoStep(step)
    if step.auto is not None:
        step.auto.control.since_tree = 0     # a new prefill: the drafter has every prompt token
    return step.auto


class AutoStep:
    """--budget auto on one generate.Step: the controller, the time ratio it starts from, and
    catch_up."""

    def __init__(self, step):
        """Every step function compiled or captured first, then a tree step's time over a one-token
        step's, the median of 7 pairs (load on the machine slows both of a pair). Under TP every
        rank takes rank 0's ratio, so all choose alike."""
        self.step, bs = step, step.drafter.block_size
        batch, dev = step.state.root.shape[0], step.state.root.device
        # [B, bs] catch_up's window: each row's last block_size committed tokens
        self.recent = torch.zeros(batch, bs, dtype=torch.long, device=dev)
        for fn in (step.tree_step, step.token_step, self.catch_up):
            self.rehearse(fn)
        pairs = (self.rehearse(step.tree_step) / self.rehearse(step.token_step) for _ in range(7))
        ratio = [sorted(pairs)[3]]
        if M.world_size > 1:
            torch.distributed.broadcast_object_list(ratio, src=0)
        self.control = AutoBudget(ratio[0], bs, batch)

    def next_step(self, fits: bool, prompts: list[list[int]], outs: list[list[int]], hook=None):
        """One step for every row, a tree or one token as the controller says (one token when a
        tree does not fit); before a tree that follows one-token steps, catch_up. prompts, outs:
        each row's tokens so far. Returns each row's committed tokens (Step.run's)."""
        s, c = self.step, self.control
        is_tree = fits and c.tree()
        if is_tree and c.since_tree:
            self.catch_up_on([p + o for p, o in zip(prompts, outs)], c.since_tree)
        rows = s.run(s.tree_step if is_tree else s.token_step, hook)
        live = [len(new) for new in rows if new]          # finished rows commit nothing
        c.observe(is_tree, sum(live) / len(live), len(live))
        return rows

    def catch_up(self, hook=None) -> None:
        """A step function, compiled or captured like tree_step and token_step: the drafter gets the
        last new_ctx_len (<= block_size) tokens it missed. One target forward over the last
        block_size committed tokens (`recent`; both set by catch_up_on) at their own positions gives
        their hidden states, and rewrites their KV with the values it holds; the missed tokens' rows
        go to the front of ctx_feats. Anything missed before those stays out of the drafter's
        context: its rows run on from the older ones."""
        step, s, bs = self.step, self.step.state, self.step.drafter.block_size
        p0 = (s.start - bs).clamp(min=0)          # [B] the window's first position (short rows: 0)
        hidden = step.model(self.recent, start_pos=p0, hidden_layers=step.taps, last_only=True,
                            debug=step.debug).taps                            # [B, bs, taps*D]
        s.new_ctx_len.mul_(s.active)              # finished rows take nothing
        rows = (s.start - p0 - s.new_ctx_len)[:, None] + torch.arange(bs, device=p0.device)
        index = rows.clamp(max=bs - 1)[:, :, None].expand_as(hidden)            # [B, bs, taps*D]
        torch.gather(hidden, 1, index, out=s.ctx_feats)

    def catch_up_on(self, seqs: list[list[int]], missed: int) -> None:
        """catch_up with its inputs: each row's last block_size committed tokens (seqs[b], prompt
        and output, ends with the bonus, not in the cache yet), the last `missed` of which (one per
        one-token step) the drafter takes."""
        bs = self.step.drafter.block_size
        window = [(s[max(len(s) - 1 - bs, 0):-1] + [0] * bs)[:bs] for s in seqs]
        self.recent.copy_(torch.tensor(window))
        self.step.state.new_ctx_len.fill_(min(missed, bs))
        self.step.launch(self.catch_up)

    def rehearse(self, fn) -> float:
        """Run fn once and undo it (its KV writes land past the committed tokens: catch_up's window
        is moved there); its first run compiles or captures it. Returns its seconds."""
        s = self.step.state
        reset = s.snapshot()
        if fn == self.catch_up:
            s.start += self.step.drafter.block_size
        t = time.perf_counter()
        self.step.launch(fn)
        if s.start.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter() - t
        reset()
        return t


class AutoBudget:
    """The controller: tree steps while the running mean of the tokens a tree step commits exceeds
    `ratio`, a tree step's time over a one-token step's: the first depends on the text and the
    temperature, the second on the machine. When trees stop paying (judged after MIN_RUN rows'
    tree steps: a batch's rows are separate texts, so 3 steps at one row, 1 at 3 rows or more),
    a stretch of one-token steps follows (plain decoding, the drafter idle), then a probe:
    catch_up gives the drafter what it missed and trees run again. Each step fades the mean's past
    by KEEP, so the probe counts most. Each time trees stop paying the next stretch doubles (up to
    max_stretch); it resets once a run of trees has paid for a block of steps after its probe. A
    stretch lasts a block at least (min_stretch): each catch_up costs a target forward. Where a tree
    costs many one-token steps (large batches), the longest stretch grows with the ratio, so probes
    that fail take at most PROBE_SHARE of the decoding time."""
    KEEP = 0.97           # the running mean's weight on its past, per step (its memory: ~30 steps)
    MIN_RUN = 3           # rows' tree steps in a run before the controller may leave trees
    MAX_STRETCH = 256     # one-token steps between two probes, at most (where the ratio is small)
    PROBE_SHARE = 0.02    # the decoding time that probes which fail may take, at most

    def __init__(self, ratio: float, block_size: int, rows: int = 1):
        self.ratio, self.min_stretch = ratio, block_size
        # a probe that fails costs its run of trees (MIN_RUN / rows, rounded up) beyond the tokens they
        # commit, and a catch_up (about a tree): (run + 1) x ratio - run one-token steps, against the
        # stretch before it
        run = math.ceil(self.MIN_RUN / rows)
        cost = (run + 1) * ratio - run
        self.max_stretch = max(self.MAX_STRETCH, math.ceil(cost / self.PROBE_SHARE))
        self.stretch = block_size          # the length of the next stretch of one-token steps
        self.stretch_left = 0              # one-token steps left in this stretch
        self.since_tree = 0                # one-token steps since the last tree (or prefill)
        self.run_len = 0                   # tree steps in this run
        self.run_rows = 0                  # the rows they committed for, summed over the steps
        self.run_tokens = 0.0              # the tokens they committed, after the first
        self.mean, self.weight = 0.0, 0.0  # running mean of tokens per tree step per row, weight

    def tree(self) -> bool:
        """The next step: a tree (True) or one token."""
        if self.stretch_left > 0 or 0 < self.since_tree < self.min_stretch:
            self.stretch_left = max(self.stretch_left - 1, 0)
            return False
        return True

    def observe(self, tree: bool, tokens: float, rows: int = 1) -> None:
        """A step ran and committed `tokens` per decoding row, on `rows` decoding rows."""
        self.weight *= self.KEEP
        if not tree:
            self.since_tree += 1
            return
        self.run_tokens += tokens if self.run_len else 0.0
        self.since_tree, self.run_len, self.weight = 0, self.run_len + 1, self.weight + 1
        self.run_rows += rows
        self.mean += (tokens - self.mean) / self.weight
        if self.run_len > self.min_stretch and self.run_tokens > self.ratio * (self.run_len - 1):
            self.stretch = self.min_stretch    # trees have paid for a block: the text is easy again
        if self.run_rows >= self.MIN_RUN and self.mean <= self.ratio:
            self.stretch_left, self.stretch = self.stretch, min(2 * self.stretch, self.max_stretch)
            self.run_len, self.run_rows, self.run_tokens = 0, 0, 0.0
