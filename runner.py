"""runner.py: how generate.py's step runs when it does not run as it is: compiled (torch.compile,
--compile), replayed as a CUDA graph (--cuda-graph), or both; and the steps a caller keeps for its
next calls, so a graph is captured once.

The step is written once, eager, in generate.py (Step.tree_step, Step.token_step). This file only
wraps that same function, as gpt-fast does: what torch.compile compiles and what a CUDA graph
captures is the eager step, so the graph computes what eager computes (tests/test_gpu.py holds
graph == eager). Nothing here reads a tensor's values.

    python generate.py --raw --prompt "def fib(n):" --cuda-graph    # on a GPU
    python -m pytest -q tests/test_generate.py tests/test_gpu.py
"""
from __future__ import annotations

import warnings

import torch

import kernels

MODES = ("eager", "static", "compile", "graph", "graph+compile")   # generate_batch's mode=


class Runner:
    """A step's functions, each compiled and / or captured on first use and kept: mode "compile",
    "graph" or "graph+compile". Call it with a step function and a function that snapshots the
    step's buffers (a capture's warm-up calls are undone with it)."""

    def __init__(self, mode: str):
        if "graph" in mode and not kernels.ENABLED:
            raise ValueError("--cuda-graph with --no-triton: the reference MoE picks its experts "
                             "on the host (unique().tolist()), which a CUDA graph cannot capture; "
                             "drop one of the two flags")
        self.compiled = {} if "compile" in mode else None     # step function -> its compile
        if self.compiled is not None:
            # One specialization per shape (budget, batch, sampling), never a dynamic-shape graph:
            # the shapes are fixed by design, and a symbolic recompile for a second budget fails
            # gather(out=)'s overlap check. Each budget, temperature and the chain is an entry.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.graphs = {} if "graph" in mode else None   # step function -> (graph, what it returns)

    def __call__(self, fn, snapshot):
        """fn() once, with no host read: its compile, or the replay of its CUDA graph (captured
        here on first use, after warm-up calls that snapshot() undoes). Returns what fn returned
        (a graph: what its capture returned, in tensors every replay rewrites)."""
        if self.compiled is not None and fn not in self.compiled:
            self.compiled[fn] = torch.compile(fn, dynamic=False, options=compile_options())
        run = fn if self.compiled is None else self.compiled[fn]
        if self.graphs is None:
            return run()
        if fn not in self.graphs:
            out = []
            graph = capture_graph(lambda: out.append(run()), warmup=2, reset=snapshot())
            self.graphs[fn] = (graph, out[-1])
        graph, out = self.graphs[fn]
        graph.replay()
        return out


class Steps:
    """The steps a caller keeps for its later calls: one per key (shape and setting), each with
    its Runner's compiles and graphs. Whoever makes a Steps owns it, and dropping it frees them;
    generate_batch uses the model's own (steps_of) unless it is given one."""

    def __init__(self):
        self.kept = {}                  # key -> (step, the caches it was made on)

    def get(self, key, make, caches: tuple):
        """The step kept under key, else make()'s. A step made on other caches is made again: a
        captured graph holds their addresses. caches: the tensors the step reads and writes."""
        where = tuple((c.data_ptr(), tuple(c.shape)) for c in caches if c is not None)
        kept = self.kept.get(key)
        if kept is None or kept[1] != where:
            kept = self.kept[key] = (make(), where)
        return kept[0]

    def values(self) -> list:
        return [step for step, _ in self.kept.values()]


def steps_of(model) -> Steps:
    """The model's own Steps, made on first use: it lives and dies with the model."""
    if getattr(model, "decode_steps", None) is None:
        model.decode_steps = Steps()
    return model.decode_steps


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
