"""The reading path stays short: the decode loop (generate_batch) and every function of the five stage
files (model, draft, tree, verify, generate) that it runs from its first DDTree step on, as a learner
reads them (the bundled pair on the CPU in fp32, no Triton), add up to at most MAX_LINES source lines,
docstrings and comments included, and none is longer than MAX_FUNCTION. A line counts once however
many functions run it (a comprehension, a lambda or a function nested in another adds nothing).
runner.py, which wraps the step for --compile and --cuda-graph, is not on the path: eager mode calls
the step itself.

    python tests/test_reading_path.py    # the count, per file and per function

Run: python -m pytest -q tests/test_reading_path.py"""
import inspect
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import checkpoint as C  # noqa: E402
import generate as G  # noqa: E402
import kernels  # noqa: E402

STAGE_FILES = {"model.py", "draft.py", "tree.py", "verify.py", "generate.py"}
# The loop and one step read in under 600 lines, with room for a few comments, not for a new function.
MAX_LINES, MAX_FUNCTION = 600, 60


def loop_functions(budget: int = 8) -> dict:
    """{(file, first line): code object} of the decode loop and every stage-file function it runs from
    its first Step.tree_step on: the functions on the stack there (generate_batch, Step.run, ...), then
    every call until the loop ends."""
    cpu = torch.device("cpu")
    target = C.load_model(G.BUNDLED_TARGET, cpu, torch.float32, progress=False)
    drafter = C.load_drafter(G.BUNDLED_DRAFT, target.args, cpu, torch.float32)
    seen, tree_step = {}, G.Step.tree_step

    def record(frame, event, arg):
        if event == "call" and os.path.basename(frame.f_code.co_filename) in STAGE_FILES:
            seen[frame.f_code.co_filename, frame.f_code.co_firstlineno] = frame.f_code

    def traced_tree_step(self, hook=None):
        if not seen:                      # the first tree step: what called it, then every call
            frame = sys._getframe(1)
            while frame is not None:
                record(frame, "call", None)
                frame = frame.f_back
            sys.setprofile(record)
        return tree_step(self, hook)

    enabled, kernels.ENABLED = kernels.ENABLED, False
    G.Step.tree_step = traced_tree_step
    try:
        G.generate_batch(target, [list(range(3, 40))], 24, drafter=drafter, budget=budget)
    finally:
        sys.setprofile(None)
        G.Step.tree_step, kernels.ENABLED = tree_step, enabled
    assert seen, "the run made no DDTree step"
    return seen


def count(seen: dict) -> tuple[int, dict, list]:
    """(lines, {file: lines}, [(function lines, file, name)]): each source line counted once."""
    lines, per_file, functions = set(), {}, []
    for (path, _), code in sorted(seen.items()):
        source, first = inspect.getsourcelines(code)
        new = {(path, first + i) for i in range(len(source))} - lines
        lines |= new
        name = os.path.basename(path)
        per_file[name] = per_file.get(name, 0) + len(new)
        if new:
            functions.append((len(source), name, code.co_qualname))
    return len(lines), per_file, sorted(functions, reverse=True)


def test_the_loop_and_one_step_read_in_at_most_max_lines():
    total, per_file, functions = count(loop_functions())
    assert STAGE_FILES <= set(per_file), per_file
    assert any(q == "generate_batch" for _, _, q in functions), functions      # the loop itself counts
    assert total <= MAX_LINES, (total, per_file, functions[:10])
    assert functions[0][0] <= MAX_FUNCTION, functions[:3]


if __name__ == "__main__":
    total, per_file, functions = count(loop_functions())
    print(f"{total} lines (at most {MAX_LINES}) in {len(functions)} functions: {per_file}")
    for n, name, qualname in functions:
        print(f"{n:4d}  {name}  {qualname}")
