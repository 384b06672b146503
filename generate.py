"""Generate text with Kimi K2.6 (or the bundled tiny K2-architecture model): autoregressive, the
DFlash chain, or DDTree speculative decoding.

    python generate.py --raw --prompt "def fib(n):"      # the bundled tiny pair continues code
    python generate.py --raw --prompt "def fib(n):" --budget 16 --show-tree --trace step.html
    python generate.py --raw --prompt "def fib(n):" --budget auto --temperature 1
    torchrun --nproc-per-node 8 generate.py --ckpt <K2.6 dir> --draft <DFlash dir> --cuda-graph

Invariant: greedy DDTree output == greedy autoregressive output, token for token
(tests/test_generate.py); at temperature T every committed token is a sample of the target's own
distribution.

In run order: State, the step's buffers; Step.tree_step, the step, written once (1 draft, 2 build
tree, 3 verify, 4 accept, 5 commit), and Step.token_step, its one-token twin, with no host sync
inside; Step.prefill; Step.run, which runs a step and reads what it committed (eager: the function
itself; --compile / --cuda-graph: runner.py wraps that same function); generate_batch, the loop:
prefill, then steps, then stream, with Rows, its per-row bookkeeping (generate() is the loop for
one prompt). --budget auto picks a tree or one token before each step, beside the loop:
autobudget.py. The command line is cli.py; `python generate.py` runs it.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import NamedTuple

if __name__ == "__main__":    # Ctrl-C while torch imports, before cli.main takes over: one line
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted (Ctrl-C)", file=sys.stderr),
                                             os._exit(130)))
import torch

import autobudget as A
import model as M
import runner
import tree as ddtree
import verify

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED_TARGET = os.path.join(HERE, "checkpoints", "tiny-k2")
BUNDLED_DRAFT = os.path.join(HERE, "checkpoints", "tiny-k2-dflash")
AUTO_BUDGET = 8        # --budget auto: trees of this budget, or one token per step


@dataclass
class State:
    """The step's inputs and outputs for a batch of rows (row b uses cache row b): device buffers
    that every step rewrites in place and never replaces, since a captured CUDA graph keeps reading
    the tensors it was captured with. Integers are int64."""
    root: torch.Tensor         # [B] the last committed token (the last bonus): the next tree's root
    start: torch.Tensor        # [B] committed cache length: the root goes to slot start
    ctx_len: torch.Tensor      # [B] context rows in the drafter's cache
    new_ctx_len: torch.Tensor  # [B] rows of ctx_feats the drafter caches next
    ctx_feats: torch.Tensor    # [B, block_size, taps*D] target hidden states on the last path
    active: torch.Tensor       # [B] bool; False: the row finished, it commits nothing
    out: torch.Tensor          # [B, 1 + width] for the host: how many tokens committed, then them

    @staticmethod
    def zeros(batch: int, width: int, block_size: int, feat_dim: int, dtype, device) -> State:
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)
        return State(z(batch), z(batch), z(batch), z(batch),
                     torch.zeros(batch, block_size, feat_dim, dtype=dtype, device=device),
                     torch.ones(batch, dtype=torch.bool, device=device), z(batch, 1 + width))

    def snapshot(self):
        """A function that puts every buffer back as it is now (a capture undoes its warm-up)."""
        saved = {f.name: getattr(self, f.name).clone() for f in fields(self)}
        return lambda: [getattr(self, name).copy_(t) for name, t in saved.items()]


class Step:
    """One decoding step for a batch of rows: tree_step (a tree, or the chain) and token_step (one
    token), on the buffers of `state`; __init__, at the end, sets its settings (model, drafter,
    budget, width, taps). A finished row is masked, not removed: it commits nothing, and its writes
    land past its last token, where nothing reads them."""

    def tree_step(self, hook=None) -> View:
        """One DDTree (or chain) step for every row. hook(stage) runs after each stage: eager mode's
        clock; None when compiled or captured (nothing inside the step waits for the device)."""
        m, d, s, lap = self.model, self.drafter, self.state, hook or (lambda stage: None)
        # 1. draft: one drafter forward (first caching the context rows of last step's path)
        draft_logits = d.draft_logits(m, s.root, s.ctx_feats, s.ctx_len, s.new_ctx_len)  # [B, L, V]
        s.ctx_len += s.new_ctx_len
        lap("draft")
        # 2. build tree: the `budget` most probable prefixes (or the chain of top-1 tokens)
        tree = (ddtree.chain_tree_batched(draft_logits, s.root, d.block_size - 1) if self.chain
                else ddtree.build_tree_batched(draft_logits, s.root, self.budget))  # fields [B, N]
        lap("tree")
        # 3. verify: one target forward, node i at position start + depth_i seeing its ancestors
        logits, taps = m(tree.tokens, start_pos=s.start, positions=s.start[:, None] + tree.depths,
                         tree_mask=tree.ancestor_mask, hidden_layers=self.taps,
                         debug=self.debug)                             # [B, N, V], [B, N, taps*D]
        lap("verify")
        # 4. accept: the target's token after every node, then the longest path it agrees with
        targets = verify.sample(logits, *self.sampling)                             # [B, N]
        accepted, path_len, bonus = verify.accept(tree, targets)           # [B, N], [B], [B]
        n = path_len * s.active                   # [B] tokens committed (finished rows: 0)
        # 5. commit: the path's KV to slots start.., its hidden states to the drafter's context
        verify.commit_kv(m.kv_cache, s.start, accepted, n)
        k = min(self.width, d.block_size)
        torch.gather(taps, 1, accepted[:, :k, None].expand(-1, -1, taps.shape[-1]),
                     out=s.ctx_feats[:, :k])
        s.new_ctx_len.copy_(n)
        self._commit(n, tree.tokens.gather(1, accepted), path_len, bonus)
        lap("commit")
        return View(tree, targets, accepted, path_len, logits, draft_logits)

    def token_step(self, hook=None) -> None:
        """One autoregressive token per row: no drafter, budget 0, or a tree that no longer fits."""
        s = self.state
        logits = self.model(s.root[:, None], start_pos=s.start, debug=self.debug).logits
        tok = verify.sample(logits[:, -1], *self.sampling)                              # [B]
        self._commit(s.active, s.root[:, None], self.one, tok)    # the path: the root alone
        if hook:
            hook("verify")

    def _commit(self, n, path, path_len, bonus) -> None:
        """Row b commits n[b] tokens (0 once finished): path[b, 1:path_len[b]] (after the root),
        then bonus[b], the next root. `out` gets the count, then them."""
        s = self.state
        s.out[:, 0] = n
        s.out[:, 1:path.shape[1]] = path[:, 1:]
        s.out.scatter_(1, path_len[:, None], bonus[:, None])
        s.start += n
        torch.where(s.active, bonus, s.root, out=s.root)         # in place: one kernel, no copy

    def prefill(self, prompts: list[list[int]], debug: bool = False) -> None:
        """Before the first step: each prompt's KV into its own cache row (no padding), its tapped
        hidden states into the drafter's context, its first token into root."""
        s = self.state
        for b, p in enumerate(prompts):
            fwd = self.model(torch.tensor([p], device=s.root.device), start_pos=0, last_only=True,
                             hidden_layers=self.taps, cache_row=b, debug=debug)
            if self.drafter is not None:
                self.drafter.append_context(fwd.taps, 0, row=b)
            s.root[b:b + 1] = verify.sample(fwd.logits[:, -1], *self.sampling)
            s.start[b] = len(p)
        s.ctx_len.copy_(s.start)
        s.new_ctx_len.zero_()
        s.active.fill_(True)

    def run(self, fn, hook=None) -> list[list[int]]:
        """One step, fn: self.tree_step or self.token_step. Each row's new tokens ([]: finished)."""
        self.launch(fn, hook)
        return [r[1:1 + r[0]] for r in self.state.out.tolist()]   # the step's one host copy

    def launch(self, fn, hook=None) -> None:
        """fn once, no host read: itself, or runner.py's compile or graph. Keeps what it returns."""
        self.view = fn(hook) if self.runner is None else self.runner(fn, self.state.snapshot)

    def __init__(self, model, drafter, batch, budget, chain, sampling, mode="eager", debug=False):
        self.model, self.drafter, self.budget, self.chain = model, drafter, budget, chain
        self.sampling = sampling                       # (temperature, top_k, top_p)
        self.debug = debug and mode in ("eager", "static")   # NaN/inf checks: they read the host
        self.width = verify_width(drafter, budget, chain)    # tokens per target forward
        self.taps = tuple(drafter.target_layer_ids) if drafter else ()  # layers the drafter reads
        dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        self.state = State.zeros(batch, self.width, drafter.block_size if drafter else 1,
                                 len(self.taps) * model.args.hidden_size, dtype, dev)
        self.one = torch.ones(batch, dtype=torch.long, device=dev)  # [B] token_step's path_len
        # --compile, --cuda-graph: the same functions, wrapped (runner.py); None: run as they are
        self.runner = runner.Runner(mode) if mode in ("compile", "graph", "graph+compile") else None
        self.view: View | None = None              # what the last tree step left for a viewer
        self.auto: A.AutoStep | None = None        # --budget auto's machinery (autobudget.py)


class View(NamedTuple):
    """What a tree step leaves for a viewer (--show-tree, --trace) to read after it."""
    tree: ddtree.Tree              # fields [B, N]
    targets: torch.Tensor          # [B, N] the target's token after each node
    accepted: torch.Tensor         # [B, N] the accepted path's nodes, root first
    path_len: torch.Tensor       # [B] its length: path_len, the root counted
    logits: torch.Tensor           # [B, N, V] the target's logits after each node
    draft_logits: torch.Tensor     # [B, L, V] the drafter's, one row per depth


def verify_width(drafter, budget: int, chain: bool) -> int:
    """Tokens per target forward: the tree's budget + 1 nodes, the chain's block, or one token."""
    return (drafter.block_size if chain else budget + 1) if drafter is not None else 1


def fit_caches(model, drafter, batch: int, max_seq_len: int, width: int) -> None:
    """Grow the target's and the drafter's caches where too small, never shrink them (a kept step's
    CUDA graphs hold their addresses). In a batch a finished row still writes one step's width past
    its end."""
    room = max_seq_len + (width if batch > 1 else 0)
    if model.kv_cache is None or model.kv_cache.shape[1] < batch or model.max_seq_len < room:
        model.setup_cache(batch, room)
    c = getattr(drafter, "ctx_cache", None)
    if drafter is not None and (c is None or c.shape[2] < batch
                                or drafter.max_ctx_len < max_seq_len):
        drafter.setup_cache(batch, max_seq_len)


def get_step(model, drafter, batch: int, max_seq_len: int, budget: int, chain: bool,
             sampling: tuple, mode: str = "eager", debug: bool = False,
             steps: runner.Steps | None = None) -> Step:
    """The step for this shape and setting, after fit_caches: the one kept in `steps` (default: the
    model's own, runner.steps_of) with its compiles and CUDA graphs, else a new one, kept there."""
    fit_caches(model, drafter, batch, max_seq_len, verify_width(drafter, budget, chain))
    steps = steps if steps is not None else runner.steps_of(model)
    key = (id(model), id(drafter), batch, budget, chain, sampling, mode, debug)
    return steps.get(key, lambda: Step(model, drafter, batch, budget, chain, sampling, mode, debug),
                     (model.kv_cache, getattr(drafter, "ctx_cache", None)))


@torch.no_grad()
def generate(model: M.Transformer, prompt_ids: list[int], max_new_tokens: int, drafter=None, *,
             on_tokens=None, **options) -> list[int]:
    """Decode up to max_new_tokens after prompt_ids: generate_batch for one prompt, with the same
    options. Returns the new tokens. on_tokens(list[int]) gets each step's committed tokens."""
    stream = (lambda b, tokens: on_tokens(tokens)) if on_tokens else None
    return generate_batch(model, [prompt_ids], max_new_tokens, drafter, on_tokens=stream,
                          **options)[0]


@torch.no_grad()
def generate_batch(model: M.Transformer, prompts: list[list[int]], max_new_tokens: int,
                   drafter=None, *, budget: int | str = 8, chain=False, temperature=0.0, top_k=0,
                   top_p=1.0, stop_ids=(), seed=0, max_seq_len: int | None = None, mode="eager",
                   stats: Stats | None = None, on_tokens=None, on_step=None, debug=False,
                   steps: runner.Steps | None = None) -> list[list[int]]:
    """Decode several prompts at once, each in its own cache row, until each stops (stop token,
    length, cache end). drafter=None or budget=0: autoregressive; chain=True: the DFlash chain;
    budget="auto": autobudget.py picks a tree or one token before each step. on_tokens(b, tokens):
    row b's new tokens, each step; on_step(b, view, tokens): the same after a tree step, with its
    View. mode: runner.MODES (eager: stage times). debug: NaN/inf, TP checks. steps: get_step's."""
    stats = stats if stats is not None else Stats()
    max_seq_len = max_seq_len or model.max_seq_len or max(map(len, prompts)) + max_new_tokens + 80
    check_options(model, prompts, max_seq_len, budget, chain, temperature, mode)
    auto, budget = budget == "auto", AUTO_BUDGET if budget == "auto" else budget
    drafter = drafter if budget > 0 or chain else None
    step = get_step(model, drafter, len(prompts), max_seq_len, budget, chain,
                    (temperature, top_k, top_p), mode, debug, steps)
    rows = Rows(step, prompts, max_new_tokens, max_seq_len, stop_ids, on_tokens, on_step, stats)
    clock = _Clock(model.embed_tokens.weight.device, stats)
    torch.manual_seed(seed)     # every sample draws from the default generator (a graph replays it)
    # 0. prefill: each prompt's KV, its first token, its context rows for the drafter
    step.prefill(prompts, debug)
    stats.prefill_s = clock.lap()
    for b, t in enumerate(step.state.root.tolist()):   # the first tokens, before attach steps on
        rows.emit(b, [t])
    auto = A.attach(step, max_seq_len - max(map(len, prompts))) if auto and drafter else None
    if auto:
        clock.lap()                      # untimed: on its first call attach times the steps
    t_decode, hook = clock.t, clock.lap if mode == "eager" else None   # eager: time each stage
    fits = rows.fit(step.width, drafter is not None)   # a tree while it fits, then one token
    while not all(rows.done):
        stats.step_s.append({})          # the step's {stage: seconds}, from the clock's laps
        # 1-5. one step for every row: draft, build tree, verify, accept, commit (or one token)
        new = (step.run(step.tree_step if fits else step.token_step, hook) if auto is None
               else auto.next_step(fits, prompts, rows.outs, hook))   # auto: a tree or one token
        if hook is None:
            clock.lap("verify")          # compiled, captured or static: the whole step's time
        stats.budgets[0 if step.view is None else step.width - 1] += 1   # a tree step left a View
        if debug:
            check_ranks_agree(new)
        rows.take(new, step.view)        # 6. stream them; a row stops on a stop token or length
        fits = rows.fit(step.width, fits)
    clock.lap()
    stats.new_tokens, stats.decode_s = sum(map(len, rows.outs)), clock.t - t_decode
    return rows.outs


class Rows:
    """The loop's bookkeeping on the host, row by row: the new tokens (outs), the committed length
    in the cache (lens), and whether the row has finished (done: a stop token, max_new_tokens, or
    the cache's end); finish masks the row in the step."""

    def __init__(self, step: Step, prompts, max_new_tokens: int, max_seq_len: int, stop_ids,
                 on_tokens, on_step, stats: Stats):
        self.step, self.max_new_tokens, self.max_seq_len = step, max_new_tokens, max_seq_len
        self.outs, self.done = [[] for _ in prompts], [False] * len(prompts)
        self.lens = [len(p) for p in prompts]
        self.stop, self.on_tokens, self.on_step = set(int(t) for t in stop_ids), on_tokens, on_step
        self.stats = stats

    def fit(self, width: int, tree: bool) -> bool:
        """Before each step: a tree step needs `width` free cache slots in every decoding row, else
        every row takes one token a step from then on (False); a row with no free slot finishes."""
        room = [self.max_seq_len - n for n in self.lens]           # free slots per row
        tree = tree and all(d or r >= width for d, r in zip(self.done, room))
        for b, r in enumerate(room):
            if r < 1 and not self.done[b]:
                self.finish(b, f"cache full (--max-seq-len {self.max_seq_len})")
        return tree

    def take(self, new: list[list[int]], view: View | None) -> None:
        """A step's new tokens, row by row: counted, shown (on_step, after a tree step), emitted."""
        for b, tokens in enumerate(new):
            if not self.done[b]:
                self.lens[b] += len(tokens)
                self.stats.accept_lens.append(len(tokens))
                if self.on_step and view is not None and tokens[-1] != verify.NO_TOKEN:
                    self.on_step(b, view, tokens)
                self.emit(b, tokens)

    def emit(self, b: int, tokens: list[int]) -> None:
        """Append row b's tokens, up to a stop token or the length limit (then the row finishes).
        Only the last (a bonus) can be verify.NO_TOKEN: the run ends after the tokens before it."""
        out, n0, no_token = self.outs[b], len(self.outs[b]), tokens[-1] == verify.NO_TOKEN
        for t in tokens[:-1] if no_token else tokens:
            out.append(t)
            if t in self.stop or len(out) >= self.max_new_tokens:
                self.finish(b, "stop token" if t in self.stop else "max_new_tokens")
                break
        if self.on_tokens:
            self.on_tokens(b, out[n0:])
        if no_token and not self.done[b]:
            raise self.no_token(b)

    def finish(self, b: int, why: str) -> None:
        self.done[b], self.stats.stopped = True, why
        self.step.state.active[b] = False     # the step masks row b from now on

    def no_token(self, b: int) -> RuntimeError:
        """The target's logits after row b's last position gave no token (verify.NO_TOKEN): the
        run's end, an error naming the step and the position."""
        steps = len(self.stats.step_s)
        when = f"decoding step {steps}" if steps else "prefill"
        when += f", prompt {b}" * (len(self.done) > 1)
        t = self.step.sampling[0]     # the temperature
        over = f", or past float32 divided by the temperature {t:g}" if t else ""
        return RuntimeError(f"{when}: the target's logits after position {self.lens[b] - 1} give no "
                            f"token (NaN or inf{over}); --debug names the first layer that makes NaN "
                            f"or inf")


def check_options(model, prompts, max_seq_len: int, budget, chain: bool, temperature: float,
                  mode: str) -> None:
    """What generate_batch refuses before it runs anything (a ValueError naming it)."""
    for i, p in enumerate(prompts):
        what = f"prompt {i}: " if len(prompts) > 1 else ""
        check_prompt(p, model.args.vocab_size, max_seq_len, what)
    verify.check_temperature(temperature)
    if budget == "auto" and chain:
        raise ValueError("--budget auto chooses between a tree and one token: not with --chain")
    if mode not in runner.MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(runner.MODES)}")


def check_prompt(prompt_ids: list[int], vocab: int, max_seq_len: int, what: str = "") -> None:
    """A user's prompt: at least one token, ids inside the vocabulary, and room in the cache."""
    if not prompt_ids:
        raise ValueError(f"{what}empty prompt: give at least one token")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"{what}prompt token ids must lie in [0, {vocab}); got "
                         f"{min(prompt_ids)}..{max(prompt_ids)}")
    if len(prompt_ids) >= max_seq_len:
        raise ValueError(f"{what}prompt of {len(prompt_ids)} tokens does not fit the cache "
                         f"(--max-seq-len {max_seq_len})")


def check_ranks_agree(tokens: list) -> None:
    """--debug under TP: every rank must have committed the same tokens this step."""
    seen = [tokens] * M.world_size
    if M.world_size > 1:
        torch.distributed.all_gather_object(seen, tokens)
    if any(s != tokens for s in seen):
        raise RuntimeError(f"ranks disagree on the committed tokens: {seen}")


@dataclass
class Stats:
    """Per-run statistics. accept_lens: tokens committed per verify step (accepted + the bonus)."""
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    accept_lens: list = field(default_factory=list)
    step_s: list = field(default_factory=list)   # per step {stage: s} (eager: each stage)
    budgets: Counter = field(default_factory=Counter)   # steps run at each budget (0: one token)
    stopped: str = ""

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first (which prefill produces) over the decode time."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def stage_s(self) -> dict:
        """Seconds per stage, summed over step_s."""
        stages = ("draft", "tree", "verify", "commit")
        return {k: sum(s.get(k, 0.0) for s in self.step_s) for k in stages}

    @property
    def mean_accept(self) -> float:
        return sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else 0.0

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accept_lens).items()))

    def budget_mix(self) -> str:
        """The share of steps run at each budget, e.g. "0:70% 8:30%" (--budget auto's choices)."""
        n = sum(self.budgets.values())
        return " ".join(f"{b}:{100 * k / n:.0f}%" for b, k in sorted(self.budgets.items()))


class _Clock:
    """Wall-clock laps; on CUDA a lap synchronizes first, so each stage's time is its own."""

    def __init__(self, device: torch.device, stats: Stats):
        self.cuda, self.stats, self.t = device.type == "cuda", stats, time.perf_counter()

    def lap(self, stage: str | None = None) -> float:
        """Seconds since the last lap; given a stage (eager: the step's hook), that stage's time."""
        if self.cuda:
            torch.cuda.synchronize()
        t, self.t = self.t, time.perf_counter()
        if stage:
            self.stats.step_s[-1][stage] = self.t - t
        return self.t - t


if __name__ == "__main__":        # `python generate.py`: the command line (cli.py) over this module
    sys.modules["generate"] = sys.modules[__name__]   # cli's `import generate` is this run, not a 2nd copy
    import cli
    sys.exit(cli.main())
