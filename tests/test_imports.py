"""One job per file, no import cycles: the project's modules import each other in one direction only, imports
inside functions included (an import that only breaks a cycle at run time still ties the two files together).
`python generate.py` is the one entry point that imports a module which imports it back (cli.py): it runs its own
module as `generate`, once.

Run: python -m pytest -q tests/test_imports.py"""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}


def _entry_point(node) -> bool:
    """`if __name__ == "__main__":`: what runs only when the file is the program, not when it is imported."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def imports(module: str) -> set[str]:
    """The project modules `module` imports, at any depth except its entry-point blocks."""
    found, todo = set(), list(ast.parse(open(os.path.join(ROOT, module + ".py")).read()).body)
    while todo:
        node = todo.pop()
        if _entry_point(node):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        todo.extend(ast.iter_child_nodes(node))
    return (found & MODULES) - {module}


def find_cycle(graph: dict) -> list | None:
    """A cycle of the graph as [a, b, ..., a], or None."""
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = "done"
        path.pop()
        return None
    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def test_no_import_cycle():
    graph = {m: imports(m) for m in MODULES}
    assert graph["checkpoint"] >= {"model", "draft"}, graph["checkpoint"]   # the format side reads the models
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_python_generate_py_loads_itself_once():
    """cli.py imports generate; run as `python generate.py`, that import is the running module."""
    code = ("import runpy, sys\n"
            "sys.argv = ['generate.py', '--help']\n"
            "try:\n"
            "    runpy.run_path('generate.py', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(sys.modules['generate'].__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "__main__", proc.stdout[-500:]
