"""The README's examples are what their commands print: each one sits between <!-- example NAME --> and
<!-- /example --> and is made here, by running its command on the CPU in float32 (the bundled pair). The test
runs every command again and compares; after a change that moves the output (a retrained pair, a new format),
rewrite them with

    python tests/test_readme.py

Run: python -m pytest -q tests/test_readme.py"""
import os
import re
import shlex
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
CPU_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
CODE_PROMPT = r"$'class Stack:\n    def __init__(self):\n        '"
RUN = f"python generate.py --raw --prompt {CODE_PROMPT}"
SHOW_TREE = f"python generate.py --raw --prompt {CODE_PROMPT} --show-tree --max-new-tokens 16"
FIRST_LINES = 8          # of the headline command's text


def run(command: str) -> str:
    """The command's stdout, as a user on a CPU gets it (float32)."""
    command = command.replace("python ", shlex.quote(sys.executable) + " ", 1)   # the interpreter running the tests
    proc = subprocess.run(["bash", "-c", f"{command} --device cpu --dtype fp32 --quiet"], cwd=ROOT, env=CPU_ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def example_run() -> str:
    """The headline command: the first lines of the text it writes (after the loading line)."""
    text = [line for line in run(RUN).splitlines() if not line.startswith("[")]
    return "```\n$ " + RUN + "\n" + "\n".join(text[:FIRST_LINES]) + "\n...\n```\n"


def example_show_tree() -> str:
    """--show-tree: the first step where the tree beat the chain (the drafter's favourite next token, node 1, was
    wrong, yet the target accepted a drafted token on another branch) and the step that committed the most, with
    what they show in words."""
    steps = [s.strip("\n") for s in run(SHOW_TREE).split("\n\n") if "[0]" in s]
    accepted = [[int(i) for i in re.findall(r"^\* .*?\[(\d+)\]", s, re.M)] for s in steps]   # root first
    beat = next(k for k, path in enumerate(accepted) if len(path) > 1 and path[1] != 1)
    most = max(range(len(steps)), key=lambda k: (len(accepted[k]), -k))
    shown = sorted({beat, most})
    first = re.search(r"\[1\] ('.*?')  q", steps[beat]).group(1)
    block = "```\n$ " + SHOW_TREE + "\n...\n" + "\n...\n".join(steps[k] for k in shown) + "\n...\n```\n"
    steps_named = " and ".join(f"{k + 1}" for k in shown)
    words = (f"In tree {beat + 1} the drafter's favourite next token ({first}, node 1) was wrong, but the tree "
             f"also held node {accepted[beat][1]}, which the target wanted: a chain would have committed one token, "
             f"the tree commits {len(accepted[beat])}. In tree {most + 1} one target forward commits "
             f"{len(accepted[most])} tokens.")
    return (f"The steps shown are trees {steps_named} of the run (CPU, float32):\n\n{block}\n"
            + textwrap.fill(words, 115) + "\n")


EXAMPLES = {"run": example_run, "show-tree": example_show_tree}


def regions(text: str) -> dict:
    """name -> the README's text between <!-- example name --> and <!-- /example -->."""
    return dict(re.findall(r"<!-- example (\S+) -->\n(.*?)<!-- /example -->", text, re.S))


def test_readme_examples_are_what_the_commands_print():
    found = regions(open(README).read())
    assert set(found) == set(EXAMPLES), f"README regions {sorted(found)}, expected {sorted(EXAMPLES)}"
    for name, make in EXAMPLES.items():
        assert found[name] == make(), f"README example {name!r} is not what its command prints: " \
                                      f"run python tests/test_readme.py"


if __name__ == "__main__":
    text = open(README).read()
    for name, make in EXAMPLES.items():
        text, n = re.subn(rf"(<!-- example {re.escape(name)} -->\n).*?(<!-- /example -->)",
                          lambda m, body=make(): m.group(1) + body + m.group(2), text, flags=re.S)
        if n != 1:
            sys.exit(f"README.md: expected one <!-- example {name} --> ... <!-- /example --> region, found {n}")
    open(README, "w").write(text)
    print(f"rewrote {len(EXAMPLES)} examples in {README}")
