"""Generate text with Kimi K2.6 (or the bundled tiny K2-architecture model): autoregressive, DFlash chain,
or DDTree speculative decoding.

    python generate.py                                    # bundled tiny model + drafter, a code prompt, CPU ok
    python generate.py --prompt "def fib(n):" --budget 16 --show-tree
    torchrun --nproc-per-node 8 generate.py --ckpt <Kimi-K2.6 dir> --draft <DFlash dir> --prompt "Hi"

Invariant: greedy DDTree output == greedy autoregressive output, token for token (tests/test_generate.py);
at temperature T every committed token is a sample of the target's own distribution.

The decode loop reads as numbered steps: 1 draft, 2 build tree, 3 verify, 4 accept, 5 commit, 6 stream.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import kernels
import model as M
import tree as T
import verify as V

HERE = os.path.dirname(os.path.abspath(__file__))
BUNDLED_TARGET = os.path.join(HERE, "checkpoints", "tiny-k2")
BUNDLED_DRAFT = os.path.join(HERE, "checkpoints", "tiny-k2-dflash")
MAX_BUDGET = 1024      # verify width B+1; above 63 the attention takes the reference path (see model.MLA)
# torch.compile of the step rounds every intermediate to the model dtype where eager does: without it inductor keeps
# fused intermediates in fp32, a different bf16 target from the eager one the drafter was distilled against (H200,
# bundled pair, code prompts, budget 8: graph+compile accepted 3.31 tokens a step, 4.65 with it, graph 4.67). fp32
# is unaffected.
COMPILE_OPTIONS = {"emulate_precision_casts": True}

DEFAULT_PROMPT = "def parse_args(argv=None):\n    \"\"\"Parse command line arguments.\"\"\"\n    parser = "


def compile_options() -> dict:
    """COMPILE_OPTIONS that this torch's inductor knows. torch.compile rejects unknown options, and an older torch may
    lack emulate_precision_casts: it then compiles without it, with a warning (bf16 acceptance may drop)."""
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
    stopped: str = ""

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first (which prefill produces) over the decode time."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_accept(self) -> float:
        return sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else 0.0

    def histogram(self) -> dict[int, int]:
        h: dict[int, int] = {}
        for a in self.accept_lens:
            h[a] = h.get(a, 0) + 1
        return dict(sorted(h.items()))


class _Clock:
    """Stage timer; synchronizes CUDA so each stage's time is its own (eager mode is the teaching reference)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


def check_prompt(prompt_ids: list[int], vocab: int, max_seq_len: int, what: str = "") -> None:
    """A user's prompt: at least one token, ids inside the vocabulary, and room in the cache."""
    if not prompt_ids:
        raise ValueError(f"{what}empty prompt: give at least one token")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"{what}prompt token ids must lie in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}")
    if len(prompt_ids) >= max_seq_len:
        raise ValueError(f"{what}prompt of {len(prompt_ids)} tokens does not fit the cache (--max-seq-len {max_seq_len})")


@torch.no_grad()
def generate(model: M.Transformer, prompt_ids: list[int], max_new_tokens: int, drafter=None, budget: int = 8,
             chain: bool = False, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_ids=(), seed: int = 0, max_seq_len: int | None = None, on_tokens=None,
             show_tree=None, stats: Stats | None = None, mode: str = "eager", debug: bool = False) -> list[int]:
    """Decode up to max_new_tokens after prompt_ids. drafter=None or budget=0: autoregressive.
    chain=True: the DFlash chain (the drafter's top-1 token at each of its block_size-1 positions).
    on_tokens(list[int]) is called with each step's committed tokens (streaming). Returns the new tokens.
    mode: "eager" (the reference loop below), "static" (StaticStep: fixed-shape buffers written in place,
    no host sync inside a step), "graph" (StaticStep replayed as a CUDA graph), "compile" (torch.compile),
    "graph+compile" (the compiled step captured as a CUDA graph: fused kernels and no launch overhead).
    debug: check every layer's output for NaN/inf, and under TP that all ranks committed the same tokens."""
    if "graph" in mode and not kernels.ENABLED:
        raise ValueError("--cuda-graph with --no-triton: the reference MoE picks its experts on the host "
                         "(unique().tolist()), which a CUDA graph cannot capture; drop one of the two flags")
    stats = stats if stats is not None else Stats()
    dev = model.embed_tokens.weight.device
    max_seq_len = max_seq_len or model.max_seq_len or len(prompt_ids) + max_new_tokens + 80
    check_prompt(prompt_ids, model.args.vocab_size, max_seq_len)
    if model.kv_cache is None or model.max_seq_len < max_seq_len:
        model.setup_cache(1, max_seq_len)
    speculative = drafter is not None and (budget > 0 or chain)
    taps = tuple(drafter.target_layer_ids) if speculative else ()
    if speculative:
        _ensure_draft_cache(drafter, 1, max_seq_len)
    gen = torch.Generator(device=dev).manual_seed(seed)
    stop = set(int(s) for s in stop_ids)
    pick = lambda logits: V.sample(logits, temperature, top_k, top_p, gen)
    out: list[int] = []

    def emit(tokens: list[int]) -> bool:
        """Append committed tokens; True when generation must stop (stop token or length limit)."""
        n0 = len(out)
        for t in tokens:
            out.append(t)
            if t in stop:
                stats.stopped = "stop token"
                break
            if len(out) >= max_new_tokens:
                stats.stopped = "max_new_tokens"
                break
        if on_tokens:
            on_tokens(out[n0:])
        return bool(stats.stopped)

    # 0. prefill: the prompt's KV and (for the drafter) its tapped hidden states; the first token
    clock = _Clock(dev)
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=dev)                       # [1, P]
    res = model(prompt, start_pos=0, hidden_layers=taps, last_only=True, debug=debug)
    logits, ctx_feats = res if taps else (res, None)
    bonus = pick(logits[:, -1])                                                             # [1]
    start, ctx_len = len(prompt_ids), 0      # start: tokens whose KV is cached; bonus sits at `start`
    stats.prefill_s = clock.lap()
    t_decode = clock.t
    done = emit([int(bonus)])
    n_nodes = budget + 1 if not chain else (drafter.block_size if speculative else 1)
    if mode != "eager":
        runner = StaticStep.get(model, drafter if speculative else None, budget, chain, temperature, top_k, top_p,
                                graph="graph" in mode, compile="compile" in mode)
        if speculative:
            drafter.append_context(ctx_feats, 0)   # the prompt's features; steps then add only new rows
        runner.load(bonus, start, ctx_len=len(prompt_ids))
        torch.manual_seed(seed)                    # static steps sample with the default generator

    while not done and mode != "eager":
        if start + runner.N > max_seq_len:         # the next step would write past the cache
            stats.stopped = f"cache full (--max-seq-len {max_seq_len})"
            break
        new = runner()[0]                          # one host read per step: the committed tokens
        start += len(new)
        stats.accept_lens.append(len(new))
        stats.stage_s["verify"] += clock.lap()
        done = emit(new)

    while not done:
        if speculative and start + n_nodes <= max_seq_len:
            # 1. draft: one drafter forward proposes block_size-1 per-position distributions
            draft_logits = drafter.draft_logits(model, bonus, ctx_feats, ctx_len)           # [1, L, V]
            ctx_len += ctx_feats.shape[1]
            stats.stage_s["draft"] += clock.lap()
            # 2. build tree: the `budget` most probable prefixes (or the top-1 chain)
            tr = (T.chain_tree_batched(draft_logits, bonus, drafter.block_size - 1) if chain
                  else T.build_tree_batched(draft_logits, bonus, budget))
            stats.stage_s["tree"] += clock.lap()
            # 3. verify: one target forward over the whole tree (positions start + depth, ancestor mask)
            ids, positions, mask = V.verify_inputs(tr, start)
            logits, hidden = model(ids, start_pos=start, positions=positions, tree_mask=mask, hidden_layers=taps,
                                   debug=debug)
            stats.stage_s["verify"] += clock.lap()
            # 4. accept: the target's token at every node, then the longest matching path
            accepted, accept_len, bonus = V.accept(tr, pick(logits))
            n = int(accept_len)        # eager reads the path on the host; StaticStep makes one copy per step
            path = accepted[0, :n]
            # 5. commit: the path's KV to contiguous slots; its hidden states become drafter context
            if not V.path_is_contiguous(path.tolist(), n):
                V.commit_kv(model.kv_cache, start, accepted, accept_len)
            ctx_feats = hidden[:, path]                                                      # [1, n, taps*D]
            new = tr.tokens[0, path[1:]].tolist() + [int(bonus)]
            start += n
            stats.stage_s["commit"] += clock.lap()
            stats.accept_lens.append(n)
            if show_tree:
                show_tree(tr[0], path.tolist())
        elif start + 1 <= max_seq_len:
            # autoregressive step (also the fallback when a tree no longer fits in the cache)
            logits = model(bonus.view(1, 1), start_pos=start, debug=debug)
            bonus = pick(logits[:, -1])
            new = [int(bonus)]
            start += 1
            stats.stage_s["verify"] += clock.lap()
            stats.accept_lens.append(1)
        else:
            stats.stopped = f"cache full (--max-seq-len {max_seq_len})"
            break
        # 6. stream the committed tokens; stop on a stop token or the length limit
        if debug:
            check_ranks_agree(new)
        done = emit(new)
    stats.new_tokens = len(out)
    clock.lap()
    stats.decode_s = clock.t - t_decode
    return out


def _ensure_draft_cache(drafter, batch: int, max_seq_len: int) -> None:
    """The drafter cache holds up to max_seq_len context rows (setup_cache adds the block's slots); reallocated
    only when too small, so captured graphs keep pointing at live buffers."""
    c = getattr(drafter, "ctx_cache", None)
    if c is None or c.shape[2] < batch or drafter.max_ctx_len < max_seq_len:
        drafter.setup_cache(batch, max_seq_len)


def check_ranks_agree(tokens: list[int]) -> None:
    """--debug under TP: every rank must have committed the same tokens this step."""
    if M.world_size == 1:
        return
    import torch.distributed as dist
    seen = [None] * M.world_size
    dist.all_gather_object(seen, tokens)
    if any(s != seen[0] for s in seen):
        raise RuntimeError(f"ranks disagree on the committed tokens: {seen}")


class StaticStep:
    """One decoding step for a batch of sequences (draft, build tree, verify, accept, commit; or one
    autoregressive token) on static buffers updated in place: fixed shapes, no host synchronisation inside,
    so the same step can be replayed as a CUDA graph. Every input of the step (bonus tokens, cache lengths,
    drafter context rows, which rows are still active) lives in a buffer the step itself rewrites; nothing
    is passed in as a fresh tensor (the classic graph bug: a captured graph keeps reading the tensor it was
    captured with). Row b uses cache row b. A finished row is masked, not removed (fixed shapes): its
    lengths stop advancing, so its committed slots [0, start) are never read or written again; its step
    writes land past them and are discarded."""

    _cache: dict = {}

    @classmethod
    def get(cls, model, drafter, budget, chain, temperature, top_k, top_p, graph=False, compile=False, batch=1):
        """One runner (and one captured graph) per shape and sampling setting, reused across calls."""
        caches = (model.kv_cache.data_ptr(), drafter.ctx_cache.data_ptr() if drafter else 0)   # captured buffers
        key = (id(model), id(drafter), caches, budget, chain, temperature, top_k, top_p, graph, compile, batch)
        if key not in cls._cache:
            cls._cache[key] = cls(model, drafter, budget, chain, temperature, top_k, top_p, graph, compile, batch)
        return cls._cache[key]

    @classmethod
    def clear(cls) -> None:
        """Drop every runner and its CUDA graph (their memory goes back to the allocator); the next step captures
        afresh. For a process that moves on to another model, or a bench that wants one runner per mode."""
        cls._cache.clear()

    @classmethod
    def runners(cls) -> list:
        """The live runners, oldest first."""
        return list(cls._cache.values())

    def __init__(self, model, drafter, budget, chain, temperature, top_k, top_p, graph, compile, batch=1):
        self.model, self.drafter, self.budget, self.chain = model, drafter, budget, chain
        self.sampling = (temperature, top_k, top_p)
        dev = model.embed_tokens.weight.device
        bs = drafter.block_size if drafter else 1
        self.N = (bs if chain else budget + 1) if drafter else 1     # verify width: tokens per target forward
        self.taps = tuple(drafter.target_layer_ids) if drafter else ()
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)
        B = batch
        self.bonus, self.start, self.ctx_len, self.n_ctx = z(B), z(B), z(B), z(B)
        self.active = torch.ones(B, dtype=torch.bool, device=dev)                     # True: still decoding
        width = len(self.taps) * model.args.hidden_size
        self.ctx_feats = torch.zeros(B, bs, width, dtype=model.embed_tokens.weight.dtype, device=dev)
        self.out = z(B, self.N + 1)                # per row [accept_len, committed tokens...]: one host copy
        fn = self._spec_step if drafter else self._ar_step
        if compile:
            # One specialization per shape (budget, batch, sampling), never a dynamic-shape graph: the step's shapes
            # are fixed by design, and a symbolic recompile for a second budget crashed in torch 2.11 / 2.13
            # (gather(out=) into a slice of ctx_feats fails its overlap check on symbolic sizes). Every budget,
            # temperature and the chain are separate entries of the same code objects, hence the larger limit.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            fn = torch.compile(fn, dynamic=False, options=compile_options())
        self.fn = fn
        self.use_graph, self.graph = graph, None

    def load(self, bonus: torch.Tensor, start, ctx_len) -> None:
        self.bonus.copy_(bonus.view(-1))
        self.start.copy_(torch.as_tensor(start).view(-1))
        self.ctx_len.copy_(torch.as_tensor(ctx_len).view(-1))
        self.n_ctx.zero_()
        self.active.fill_(True)

    def _advance(self, n, bonus) -> None:
        """Committed this step: n tokens per row (0 for finished rows, which keep their bonus too)."""
        self.out[:, 0] = n
        self.start += n
        torch.where(self.active, bonus, self.bonus, out=self.bonus)       # in place: one kernel, no copy

    def _spec_step(self) -> None:
        m, d, temperature, top_k, top_p = self.model, self.drafter, *self.sampling
        # 1. draft (the new context rows are ctx_feats[:, :n_ctx]; the padding rows stay invisible)
        draft_logits = d.draft_logits(m, self.bonus, self.ctx_feats, self.ctx_len, n_valid=self.n_ctx)
        self.ctx_len += self.n_ctx
        # 2. build tree
        tr = (T.chain_tree_batched(draft_logits, self.bonus, d.block_size - 1) if self.chain
              else T.build_tree_batched(draft_logits, self.bonus, self.budget))
        # 3. verify
        ids, positions, mask = V.verify_inputs(tr, self.start)
        logits, hidden = m(ids, start_pos=self.start, positions=positions, tree_mask=mask, hidden_layers=self.taps)
        # 4. accept
        accepted, accept_len, bonus = V.accept(tr, V.sample(logits, temperature, top_k, top_p))
        n = accept_len * self.active                  # [B] tokens committed (finished rows: 0)
        # 5. commit: KV always copied (fixed shapes; finished rows move nothing); the path's hidden states
        #    become the next context rows
        V.commit_kv(m.kv_cache, self.start, accepted, n)
        k = min(self.N, d.block_size)
        torch.gather(hidden, 1, accepted[:, :k, None].expand(-1, -1, hidden.shape[-1]), out=self.ctx_feats[:, :k])
        self.n_ctx.copy_(n)
        # committed tokens: the path's drafted tokens (nodes 1..len-1) at out[:, 1:len], then the bonus
        self.out[:, 1:self.N] = tr.tokens.gather(1, accepted[:, 1:])
        self.out.scatter_(1, accept_len[:, None], bonus[:, None])
        self._advance(n, bonus)

    def _ar_step(self) -> None:
        logits = self.model(self.bonus.view(-1, 1), start_pos=self.start)
        tok = V.sample(logits[:, -1], *self.sampling)
        self.out[:, 1] = tok
        self._advance(self.active, tok)               # one token per row still decoding

    def snapshot(self) -> Callable[[], None]:
        """A function that puts the buffers a step reads and advances back as they are now: the capture undoes its
        warm-up steps with it, and bench.py replays one step many times from it."""
        state = (self.bonus, self.start, self.ctx_len, self.n_ctx, self.ctx_feats, self.active)
        saved = [t.clone() for t in state]

        def restore() -> None:
            for t, v in zip(state, saved):
                t.copy_(v)
        return restore

    def _capture(self) -> None:
        """Warm up on a side stream (kernels compiled, allocator settled), restore the step's inputs, capture.
        The warm-up steps also wrote cache slots, only past the committed prefix: harmless."""
        self.graph = kernels.capture_graph(self.fn, warmup=2, reset=self.snapshot())

    def __call__(self) -> list[list[int]]:
        """Run one step; returns each row's committed tokens (empty for finished rows)."""
        if self.use_graph:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        else:
            self.fn()
        rows = self.out.tolist()                   # the step's one device-to-host copy
        return [r[1:1 + r[0]] for r in rows]


@torch.no_grad()
def generate_batch(model: M.Transformer, prompts: list[list[int]], max_new_tokens: int, drafter=None,
                   budget: int = 8, chain: bool = False, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, stop_ids=(), seed: int = 0, max_seq_len: int | None = None,
                   mode: str = "static", stats: Stats | None = None) -> list[list[int]]:
    """Decode several prompts at once: per-sequence cache lengths, trees (same budget: the verify input is
    [batch, B+1]), acceptance and commit; sequences finish independently (stop token, length, cache end)."""
    stats = stats if stats is not None else Stats()
    B, dev = len(prompts), model.embed_tokens.weight.device
    max_seq_len = max_seq_len or max(map(len, prompts)) + max_new_tokens + 80
    for i, p in enumerate(prompts):
        check_prompt(p, model.args.vocab_size, max_seq_len, f"prompt {i}: ")
    if model.kv_cache is None or model.kv_cache.shape[1] < B or model.max_seq_len < max_seq_len:
        model.setup_cache(B, max_seq_len)
    speculative = drafter is not None and (budget > 0 or chain)
    taps = tuple(drafter.target_layer_ids) if speculative else ()
    if speculative:
        _ensure_draft_cache(drafter, B, max_seq_len)
    torch.manual_seed(seed)
    clock = _Clock(dev)
    # 0. prefill each prompt into its own cache row (prompts differ in length: no padding needed)
    bonus = torch.zeros(B, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        res = model(torch.tensor([p], device=dev), start_pos=0, hidden_layers=taps, last_only=True, cache_row=b)
        logits = res[0] if taps else res
        bonus[b] = V.sample(logits[:, -1], temperature, top_k, top_p)[0]
        if speculative:
            drafter.append_context(res[1], 0, row=b)
    stats.prefill_s = clock.lap()
    t_decode = clock.t
    runner = StaticStep.get(model, drafter if speculative else None, budget, chain, temperature, top_k, top_p,
                            graph="graph" in mode, compile="compile" in mode, batch=B)
    lens = [len(p) for p in prompts]
    runner.load(bonus, lens, lens)
    outs = [[t] for t in bonus.tolist()]
    stop = set(int(s) for s in stop_ids)
    done = [t[0] in stop or max_new_tokens <= 1 for t in outs]
    start = list(lens)
    while not all(done):
        for b in range(B):   # a row whose next step would not fit in the cache stops here
            if not done[b] and start[b] + runner.N > max_seq_len:
                done[b] = True
        runner.active.copy_(torch.tensor([not d for d in done], device=dev))
        if all(done):
            break
        for b, new in enumerate(runner()):
            if done[b]:
                continue
            start[b] += len(new)
            stats.accept_lens.append(len(new))
            for t in new:
                outs[b].append(t)
                if t in stop or len(outs[b]) >= max_new_tokens:
                    done[b] = True
                    break
    stats.new_tokens = sum(map(len, outs))
    clock.lap()
    stats.decode_s = clock.t - t_decode
    return outs


# ----------------------------------------------------------------------------------------------
# Loading and the command line


def load_target(ckpt: str, device: torch.device, dtype: torch.dtype, progress: bool = True) -> M.Transformer:
    """Build the target directly on `device` in `dtype` (checked against the TP size first) and load it."""
    args = M.ModelArgs.from_config(ckpt)
    M.check_tp_divisibility(args, M.world_size)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = M.Transformer(args)
    finally:
        torch.set_default_dtype(old)
    M.load_checkpoint(model, ckpt, progress=progress)
    return model.eval()


def load_draft(path: str, target: M.Transformer, device, dtype):
    import draft as D
    return D.load_drafter(path, target_args=target.args, device=device, dtype=dtype).eval()


def _memory_report(device: torch.device) -> str:
    s = f"peak host RSS {M.peak_rss_bytes() / 2**30:.2f} GiB"
    if device.type == "cuda":
        s += f", device memory {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB"
    return s


def _print_stats(stats: Stats, speculative: bool) -> None:
    M.print0(f"\n[{stats.new_tokens} tokens in {stats.decode_s:.2f} s: {stats.tokens_per_s:.1f} tok/s, "
             f"prefill {stats.prefill_s * 1000:.0f} ms" + (f", stopped: {stats.stopped}" if stats.stopped else "") + "]")
    if speculative:
        st = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in stats.stage_s.items())
        M.print0(f"[mean accept length {stats.mean_accept:.2f} over {len(stats.accept_lens)} steps; "
                 f"histogram {stats.histogram()}; {st}]")


def main(argv=None) -> int:
    """CLI entry: a user mistake (bad path, config, flag, prompt) prints one line and exits 2;
    --debug shows the traceback instead."""
    args = parse_args(argv)
    try:
        rc = _main(args)
    except (FileNotFoundError, ValueError, RuntimeError, KeyError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    M.close_distributed()
    return rc


def _main(args: argparse.Namespace) -> int:
    device = M.init_distributed(device=args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if args.no_triton:
        kernels.ENABLED = False
    from tokenizer import Tokenizer
    tok_dir = args.tokenizer or args.ckpt
    tokenizer = Tokenizer.from_dir(tok_dir)
    target = load_target(args.ckpt, device, dtype, progress=not args.quiet)
    if tokenizer.vocab_size > target.args.vocab_size:
        raise ValueError(f"tokenizer in {tok_dir} has {tokenizer.vocab_size} ids but the model's vocab_size is "
                         f"{target.args.vocab_size}")
    drafter = load_draft(args.draft, target, device, dtype) if args.draft and args.budget > 0 else None
    M.print0(f"[loaded {args.ckpt}" + (f" + drafter {args.draft}" if drafter else "") + f" on {device}, "
             f"{dtype}; {_memory_report(device)}]")
    stop_ids = tokenizer.stop_ids
    modes = [m for m, on in (("graph", args.cuda_graph), ("compile", args.compile)) if on]
    mode = "eager" if args.eager or not modes else "+".join(modes)          # graph, compile or graph+compile
    if "graph" in mode and device.type != "cuda":
        raise ValueError("--cuda-graph needs a CUDA device")
    kw = dict(drafter=drafter, budget=args.budget, chain=args.chain, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, seed=args.seed, max_seq_len=args.max_seq_len, mode=mode,
              debug=args.debug)

    def run(prompt_ids: list[int]) -> list[int]:
        stream = StreamPrinter(tokenizer)
        show = None
        if args.show_tree:
            show = lambda tr, path: M.print0("\n" + T.format_tree(tr, decode=lambda t: repr(tokenizer.decode([t])),
                                                                  accepted=path))
        stats = Stats()
        ids = generate(target, prompt_ids, args.max_new_tokens, stop_ids=stop_ids if not args.raw else (),
                       on_tokens=stream, show_tree=show, stats=stats, **kw)
        stream.flush()
        _print_stats(stats, drafter is not None)
        return ids

    if args.prompts:
        run_batch(args, tokenizer, target, drafter, kw)
    elif args.prompt_ids:
        run([int(t) for t in args.prompt_ids.split(",")])
    elif args.prompt is not None or not sys.stdin.isatty():
        text = args.prompt if args.prompt is not None else sys.stdin.read()
        if args.raw:
            ids = tokenizer.encode(text)
        else:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], thinking=args.thinking)
        M.print0(text if args.raw else "", end="")
        run(ids)
    else:
        interactive(tokenizer, run, args.thinking)
    return 0


def run_batch(args, tokenizer, target, drafter, kw) -> None:
    """--prompts FILE: one prompt per line, decoded together as one batch."""
    with open(args.prompts) as f:
        texts = [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        raise ValueError(f"{args.prompts}: no prompts (one per line)")
    enc = (lambda t: tokenizer.encode(t)) if args.raw else (
        lambda t: tokenizer.apply_chat_template([{"role": "user", "content": t}], thinking=args.thinking))
    kw = {k: v for k, v in kw.items() if k not in ("debug",)}
    if kw["mode"] == "eager":
        kw["mode"] = "static"      # batching runs the fixed-shape step (per-row lengths live on the device)
    stats = Stats()
    outs = generate_batch(target, [enc(t) for t in texts], args.max_new_tokens,
                          stop_ids=tokenizer.stop_ids if not args.raw else (), stats=stats, **kw)
    for t, o in zip(texts, outs):
        M.print0(f"--- {t!r}\n{tokenizer.decode([x for x in o if x not in tokenizer.stop_ids])}")
    M.print0(f"[{len(texts)} prompts, {stats.new_tokens} tokens in {stats.decode_s:.2f} s: "
             f"{stats.new_tokens / max(stats.decode_s, 1e-9):.1f} tok/s in total; mean accept {stats.mean_accept:.2f}]")


class StreamPrinter:
    """Prints committed tokens as they arrive, never a broken UTF-8 character (rank 0 only)."""

    def __init__(self, tokenizer):
        from tokenizer import StreamDecoder
        self.dec = StreamDecoder(tokenizer)

    def __call__(self, ids: list[int]) -> None:
        M.print0(self.dec.push(ids), end="", flush=True)

    def flush(self) -> None:
        M.print0(self.dec.flush(), end="", flush=True)


def interactive(tokenizer, run, thinking: bool) -> None:
    """Multi-turn chat: history kept; /reset clears it, /exit or EOF ends. Under torchrun only rank 0 reads
    the terminal and broadcasts the line to the others."""
    history: list[dict] = []
    while True:
        line = _read_line("> ")
        if line is None or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            history = []
            M.print0("[history cleared]")
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            ids = run(tokenizer.apply_chat_template(history, thinking=thinking))
        except KeyboardInterrupt:
            M.print0("\n[interrupted]")
            history.pop()
            continue
        answer = tokenizer.decode([t for t in ids if t not in tokenizer.stop_ids])
        history.append({"role": "assistant", "content": answer})


def _read_line(prompt: str) -> str | None:
    line = None
    if M.rank == 0:
        try:
            line = input(prompt)
        except EOFError:
            line = None
    if M.world_size > 1:
        import torch.distributed as dist
        box = [line]
        dist.broadcast_object_list(box, src=0)     # every rank decodes the same prompt
        line = box[0]
    return line


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default=BUNDLED_TARGET, help="target checkpoint dir (HF safetensors, K2/K2.6 layout)")
    p.add_argument("--draft", default=None, help="DFlash drafter dir (default: the bundled one with the bundled model)")
    p.add_argument("--tokenizer", default=None, help="dir with tiktoken.model + tokenizer_config.json (default: --ckpt)")
    p.add_argument("--prompt", default=None, help="user message (chat template applied unless --raw)")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text as is")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids (no tokenizer involved)")
    p.add_argument("--prompts", default=None, help="file with one prompt per line: decoded together as a batch")
    p.add_argument("--thinking", action="store_true", help="K2.6 thinking mode (<think>) instead of instant")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--max-seq-len", type=int, default=4096, help="KV cache length (prompt + generated)")
    p.add_argument("--budget", type=int, default=8, help="DDTree node budget (0: autoregressive)")
    p.add_argument("--chain", action="store_true", help="DFlash chain instead of a tree")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show-tree", action="store_true", help="print each step's tree with the accepted path")
    p.add_argument("--device", default=None, help=M.DEVICE_HELP)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    p.add_argument("--no-triton", action="store_true", help="force the PyTorch reference kernels")
    p.add_argument("--cuda-graph", action="store_true", help="replay each step as a captured CUDA graph")
    p.add_argument("--compile", action="store_true", help="torch.compile the fixed-shape step")
    p.add_argument("--eager", action="store_true", help="force the eager reference loop (the default)")
    p.add_argument("--debug", action="store_true", help="NaN/inf checks per layer, TP agreement, full tracebacks")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.ckpt == BUNDLED_TARGET and a.draft is None:
        a.draft = BUNDLED_DRAFT
        if a.prompt is None and a.prompt_ids is None and a.prompts is None:
            a.prompt, a.raw = DEFAULT_PROMPT, True     # the bundled model continues code; it is no chat model
    if a.budget < 0 or a.budget > MAX_BUDGET:
        p.error(f"--budget must be in [0, {MAX_BUDGET}], got {a.budget}")
    if a.max_new_tokens < 1 or a.max_seq_len < 2:
        p.error("--max-new-tokens must be >= 1 and --max-seq-len >= 2")
    if a.temperature < 0:
        p.error(f"--temperature must be >= 0, got {a.temperature}")
    if not 0 < a.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {a.top_p}")
    return a


if __name__ == "__main__":
    sys.exit(main())
