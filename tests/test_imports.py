"""Imports point one way: no import circle among the project's modules (each file can be read, and
copied, after the ones it imports); nothing in harness/ (the machinery) imports a top-level file (the
method), not even the toy world, which imports no project file; and the method imports neither evaluation
nor the study, which stand above it. Imports inside functions and a command's `__main__` block count
too: a circle closed at call time, or by running a file, still ties the files together."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("evaluation", "harness")


def project_imports():
    """{module: set of project modules it imports}, for every .py file outside tests/."""
    files = {}
    for folder in ("", *PACKAGES):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py") and name != "__init__.py":
                files[".".join(filter(None, (folder, name[:-3])))] = os.path.join(ROOT, folder, name)
    edges = {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        named = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                named |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                named |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}  # from harness import lora
        edges[module] = {n for n in named if n in files and n != module}
    return edges


def find_circle(edges):
    """One import circle as [a, b, ..., a], or None."""
    state = {}   # module -> "open" while on the path, "done" after

    def visit(module, path):
        state[module] = "open"
        for other in sorted(edges[module]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state:
                found = visit(other, path + [other])
                if found:
                    return found
        state[module] = "done"
        return None
    for module in sorted(edges):
        found = None if module in state else visit(module, [module])
        if found:
            return found
    return None


def test_no_import_circle():
    edges = project_imports()
    assert {"data", "grade", "harness.checkpoint", "harness.lora"} <= set(edges)
    assert "grade" in edges["data"] and "harness.lora" in edges["harness.checkpoint"]   # the parser sees both kinds
    circle = find_circle(edges)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_find_circle_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_harness_imports_no_top_level_file():
    edges = project_imports()
    top = {m for m in edges if "." not in m}
    assert {"probe", "toy"} <= top and "harness.parallel" in edges
    up = sorted(f"{m} -> {n}" for m in edges if m.startswith("harness.") for n in edges[m] & top)
    assert not up, "harness/ imports the method (pass what it needs in): " + ", ".join(up)


def test_reproduce_stands_above_and_nothing_imports_it():
    """reproduce.py (the paper's table) uses evaluation/, harness/ and the method; none of those uses it."""
    edges = project_imports()
    assert {"evaluation.report", "harness.checkpoint", "evaluate"} <= edges["reproduce"]
    assert [m for m, names in edges.items() if "reproduce" in names] == []


def test_the_toy_world_imports_no_project_file():
    edges = project_imports()
    assert not edges["toy"], "toy.py imports " + ", ".join(sorted(edges["toy"])) + ": the world stands alone"


LEFT = set()   # imports downward still to remove


def test_the_method_imports_neither_evaluation_nor_the_study():
    edges = project_imports()
    above = ("evaluate", "reproduce")   # the protocol and the experiments stand above the method
    method = [m for m in edges if "." not in m and m not in above]
    assert {"data", "train"} <= set(method)
    down = {f"{m} -> {n}" for m in method for n in edges[m] if n.startswith(("evaluation.", "study."))}
    assert not down - LEFT, "the method imports what stands above it: " + ", ".join(sorted(down - LEFT))
    assert not LEFT - down, "no longer imported: drop them from LEFT"
