"""The pre-registered study's machinery (evaluation/study.py, `reproduce.py --study`): the world without
a written signal, toy rows by world name, the mechanism's readouts on hand-made samples, the verdict
rule on hand-made per-seed numbers (one case per outcome), and a tiny end-to-end run."""
import hashlib
import json
import random

import pytest

import toy

QUIET = toy.WORLDS["legible-quiet"]


def test_the_legible_worlds_rows_are_as_they_were():
    """Pinned at 4b29540, before the quiet world shared them: every number measured on the legible
    world (docs/toy-world.md) was measured on these rows."""
    pins = {"test/toy": "9e0346a90e5f4ee4", "test/toy-long": "bcaa527dad38f641", "test/toy-sub": "bc56499a9e264c05",
            "train/toy": "124cda8e60380e7a", "train/toy-long": "66d69562f825171d", "train/toy-sub": "78c21b5aa1638f93"}
    for where, pin in pins.items():
        split, name = where.split("/")
        rows = toy.dataset(split, name, "legible")
        assert hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16] == pin, where
        assert toy.dataset(split, name, "legible-quiet") == rows   # the quiet world reads the same rows
    assert toy.dataset("test", "toy", "legible") != toy.dataset("test", "toy", "sum")


def test_the_quiet_world_writes_the_legible_traces_without_a_flag():
    """Same slips, same counts, never a `?`: the flag's draw is still made (at p 0), so a quiet trace is
    the legible one with its flags removed, and the two warm starts differ in the `?` alone."""
    flagless = lambda world: {k: v for k, v in world.items() if k not in ("p_flag_wrong", "p_flag_right", "data")}  # noqa: E731
    assert flagless(QUIET) == flagless(toy.LEGIBLE) and QUIET["data"] == "legible"
    assert (QUIET["p_flag_wrong"], QUIET["p_flag_right"]) == (0.0, 0.0)
    rng, flags = random.Random(3), 0
    for _ in range(2000):
        terms = [rng.randint(1, 9) for _ in range(rng.randint(4, 8))]
        seed = rng.random()
        loud, _ = toy.legible_trace(terms, random.Random(seed), toy.LEGIBLE)
        quiet, _ = toy.legible_trace(terms, random.Random(seed), QUIET)
        flags += sum("?" in line for line in loud)
        assert quiet == [line.replace("?", "") for line in loud]
    assert flags > 100
    tok, rng = toy.tokenizer(), random.Random(0)
    rows = toy.dataset("train", "toy", "legible-quiet")
    for i in range(300):   # the warm start's sequences, forced ones included
        ids, _ = toy.example(tok, rows[i]["problem"], rng, i % 2 == 0, QUIET)
        assert "?" not in tok.decode(ids)
