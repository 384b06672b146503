"""The reading path stays short: the functions of the five stage files (model, draft, tree, verify,
generate) that one DDTree step runs, as a learner reads it (the bundled pair on the CPU in fp32,
no Triton), add up to at most 600 source lines, docstrings and comments included, and none is
longer than 60. A line counts once however many functions run it (a comprehension or a lambda
inside a function adds nothing).

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
MAX_LINES, MAX_FUNCTION = 600, 60


def step_functions(budget: int = 8) -> dict:
    """{(file, first line): code object} of every stage-file function the second Step.spec runs."""
    cpu = torch.device("cpu")
    target = C.load_model(G.BUNDLED_TARGET, cpu, torch.float32, progress=False)
    drafter = C.load_drafter(G.BUNDLED_DRAFT, target.args, cpu, torch.float32)
    seen, calls, spec = {}, [0], G.Step.spec

    def record(frame, event, arg):
        if event == "call" and os.path.basename(frame.f_code.co_filename) in STAGE_FILES:
            seen[frame.f_code.co_filename, frame.f_code.co_firstlineno] = frame.f_code

    def traced_spec(self, hook=None):
        calls[0] += 1
        if calls[0] != 2:                 # the first step may still set things up
            return spec(self, hook)
        sys.setprofile(record)
        try:
            return spec(self, hook)
        finally:
            sys.setprofile(None)

    enabled, kernels.ENABLED = kernels.ENABLED, False
    G.Step.spec = traced_spec
    try:
        G.generate(target, list(range(3, 40)), 24, drafter=drafter, budget=budget)
    finally:
        G.Step.spec, kernels.ENABLED = spec, enabled
    assert calls[0] >= 2, "the run made fewer than two DDTree steps"
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


def test_one_step_reads_in_at_most_600_lines():
    total, per_file, functions = count(step_functions())
    assert {"model.py", "draft.py", "tree.py", "verify.py", "generate.py"} <= set(per_file), per_file
    assert total <= MAX_LINES, (total, per_file, functions[:10])
    assert functions[0][0] <= MAX_FUNCTION, functions[:3]


if __name__ == "__main__":
    total, per_file, functions = count(step_functions())
    print(f"{total} lines in {len(functions)} functions: {per_file}")
    for n, name, qualname in functions:
        print(f"{n:4d}  {name}  {qualname}")
