"""The map from the paper to the code (docs/reference.md): every `file.py:function` it names exists here."""
import importlib
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUANTITIES = ("budgets", "Y_b", "probe features", "the probe", "C_b", "margin", "R = r_nat", "advantage",
              "policy loss", "ECE / PCE", "post-hoc probe")


def map_rows():
    """(paper quantity, released-code cell, here cell) for each row of the map's table."""
    text = open(os.path.join(ROOT, "docs", "reference.md"), encoding="utf-8").read()
    section = text.split("## Map: paper -> released code -> here", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    assert [c.strip() for c in rows[0]] == ["paper", "released code", "here"]
    return [tuple(c.strip() for c in r) for r in rows[2:]]


def test_every_quantity_of_the_paper_has_a_row():
    papers = [p for p, _, _ in map_rows()]
    for q in QUANTITIES:
        assert any(q in p for p in papers), f"no row for {q!r} in the map"


def test_every_named_function_exists():
    rows = map_rows()
    named = 0
    for paper, released, here in rows:
        refs = re.findall(r"`([\w/]+)\.py:([\w.]+)`", here)
        assert refs, f"row {paper!r} names no file.py:function"
        assert released, f"row {paper!r} names no released code"
        for module, name in refs:
            assert os.path.isfile(os.path.join(ROOT, module + ".py")), f"{module}.py does not exist"
            obj = importlib.import_module(module.replace("/", "."))
            for part in name.split("."):
                assert hasattr(obj, part), f"{module}.py has no {name} (the map, row {paper!r})"
                obj = getattr(obj, part)
            assert callable(obj), f"{module}.py:{name} is not a function or class"
            named += 1
    assert named >= 25
