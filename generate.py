"""Generate text with Kimi K2.6 (or the bundled tiny K2-architecture model): autoregressive, the
DFlash chain, or DDTree speculative decoding.

    python generate.py --raw --prompt "def fib(n):"      # the bundled tiny pair continues code
    python generate.py --raw --prompt "def fib(n):" --budget 16 --show-tree --trace step.html
    python generate.py --raw --prompt "def fib(n):" --budget auto --temperature 1
    torchrun --nproc-per-node 8 generate.py --ckpt <K2.6 dir> --draft <DFlash dir> --cuda-graph

Invariant: greedy DDTree output == greedy autoregressive output, token for token
(tests/test_generate.py); at temperature T every committed token is a sample of the target's own
distribution.

In run order: State, the step's buffers; Step.spec, the step, written once (1 draft, 2 build tree,
3 verify, 4 accept, 5 commit), and Step.ar, its one-token twin, with no host sync inside;
Step.prefill; Step.run, which runs a step as it is, compiled (--compile) or as its CUDA graph
(--cuda-graph), then reads what it committed; generate_batch, the loop: prefill, then steps, then
stream (generate() is the loop for one prompt). --budget auto picks a tree or one token before each
step, beside the loop: autobudget.py. The command line is cli.py; `python generate.py` runs it.
"""
from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import NamedTuple

if __name__ == "__main__":    # Ctrl-C while torch imports, before cli.main takes over: one line
    signal.signal(signal.SIGINT, lambda *_: (print("\ninterrupted (Ctrl-C)", file=sys.stderr),
                                             os._exit(130)))
import torch

import autobudget as A
import kernels
import model as M
import tree as T
import verify as V

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED_TARGET = os.path.join(HERE, "checkpoints", "tiny-k2")
BUNDLED_DRAFT = os.path.join(HERE, "checkpoints", "tiny-k2-dflash")
AUTO_BUDGET = 8        # --budget auto: trees of this budget, or one token per step


@dataclass
class State:
    """The step's inputs and outputs for a batch of rows (row b uses cache row b): device buffers
    that every step rewrites in place and never replaces, since a captured CUDA graph keeps reading
    the tensors it was captured with. Integers are int64."""
    bonus: torch.Tensor        # [B] the last committed token: the next tree's root
    start: torch.Tensor        # [B] committed cache length: the bonus goes to slot start
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
    """One decoding step for a batch of rows: spec (a tree, or the chain) and ar (one token), on the
    buffers of `state`; __init__, at the end, sets its settings (model, drafter, budget, width,
    taps). A finished row is masked, not removed: it commits nothing, and its writes land past its
    last token, where nothing reads them."""
    cache: dict = {}       # one Step (and its graphs) per shape and setting, reused: see get

    def spec(self, hook=None) -> View:
        """One DDTree (or chain) step for every row. hook(stage) runs after each stage: eager mode's
        clock; None when compiled or captured (nothing inside the step waits for the device)."""
        m, d, s, lap = self.model, self.drafter, self.state, hook or (lambda stage: None)
        # 1. draft: one drafter forward (first caching the context rows of last step's path)
        draft_logits = d.draft_logits(m, s.bonus, s.ctx_feats, s.ctx_len,
                                      n_valid=s.new_ctx_len)                      # [B, L, V]
        s.ctx_len += s.new_ctx_len
        lap("draft")
        # 2. build tree: the `budget` most probable prefixes (or the chain of top-1 tokens)
        tree = (T.chain_tree_batched(draft_logits, s.bonus, d.block_size - 1) if self.chain
                else T.build_tree_batched(draft_logits, s.bonus, self.budget))  # fields [B, N]
        lap("tree")
        # 3. verify: one target forward, node i at position start + depth_i seeing its ancestors
        ids, positions, mask = V.verify_inputs(tree, s.start)
        logits, hidden = m(ids, start_pos=s.start, positions=positions, tree_mask=mask,
                           hidden_layers=self.taps, debug=self.debug)  # [B, N, V], [B, N, taps*D]
        lap("verify")
        # 4. accept: the target's token after every node, then the longest path it agrees with
        targets = V.sample(logits, *self.sampling)                                  # [B, N]
        accepted, accept_len, bonus = V.accept(tree, targets)              # [B, N], [B], [B]
        n = accept_len * s.active                 # [B] tokens committed (finished rows: 0)
        # 5. commit: the path's KV to slots start.. (finished rows: none), its hidden states to
        #    the drafter's next context rows, its tokens after the root and the bonus to `out`
        V.commit_kv(m.kv_cache, s.start, accepted, n)
        k = min(self.width, d.block_size)
        torch.gather(hidden, 1, accepted[:, :k, None].expand(-1, -1, hidden.shape[-1]),
                     out=s.ctx_feats[:, :k])
        s.new_ctx_len.copy_(n)
        self._commit(n, tree.tokens.gather(1, accepted), accept_len, bonus)
        lap("commit")
        return View(tree, targets, accepted, accept_len, logits, draft_logits)

    def ar(self, hook=None) -> None:
        """One autoregressive token per row: no drafter, budget 0, or a tree that no longer fits."""
        s = self.state
        logits = self.model(s.bonus[:, None], start_pos=s.start, debug=self.debug).logits
        tok = V.sample(logits[:, -1], *self.sampling)                                   # [B]
        self._commit(s.active, s.bonus[:, None], self.one, tok)    # the path: the root alone
        if hook:
            hook("verify")

    def _commit(self, n, path, accept_len, bonus) -> None:
        """Row b commits n[b] tokens (0 once finished): path[b, 1:accept_len[b]] (after the root),
        then bonus[b], the next root. `out` gets the count, then them."""
        s = self.state
        s.out[:, 0] = n
        s.out[:, 1:path.shape[1]] = path[:, 1:]
        s.out.scatter_(1, accept_len[:, None], bonus[:, None])
        s.start += n
        torch.where(s.active, bonus, s.bonus, out=s.bonus)       # in place: one kernel, no copy

    def prefill(self, prompts: list[list[int]], debug: bool = False) -> None:
        """Before the first step: each prompt's KV into its own cache row (no padding), its tapped
        hidden states into the drafter's context, its first token into bonus."""
        s = self.state
        for b, p in enumerate(prompts):
            fwd = self.model(torch.tensor([p], device=s.bonus.device), start_pos=0, last_only=True,
                             hidden_layers=self.taps, cache_row=b, debug=debug)
            if self.drafter is not None:
                self.drafter.append_context(fwd.hidden, 0, row=b)
            s.bonus[b:b + 1] = V.sample(fwd.logits[:, -1], *self.sampling)
            s.start[b] = len(p)
        s.ctx_len.copy_(s.start)
        s.new_ctx_len.zero_()
        s.active.fill_(True)

    def run(self, fn, hook=None) -> list[list[int]]:
        """One step, fn = self.spec or self.ar: each row's committed tokens (finished rows: [])."""
        self.launch(fn, hook)
        return [r[1:1 + r[0]] for r in self.state.out.tolist()]   # the step's one host copy

    def launch(self, fn, hook=None) -> None:
        """fn once, with no host read: as it is, its torch.compile (--compile), or the replay of its
        CUDA graph (--cuda-graph; captured on first use). fn: spec, ar, or another function of the
        state (autobudget's catch_up)."""
        if self.compiled is not None and fn not in self.compiled:
            self.compiled[fn] = torch.compile(fn, dynamic=False, options=compile_options())
        run = fn if self.compiled is None else self.compiled[fn]
        if self.graphs is None:
            self.view = run(hook)
            return
        if fn not in self.graphs:
            views = []
            graph = capture_graph(lambda: views.append(run()), warmup=2,
                                  reset=self.state.snapshot())
            self.graphs[fn] = (graph, views[-1])   # the capture's outputs: replays rewrite them
        graph, self.view = self.graphs[fn]
        graph.replay()

    @classmethod
    def get(cls, model, drafter, batch, max_seq_len, budget, chain, sampling, mode="eager",
            debug=False) -> Step:
        """The step for this shape and setting, made once and kept with its graphs for later calls,
        after the caches (grown only when too small; in a batch a finished row still writes one
        step's width past its end). A step made on other caches is made again: a captured graph
        holds their addresses."""
        room = max_seq_len + (verify_width(drafter, budget, chain) if batch > 1 else 0)
        if model.kv_cache is None or model.kv_cache.shape[1] < batch or model.max_seq_len < room:
            model.setup_cache(batch, room)
        c = getattr(drafter, "ctx_cache", None)
        if drafter is not None and (c is None or c.shape[2] < batch
                                    or drafter.max_ctx_len < max_seq_len):
            drafter.setup_cache(batch, max_seq_len)
        key = (id(model), id(drafter), batch, budget, chain, sampling, mode, debug)
        step = cls.cache.get(key)
        if step is None or step.caches != Step.caches_of(model, drafter):
            step = cls.cache[key] = cls(model, drafter, batch, budget, chain, sampling, mode, debug)
        return step

    @staticmethod
    def caches_of(model, drafter) -> tuple:
        """Where the target's and the drafter's caches live, and their shapes."""
        caches = (model.kv_cache, getattr(drafter, "ctx_cache", None))
        return tuple((c.data_ptr(), tuple(c.shape)) for c in caches if c is not None)

    def __init__(self, model, drafter, batch, budget, chain, sampling, mode="eager", debug=False):
        if "graph" in mode and not kernels.ENABLED:
            raise ValueError("--cuda-graph with --no-triton: the reference MoE picks its experts "
                             "on the host (unique().tolist()), which a CUDA graph cannot capture; "
                             "drop one of the two flags")
        self.model, self.drafter, self.budget, self.chain = model, drafter, budget, chain
        self.sampling = sampling                       # (temperature, top_k, top_p)
        self.debug = debug and mode in ("eager", "static")   # NaN/inf checks: they read the host
        self.width = verify_width(drafter, budget, chain)    # tokens per target forward
        self.taps = tuple(drafter.target_layer_ids) if drafter else ()  # layers the drafter reads
        dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        self.state = State.zeros(batch, self.width, drafter.block_size if drafter else 1,
                                 len(self.taps) * model.args.hidden_size, dtype, dev)
        self.one = torch.ones(batch, dtype=torch.long, device=dev)  # [B] ar's accept_len
        self.caches = Step.caches_of(model, drafter)
        self.compiled = {} if "compile" in mode else None     # step function -> its compile
        if self.compiled is not None:
            # One specialization per shape (budget, batch, sampling), never a dynamic-shape graph:
            # the shapes are fixed by design, and a symbolic recompile for a second budget fails
            # gather(out=)'s overlap check. Each budget, temperature and the chain is an entry.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.graphs = {} if "graph" in mode else None   # step function -> (graph, its View)
        self.view: View | None = None              # what the last spec step left for a viewer
        self.auto: A.AutoStep | None = None        # --budget auto's machinery (autobudget.py)


class View(NamedTuple):
    """What a speculative step leaves for a viewer (--show-tree, --trace) to read after it."""
    tree: T.Tree                   # fields [B, N]
    targets: torch.Tensor          # [B, N] the target's token after each node
    accepted: torch.Tensor         # [B, N] the accepted path's nodes, root first
    accept_len: torch.Tensor       # [B] its length
    logits: torch.Tensor           # [B, N, V] the target's logits after each node
    draft_logits: torch.Tensor     # [B, L, V] the drafter's, one row per depth


def verify_width(drafter, budget: int, chain: bool) -> int:
    """Tokens per target forward: the tree's budget + 1 nodes, the chain's block, or one token."""
    return (drafter.block_size if chain else budget + 1) if drafter is not None else 1


# torch.compile of the step rounds every intermediate to the model dtype where eager does: without
# it inductor keeps fused intermediates in fp32, a slightly different bf16 target from the eager one
# the drafter was distilled against, and the compiled step accepts fewer draft tokens. fp32 is
# unaffected.
COMPILE_OPTIONS = {"emulate_precision_casts": True}


def compile_options() -> dict:
    """COMPILE_OPTIONS that this torch's inductor knows (torch.compile rejects unknown ones; without
    one, a warning)."""
    from torch._inductor import config as inductor_config
    missing = [k for k in COMPILE_OPTIONS if not hasattr(inductor_config, k)]
    if missing:
        warnings.warn(f"torch {torch.__version__}: inductor has no {', '.join(missing)}; compiling "
                      f"without it (in bf16 the compiled step may accept fewer draft tokens)")
    return {k: v for k, v in COMPILE_OPTIONS.items() if k not in missing}


def capture_graph(fn, warmup: int = 1, reset=None) -> "torch.cuda.CUDAGraph":
    """fn captured in a CUDA graph, after `warmup` calls on a side stream (as torch's CUDA-graph
    notes ask), each followed by reset(): every warm-up call starts where the capture does, so none
    writes past its cache slots."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
            if reset is not None:
                reset()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@torch.no_grad()
def generate(model: M.Transformer, prompt_ids: list[int], max_new_tokens: int, drafter=None,
             budget: int | str = 8, chain: bool = False, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, stop_ids=(), seed: int = 0, max_seq_len: int | None = None,
             on_tokens=None, on_step=None, stats: Stats | None = None, mode: str = "eager",
             debug: bool = False) -> list[int]:
    """Decode up to max_new_tokens after prompt_ids: generate_batch for one prompt. Returns the new
    tokens. on_tokens(list[int]) gets each step's committed tokens (streaming)."""
    stream = (lambda b, tokens: on_tokens(tokens)) if on_tokens else None
    return generate_batch(model, [prompt_ids], max_new_tokens, drafter, budget, chain, temperature,
                          top_k, top_p, stop_ids, seed, max_seq_len, mode, stats, stream, on_step,
                          debug)[0]


@torch.no_grad()
def generate_batch(model: M.Transformer, prompts: list[list[int]], max_new_tokens: int,
                   drafter=None, budget: int | str = 8, chain: bool = False,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, stop_ids=(),
                   seed: int = 0, max_seq_len: int | None = None, mode: str = "eager",
                   stats: Stats | None = None, on_tokens=None, on_step=None,
                   debug: bool = False) -> list[list[int]]:
    """Decode several prompts at once, each in its own cache row, until each stops (stop token,
    length, cache end). drafter=None or budget=0: autoregressive; chain=True: the DFlash chain (the
    drafter's top-1 at each position); budget="auto": before each step autobudget.py picks a tree of
    AUTO_BUDGET or one token (sampled tokens follow the target's distribution but, as the choices
    follow measured times, do not repeat for a seed).
    on_tokens(b, tokens): row b's committed tokens, each step (streaming). on_step(b, view, tokens):
    after each speculative step, for each row still decoding, the step's View and row b's tokens.
    mode: "eager" (the step as it is, timed stage by stage), "static" (the same, timed as a whole),
    "compile", "graph" (a CUDA graph of it), "graph+compile". debug: NaN/inf checks per layer, TP
    ranks agree."""
    stats = stats if stats is not None else Stats()
    B, dev = len(prompts), model.embed_tokens.weight.device
    max_seq_len = max_seq_len or model.max_seq_len or max(map(len, prompts)) + max_new_tokens + 80
    for i, p in enumerate(prompts):
        check_prompt(p, model.args.vocab_size, max_seq_len, f"prompt {i}: " if B > 1 else "")
    V.check_temperature(temperature)
    auto = budget == "auto"
    if auto and chain:
        raise ValueError("--budget auto chooses between a tree and one token: not with --chain")
    budget = AUTO_BUDGET if auto else budget
    drafter = drafter if budget > 0 or chain else None
    step = Step.get(model, drafter, B, max_seq_len, budget, chain, (temperature, top_k, top_p),
                    mode, debug)
    stop, clock = set(int(t) for t in stop_ids), _Clock(dev, stats)
    torch.manual_seed(seed)     # every sample draws from the default generator (a graph replays it)
    # 0. prefill: each prompt's KV, its first token, its context rows for the drafter
    step.prefill(prompts, debug)
    stats.prefill_s = clock.lap()
    outs, done, start = [[] for _ in prompts], [False] * B, [len(p) for p in prompts]
    steps = 0

    def emit(b: int, tokens: list[int]) -> None:
        """Append row b's tokens, up to a stop token or the length limit (then the row finishes).
        A V.NO_TOKEN ends the run after the tokens before it (the target has no next token)."""
        n0 = len(outs[b])
        for t in tokens:
            if t == V.NO_TOKEN:
                break
            outs[b].append(t)
            if t in stop or len(outs[b]) >= max_new_tokens:
                finish(b, "stop token" if t in stop else "max_new_tokens")
                break
        if on_tokens:
            on_tokens(b, outs[b][n0:])
        if tokens[-1] == V.NO_TOKEN and not done[b]:
            when = (f"decoding step {steps}" if steps else "prefill") + (f", prompt {b}" * (B > 1))
            raise no_token_error(when, start[b] - 1, temperature)

    def finish(b: int, why: str) -> None:
        done[b], stats.stopped = True, why
        step.state.active[b] = False     # the step masks row b from now on

    for b, t in enumerate(step.state.bonus.tolist()):   # the first tokens, before attach steps on
        emit(b, [t])
    room = max_seq_len - max(map(len, prompts))
    auto = A.attach(step, room) if auto and drafter is not None else None
    if auto:
        clock.lap()                      # untimed: on its first call attach times the steps
    t_decode = clock.t
    hook = clock.stage if mode == "eager" else None   # per-stage times: syncs between stages
    fits = drafter is not None
    while not all(done):
        # the next step must fit in the cache: a tree, else (from then on) one token, else the
        # row stops
        fits = fits and all(done[b] or start[b] + step.width <= max_seq_len for b in range(B))
        for b in range(B):
            if not done[b] and start[b] + (step.width if fits else 1) > max_seq_len:
                finish(b, f"cache full (--max-seq-len {max_seq_len})")
        if all(done):
            break
        clock.laps = {}
        # 1-5. one step for every row: draft, build tree, verify, accept, commit (or one token)
        if auto is None:
            tree_step, rows = fits, step.run(step.spec if fits else step.ar, hook)
        else:                            # --budget auto picks a tree or one token, and runs it
            tree_step, rows = auto.next_step(fits, prompts, outs, hook)
        steps += 1
        if hook is None:
            clock.stage("verify")        # compiled, captured or static: the whole step's time
        stats.step_s.append(clock.laps)
        stats.budgets[step.width - 1 if tree_step else 0] += 1   # a chain: its drafted tokens
        if debug:
            check_ranks_agree(rows)
        # 6. stream each row's committed tokens; a row stops on a stop token or the length limit
        for b, new in enumerate(rows):
            if not done[b]:
                start[b] += len(new)
                stats.accept_lens.append(len(new))
                if on_step and tree_step and new[-1] != V.NO_TOKEN:
                    on_step(b, step.view, new)
                emit(b, new)
    stats.new_tokens = sum(map(len, outs))
    clock.lap()
    stats.decode_s = clock.t - t_decode
    return outs


def no_token_error(when: str, pos: int, temperature: float) -> RuntimeError:
    """The target's logits after position `pos` gave no token (verify.NO_TOKEN): the run's end."""
    over = f", or past float32 divided by the temperature {temperature:g}" if temperature else ""
    return RuntimeError(f"{when}: the target's logits after position {pos} give no token (NaN or "
                        f"inf{over}); --debug names the first layer that makes NaN or inf")


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
    stage_s: dict = field(default_factory=lambda: {"draft": 0.0, "tree": 0.0, "verify": 0.0,
                                                   "commit": 0.0})
    step_s: list = field(default_factory=list)   # per step {stage: s} (eager: each stage)
    budgets: Counter = field(default_factory=Counter)   # steps run at each budget (0: one token)
    stopped: str = ""

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first (which prefill produces) over the decode time."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

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
        self.cuda, self.stats, self.laps = device.type == "cuda", stats, {}
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt

    def stage(self, name: str) -> None:
        """The step's hook in eager mode: the time since the last lap was stage `name`'s."""
        self.laps[name] = dt = self.lap()
        self.stats.stage_s[name] += dt


if __name__ == "__main__":
    import cli
    sys.exit(cli.main())
