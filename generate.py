"""Generate text with Kimi K2.6 (or the bundled tiny K2-architecture model): autoregressive, DFlash chain,
or DDTree speculative decoding.

    python generate.py --raw --prompt "def fib(n):"       # the bundled tiny pair continues code (CPU ok)
    python generate.py --raw --prompt "def fib(n):" --budget 16 --show-tree --trace step.html
    python generate.py --raw --prompt "def fib(n):" --budget auto --temperature 1   # one token or a tree, the faster
    torchrun --nproc-per-node 8 generate.py --ckpt <Kimi-K2.6 dir> --draft <DFlash dir> --prompt "Hi" --cuda-graph

Invariant: greedy DDTree output == greedy autoregressive output, token for token (tests/test_generate.py);
at temperature T every committed token is a sample of the target's own distribution.

The step is written once, Step.spec: 1 draft, 2 build tree, 3 verify, 4 accept, 5 commit (Step.ar: one token),
on fixed-shape buffers with no host sync inside. generate_batch's loop calls it (eager), torch.compile of it
(--compile) or its CUDA graph (--cuda-graph); generate() is generate_batch for one prompt.
--budget auto: before each step AutoBudget picks a tree or one token, whichever commits faster.
The command line (flags, loading, chat) is cli.py; `python generate.py` runs it.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

import kernels
import model as M
import tree as T
import verify as V

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED_TARGET = os.path.join(HERE, "checkpoints", "tiny-k2")
BUNDLED_DRAFT = os.path.join(HERE, "checkpoints", "tiny-k2-dflash")
AUTO_BUDGET = 8        # --budget auto: trees of this budget, or one token per step
# torch.compile of the step rounds every intermediate to the model dtype where eager does: without it inductor keeps
# fused intermediates in fp32, a slightly different bf16 target from the eager one the drafter was distilled
# against, and the compiled step accepts fewer draft tokens. fp32 is unaffected.
COMPILE_OPTIONS = {"emulate_precision_casts": True}


def compile_options() -> dict:
    """COMPILE_OPTIONS that this torch's inductor knows (torch.compile rejects unknown ones; without it, a warning)."""
    from torch._inductor import config as inductor_config
    missing = [k for k in COMPILE_OPTIONS if not hasattr(inductor_config, k)]
    if missing:
        warnings.warn(f"torch {torch.__version__}: inductor has no {', '.join(missing)}; compiling without it "
                      f"(in bf16 the compiled step may accept fewer draft tokens than eager)")
    return {k: v for k, v in COMPILE_OPTIONS.items() if k not in missing}


@dataclass
class Stats:
    """Per-run statistics. accept_lens: tokens committed per verify step (accepted drafts + the bonus)."""
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    accept_lens: list = field(default_factory=list)
    stage_s: dict = field(default_factory=lambda: {"draft": 0.0, "tree": 0.0, "verify": 0.0, "commit": 0.0})
    step_s: list = field(default_factory=list)     # per step: {stage: seconds} (eager: each stage; else the step)
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
        self.cuda, self.stats, self.t, self.laps = device.type == "cuda", stats, time.perf_counter(), {}

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


def check_prompt(prompt_ids: list[int], vocab: int, max_seq_len: int, what: str = "") -> None:
    """A user's prompt: at least one token, ids inside the vocabulary, and room in the cache."""
    if not prompt_ids:
        raise ValueError(f"{what}empty prompt: give at least one token")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"{what}prompt token ids must lie in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}")
    if len(prompt_ids) >= max_seq_len:
        raise ValueError(f"{what}prompt of {len(prompt_ids)} tokens does not fit the cache (--max-seq-len {max_seq_len})")


class View(NamedTuple):
    """What a speculative step leaves for a viewer (--show-tree, --trace) to read after it: tensors it made anyway."""
    tree: T.Tree                   # fields [B, N]
    targets: torch.Tensor          # [B, N] the target's token after each node
    accepted: torch.Tensor         # [B, N] the accepted path's nodes, root first
    accept_len: torch.Tensor       # [B] its length
    logits: torch.Tensor           # [B, N, V] the target's logits after each node
    draft_logits: torch.Tensor     # [B, L, V] the drafter's, one row per depth


class Step:
    """One decoding step for a batch of rows, written once: spec (1 draft, 2 build tree, 3 verify, 4 accept,
    5 commit) and its autoregressive twin ar, on fixed-shape buffers updated in place, with no host sync inside.
    Every input a step reads lives in a buffer the step itself rewrites, never a fresh tensor (a captured graph
    keeps reading the tensors it was captured with). Row b uses cache row b. A finished row is masked, not
    removed: it commits nothing, and its step writes land past its last token, where nothing reads them."""
    cache: dict = {}       # one Step (and its graphs) per shape and setting, reused across calls: see get

    @classmethod
    def get(cls, model, drafter, batch, max_seq_len, budget, chain, sampling, mode="eager", debug=False) -> Step:
        """The step for this shape and setting, made once, after the caches (grown only when too small: a captured
        graph holds their addresses; in a batch a finished row still writes one step's width past its end)."""
        room = max_seq_len + (Step.width(drafter, budget, chain) if batch > 1 else 0)
        if model.kv_cache is None or model.kv_cache.shape[1] < batch or model.max_seq_len < room:
            model.setup_cache(batch, room)
        c = getattr(drafter, "ctx_cache", None)
        if drafter is not None and (c is None or c.shape[2] < batch or drafter.max_ctx_len < max_seq_len):
            drafter.setup_cache(batch, max_seq_len)
        key = (id(model), model.kv_cache.data_ptr(), id(drafter), drafter and drafter.ctx_cache.data_ptr(), batch,
               budget, chain, sampling, mode, debug)
        if key not in cls.cache:
            cls.cache[key] = cls(model, drafter, batch, budget, chain, sampling, "compile" in mode, "graph" in mode,
                                 debug and mode in ("eager", "static"))
        return cls.cache[key]

    def __init__(self, model, drafter, batch, budget, chain, sampling, compile=False, graph=False, debug=False):
        if graph and not kernels.ENABLED:
            raise ValueError("--cuda-graph with --no-triton: the reference MoE picks its experts on the host "
                             "(unique().tolist()), which a CUDA graph cannot capture; drop one of the two flags")
        self.model, self.drafter, self.budget, self.chain = model, drafter, budget, chain
        self.sampling = sampling                   # (temperature, top_k, top_p)
        self.debug = debug                         # NaN/inf checks per layer (they read the host: eager only)
        dev, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        self.N = Step.width(drafter, budget, chain)
        self.taps = tuple(drafter.target_layer_ids) if drafter else ()
        bs, z = drafter.block_size if drafter else 1, lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)
        self.bonus = z(batch)                      # [B] last committed token: the next tree's root
        self.start = z(batch)                      # [B] committed cache length: the bonus goes to slot start
        self.ctx_len = z(batch)                    # [B] context rows in the drafter's cache
        self.n_ctx = z(batch)                      # [B] rows of ctx_feats it adds next: the last committed path
        self.ctx_feats = torch.zeros(batch, bs, len(self.taps) * model.args.hidden_size, dtype=dtype,
                                     device=dev)   # [B, bs, taps*D] the target's hidden states on that path
        self.recent = z(batch, bs)                 # [B, bs] the last bs committed tokens (catch_up's window)
        self.active = torch.ones(batch, dtype=torch.bool, device=dev)   # [B] False: finished, commits nothing
        self.out = z(batch, self.N + 1)            # [B, N+1] accept_len, then the committed tokens: one host copy
        self.fns = {True: self.spec, False: self.ar} | ({"catch_up": self.catch_up} if drafter and not chain else {})
        if compile:
            # One specialization per shape (budget, batch, sampling), never a dynamic-shape graph: the shapes are
            # fixed by design, and a symbolic recompile for a second budget fails gather(out=)'s overlap check.
            # Every budget, temperature and the chain is its own entry, hence the larger limit.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self.fns = {k: torch.compile(f, dynamic=False, options=compile_options()) for k, f in self.fns.items()}
        self.graphs = {} if graph else None        # spec or ar -> (CUDA graph, the View its replays rewrite)
        self.view: View | None = None
        self.control: AutoBudget | None = None     # --budget auto's state, kept across calls with this step

    @staticmethod
    def width(drafter, budget: int, chain: bool) -> int:
        """Tokens per target forward: the tree's budget + 1 nodes, the chain's block, or one token."""
        return (drafter.block_size if chain else budget + 1) if drafter is not None else 1

    def spec(self, hook=None) -> View:
        """One DDTree (or chain) step for every row. hook(stage) runs after each stage: eager mode's clock; None
        when compiled or captured (then nothing inside the step waits for the device)."""
        m, d, lap = self.model, self.drafter, hook or (lambda stage: None)
        # 1. draft: one drafter forward, after it caches the context rows of the path committed last step
        #    (ctx_feats[:, :n_ctx]; the padding rows past n_ctx stay invisible)
        draft_logits = d.draft_logits(m, self.bonus, self.ctx_feats, self.ctx_len, n_valid=self.n_ctx)  # [B, L, V]
        self.ctx_len += self.n_ctx
        lap("draft")
        # 2. build tree: the `budget` most probable prefixes under the drafter's marginals (or its top-1 chain)
        tree = (T.chain_tree_batched(draft_logits, self.bonus, d.block_size - 1) if self.chain
                else T.build_tree_batched(draft_logits, self.bonus, self.budget))                 # fields [B, N]
        lap("tree")
        # 3. verify: one target forward over every node (position start + depth, attending to its ancestors)
        ids, positions, mask = V.verify_inputs(tree, self.start)
        logits, hidden = m(ids, start_pos=self.start, positions=positions, tree_mask=mask, hidden_layers=self.taps,
                           debug=self.debug)                                        # [B, N, V], [B, N, taps*D]
        lap("verify")
        # 4. accept: the target's token after every node, then the longest path the target agrees with
        targets = V.sample(logits, *self.sampling)                                                 # [B, N]
        accepted, accept_len, bonus = V.accept(tree, targets)                                      # [B, N], [B], [B]
        n = accept_len * self.active                                      # [B] tokens committed (finished rows: 0)
        # 5. commit: the path's KV to slots start.. (finished rows move nothing); its hidden states become the
        #    next context rows; its tokens, then the bonus, go to `out` for the host
        V.commit_kv(m.kv_cache, self.start, accepted, n)
        k = min(self.N, d.block_size)
        torch.gather(hidden, 1, accepted[:, :k, None].expand(-1, -1, hidden.shape[-1]), out=self.ctx_feats[:, :k])
        self.n_ctx.copy_(n)
        self.out[:, 1:self.N] = tree.tokens.gather(1, accepted[:, 1:])
        self.out.scatter_(1, accept_len[:, None], bonus[:, None])
        self._advance(n, bonus)
        lap("commit")
        return View(tree, targets, accepted, accept_len, logits, draft_logits)

    def ar(self, hook=None) -> None:
        """One autoregressive token per row: no drafter, budget 0, or a tree that no longer fits in the cache."""
        logits = self.model(self.bonus.view(-1, 1), start_pos=self.start, debug=self.debug).logits  # [B, 1, V]
        tok = V.sample(logits[:, -1], *self.sampling)                                              # [B]
        self.out[:, 1] = tok
        self._advance(self.active, tok)            # one token per row still decoding
        if hook:
            hook("verify")

    def catch_up(self, hook=None) -> None:
        """Before a tree that follows one-token steps (they leave the drafter alone): the drafter gets the last n_ctx
        (<= block_size) tokens it missed. One target forward over the last block_size committed tokens (`recent`;
        both set by catch_up_on) at their own positions gives their hidden states, and rewrites their KV with the
        values it holds; the missed tokens' rows go to the front of ctx_feats. Anything missed before those stays
        out of the drafter's context: its rows run on from the older ones."""
        bs = self.drafter.block_size
        p0 = (self.start - bs).clamp(min=0)                     # [B] the window's first position (short rows: 0)
        hidden = self.model(self.recent, start_pos=p0, hidden_layers=self.taps, last_only=True,
                            debug=self.debug).hidden                                              # [B, bs, taps*D]
        self.n_ctx.mul_(self.active)                            # finished rows take nothing
        rows = (self.start - p0 - self.n_ctx)[:, None] + torch.arange(bs, device=p0.device)      # [B, bs]
        torch.gather(hidden, 1, rows.clamp(max=bs - 1)[:, :, None].expand_as(hidden), out=self.ctx_feats)

    def catch_up_on(self, seqs: list[list[int]], missed: int) -> None:
        """catch_up with its inputs: each row's last block_size committed tokens (seqs[b], prompt and output, ends
        with the bonus, not in the cache yet), the last `missed` of which (one per one-token step) the drafter
        takes."""
        bs = self.drafter.block_size
        self.recent.copy_(torch.tensor([(s[max(len(s) - 1 - bs, 0):-1] + [0] * bs)[:bs] for s in seqs]))
        self.n_ctx.fill_(min(missed, bs))
        self.run("catch_up")

    def _advance(self, n, bonus) -> None:
        """Committed this step: n tokens per row (0 for finished rows, which keep their bonus too)."""
        self.out[:, 0] = n
        self.start += n
        torch.where(self.active, bonus, self.bonus, out=self.bonus)       # in place: one kernel, no copy

    def prefill(self, prompts: list[list[int]], debug: bool = False) -> None:
        """Each prompt's KV into its own cache row (no padding), its tapped hidden states into the drafter's context,
        its first token into bonus."""
        for b, p in enumerate(prompts):
            res = self.model(torch.tensor([p], device=self.bonus.device), start_pos=0, hidden_layers=self.taps,
                             last_only=True, cache_row=b, debug=debug)
            if self.drafter is not None:
                self.drafter.append_context(res.hidden, 0, row=b)
            self.bonus[b:b + 1] = V.sample(res.logits[:, -1], *self.sampling)
            self.start[b] = len(p)
        self.ctx_len.copy_(self.start)
        self.n_ctx.zero_()
        self.active.fill_(True)
        if self.control:
            self.control.gap = 0         # the drafter has every prompt token: nothing to catch up on

    def run(self, key, hook=None) -> None:
        """One step (key True: spec, False: ar, or "catch_up"), no host read: the function itself, or the replay of
        its graph (captured on first use)."""
        if self.graphs is None:
            self.view = self.fns[key](hook)
        else:
            if key not in self.graphs:
                fn, views = self.fns[key], []
                graph = capture_graph(lambda: views.append(fn()), warmup=2, reset=self.snapshot())
                self.graphs[key] = (graph, views[-1])      # the capture's outputs: each replay rewrites them
            graph, self.view = self.graphs[key]
            graph.replay()

    def __call__(self, spec: bool, hook=None) -> list[list[int]]:
        """Run one step; returns each row's committed tokens (empty for finished rows)."""
        self.run(spec, hook)
        return [r[1:1 + r[0]] for r in self.out.tolist()]     # the step's one device-to-host copy

    def snapshot(self):
        """A function that puts the step's inputs back as they are now (the capture undoes its warm-up with it)."""
        state = (self.bonus, self.start, self.ctx_len, self.n_ctx, self.ctx_feats, self.recent, self.active)
        saved = [t.clone() for t in state]
        return lambda: [t.copy_(v) for t, v in zip(state, saved)]

    def rehearse(self, key) -> float:
        """Run fns[key] once and undo it (its KV writes land past the committed tokens: catch_up's window is moved
        there); its first run compiles or captures it. Returns its seconds."""
        reset = self.snapshot()
        if key == "catch_up":
            self.start += self.drafter.block_size
        t = time.perf_counter()
        self.run(key)
        if self.start.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter() - t
        reset()
        return t

    def auto(self, room: int) -> AutoBudget:
        """--budget auto's controller, made once, after a prefill and before the decoding clock starts: every step
        function compiled or captured, then a tree step's time over a one-token step's, the median of 7 pairs (load
        on the machine slows both of a pair). Under TP every rank takes rank 0's ratio, so all choose alike. room:
        free cache slots past the longest row; none for a tree and a catch_up: no controller (trees while they fit)."""
        if self.control is None and room > self.N + self.drafter.block_size:
            for key in self.fns:
                self.rehearse(key)
            ratio = [sorted(self.rehearse(True) / self.rehearse(False) for _ in range(7))[3]]   # tree / one token
            if M.world_size > 1:
                torch.distributed.broadcast_object_list(ratio, src=0)
            self.control = AutoBudget(ratio[0], self.drafter.block_size)
        return self.control


def capture_graph(fn, warmup: int = 1, reset=None) -> "torch.cuda.CUDAGraph":
    """fn captured in a CUDA graph, after `warmup` calls on a side stream (as torch's CUDA-graph notes ask), each
    followed by reset(): every warm-up call starts where the capture does, so none writes past its cache slots."""
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


class AutoBudget:
    """--budget auto: tree steps while the running mean of the tokens a tree step commits exceeds `ratio`, a tree
    step's time over a one-token step's (Step.auto times both once): the first depends on the text and the
    temperature, the second on the machine. When trees stop paying (judged after MIN_RUN tree steps), `wait`
    one-token steps follow (plain decoding, the drafter idle), then a probe: Step.catch_up gives the drafter what it
    missed and trees run again. Each step fades the mean's past by KEEP, so the probe counts most. Each time trees
    stop paying the wait doubles (up to MAX_WAIT); it resets once a run of trees has paid for a block of steps after
    its probe. A stretch lasts a block at least (min_wait): each catch_up costs a target forward."""
    KEEP = 0.97           # the running mean's weight on its past, per step (its memory: ~30 steps)
    MIN_RUN = 3           # tree steps in a run before the controller may leave trees
    MAX_WAIT = 256        # one-token steps between two probes, at most

    def __init__(self, ratio: float, block_size: int):
        self.ratio, self.min_wait = ratio, block_size
        self.wait = block_size             # the next stretch of one-token steps
        self.left = 0                      # one-token steps left in this stretch
        self.gap = 0                       # one-token steps since the last tree (or prefill)
        self.run, self.run_tokens = 0, 0.0    # tree steps in this run; tokens they committed after the first
        self.accept, self.weight = 0.0, 0.0   # running mean of tokens per tree step (per decoding row), its weight

    def tree(self) -> bool:
        """The next step: a tree (True) or one token."""
        if self.left > 0 or 0 < self.gap < self.min_wait:
            self.left = max(self.left - 1, 0)
            return False
        return True

    def observe(self, tree: bool, tokens: float) -> None:
        """A step ran and committed `tokens` per decoding row."""
        self.weight *= self.KEEP
        if not tree:
            self.gap += 1
            return
        self.run_tokens += tokens if self.run else 0.0
        self.gap, self.run, self.weight = 0, self.run + 1, self.weight + 1
        self.accept += (tokens - self.accept) / self.weight
        if self.run > self.min_wait and self.run_tokens > self.ratio * (self.run - 1):
            self.wait = self.min_wait      # trees have paid for a block of steps: the text is easy again
        if self.run >= self.MIN_RUN and self.accept <= self.ratio:
            self.left, self.wait = self.wait, min(2 * self.wait, self.MAX_WAIT)
            self.run, self.run_tokens = 0, 0.0


@torch.no_grad()
def generate(model: M.Transformer, prompt_ids: list[int], max_new_tokens: int, drafter=None, budget: int | str = 8,
             chain: bool = False, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_ids=(), seed: int = 0, max_seq_len: int | None = None, on_tokens=None,
             on_step=None, stats: Stats | None = None, mode: str = "eager", debug: bool = False) -> list[int]:
    """Decode up to max_new_tokens after prompt_ids: generate_batch for one prompt. Returns the new tokens.
    on_tokens(list[int]) gets each step's committed tokens (streaming)."""
    stream = (lambda b, tokens: on_tokens(tokens)) if on_tokens else None
    return generate_batch(model, [prompt_ids], max_new_tokens, drafter, budget, chain, temperature, top_k, top_p,
                          stop_ids, seed, max_seq_len, mode, stats, stream, on_step, debug)[0]


@torch.no_grad()
def generate_batch(model: M.Transformer, prompts: list[list[int]], max_new_tokens: int, drafter=None,
                   budget: int | str = 8, chain: bool = False, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, stop_ids=(), seed: int = 0, max_seq_len: int | None = None,
                   mode: str = "eager", stats: Stats | None = None, on_tokens=None, on_step=None,
                   debug: bool = False) -> list[list[int]]:
    """Decode several prompts at once, each in its own cache row, until each stops (stop token, length, cache end).
    drafter=None or budget=0: autoregressive; chain=True: the DFlash chain (the drafter's top-1 at each position);
    budget="auto": before each step AutoBudget picks a tree of AUTO_BUDGET or one token (sampled tokens follow the
    target's distribution but, as the choices follow measured times, do not repeat for a seed).
    on_tokens(b, tokens): row b's committed tokens, each step (streaming). on_step(b, view, tokens): after each
    speculative step, for each row still decoding, the step's View and the tokens row b committed.
    mode: "eager" (the step as it is, timed stage by stage), "static" (the same, timed as a whole), "compile",
    "graph" (a CUDA graph of it), "graph+compile". debug: NaN/inf checks per layer, TP ranks agree."""
    stats = stats if stats is not None else Stats()
    B, dev = len(prompts), model.embed_tokens.weight.device
    max_seq_len = max_seq_len or model.max_seq_len or max(map(len, prompts)) + max_new_tokens + 80
    for i, p in enumerate(prompts):
        check_prompt(p, model.args.vocab_size, max_seq_len, f"prompt {i}: " if B > 1 else "")
    auto = budget == "auto"
    if auto and chain:
        raise ValueError("--budget auto chooses between a tree and one token: not with --chain")
    budget = AUTO_BUDGET if auto else budget
    drafter = drafter if budget > 0 or chain else None
    step = Step.get(model, drafter, B, max_seq_len, budget, chain, (temperature, top_k, top_p), mode, debug)
    stop, clock = set(int(s) for s in stop_ids), _Clock(dev, stats)
    torch.manual_seed(seed)              # every sample draws from the default generator (a CUDA graph replays it)
    # 0. prefill: each prompt's KV, its first token, its context rows for the drafter
    step.prefill(prompts, debug)
    stats.prefill_s = clock.lap()
    control = step.auto(max_seq_len - max(map(len, prompts))) if auto and drafter is not None else None
    if control:
        clock.lap()                      # untimed: on its first call Step.auto times the steps
    t_decode, hook = clock.t, clock.stage if mode == "eager" else None   # per-stage times: syncs between stages
    outs, done, start = [[] for _ in prompts], [False] * B, [len(p) for p in prompts]

    def emit(b: int, tokens: list[int]) -> None:
        """Append row b's committed tokens, up to a stop token or the length limit (then the row finishes)."""
        n0 = len(outs[b])
        for t in tokens:
            outs[b].append(t)
            if t in stop or len(outs[b]) >= max_new_tokens:
                finish(b, "stop token" if t in stop else "max_new_tokens")
                break
        if on_tokens:
            on_tokens(b, outs[b][n0:])

    def finish(b: int, why: str) -> None:
        done[b], stats.stopped = True, why
        step.active[b] = False           # the step masks row b from now on

    for b, t in enumerate(step.bonus.tolist()):
        emit(b, [t])
    fits = drafter is not None
    while not all(done):
        # the next step must fit in the cache: a tree of N nodes, else (from then on) one token, else the row stops
        fits = fits and all(done[b] or start[b] + step.N <= max_seq_len for b in range(B))
        for b in range(B):
            if not done[b] and start[b] + (step.N if fits else 1) > max_seq_len:
                finish(b, f"cache full (--max-seq-len {max_seq_len})")
        if all(done):
            break
        spec = fits and (control is None or control.tree())
        clock.laps = {}
        if spec and control and control.gap:     # after one-token steps the drafter catches up on what it missed
            step.catch_up_on([p + o for p, o in zip(prompts, outs)], control.gap)
        # 1-5. one step for every row: draft, build tree, verify, accept, commit (or one autoregressive token)
        rows = step(spec, hook)
        if hook is None:
            clock.stage("verify")        # compiled, captured or static: the whole step's time
        stats.step_s.append(clock.laps)
        stats.budgets[step.N - 1 if spec else 0] += 1   # a tree's budget (a chain: its drafted tokens)
        if debug:
            check_ranks_agree(rows)
        if control:
            live = [len(new) for b, new in enumerate(rows) if not done[b]]
            control.observe(spec, sum(live) / len(live))
        # 6. stream each row's committed tokens; a row stops on a stop token or the length limit
        for b, new in enumerate(rows):
            if not done[b]:
                start[b] += len(new)
                stats.accept_lens.append(len(new))
                if on_step and spec:
                    on_step(b, step.view, new)
                emit(b, new)
    stats.new_tokens = sum(map(len, outs))
    clock.lap()
    stats.decode_s = clock.t - t_decode
    return outs


def check_ranks_agree(tokens: list) -> None:
    """--debug under TP: every rank must have committed the same tokens this step."""
    seen = [tokens] * M.world_size
    if M.world_size > 1:
        torch.distributed.all_gather_object(seen, tokens)
    if any(s != tokens for s in seen):
        raise RuntimeError(f"ranks disagree on the committed tokens: {seen}")


if __name__ == "__main__":
    import cli
    sys.exit(cli.main())
