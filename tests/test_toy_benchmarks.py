"""The toy benchmarks (issue 23): toy, toy-long (the toy's "AIME": more terms than RL trains on) and
toy-sub (the toy's "OOD": subtraction, which only the warm start teaches); reproduce.py's per-benchmark
and Overall table and the paired difference RLCM - GRPO with its t interval, on fake results with
worked numbers; the calibration term's share of the advantage."""
import json
import math
import os
import random

import pytest
import torch

import config
import data
import evaluate
import grade
import metrics
import reproduce
import rollout
import toy
from evaluation import benchmarks, confidence
from grpo import group_advantages


def test_benchmarks_are_deterministic_disjoint_and_what_they_say():
    assert data.TOY_BENCHMARKS == tuple(toy.BENCHMARKS) == ("toy", "toy-long", "toy-sub")
    first = {name: [r["problem"] for r in toy.dataset("test", name)[:3]] for name in toy.BENCHMARKS}
    assert {name: rows[:2] for name, rows in first.items()} == {
        "toy": ["7+5+3+8+8", "4+2+7+7"], "toy-long": ["8+5+8+8+1+8+1+3", "6+9+9+5+4+1+4"],
        "toy-sub": ["8+5-9+1+5-1", "9+1-6+8-8"]}   # the study's rows (hashes below)
    for name in toy.BENCHMARKS:
        train, test = toy.dataset("train", name), toy.dataset("test", name)
        assert test == toy.dataset("test", name) and len(test) == toy.N_TEST and len(train) == toy.N_TRAIN
        assert not {r["problem"] for r in train} & {r["problem"] for r in test}
        for row in test:
            terms = toy.terms_of(row["problem"])
            assert row["answer"] == str(sum(terms)) and all(1 <= abs(t) <= 9 for t in terms)
            assert all(sum(terms[:i]) >= 0 for i in range(1, len(terms) + 1))   # totals never below 0
        sizes = {len(toy.terms_of(r["problem"])) for r in test}
        assert sizes == ({7, 8} if name == "toy-long" else {4, 5, 6})
        minus = {"-" in r["problem"] for r in test}
        assert minus == ({True} if name == "toy-sub" else {False})   # every toy-sub problem subtracts


def test_the_worlds_rows_are_as_they_were():
    """Pinned at 4b29540, when the world was built beside the earlier `sum` one: every number measured on
    it (docs/toy-world.md, the study) was measured on these rows."""
    import hashlib
    pins = {"test/toy": "9e0346a90e5f4ee4", "test/toy-long": "bcaa527dad38f641", "test/toy-sub": "bc56499a9e264c05",
            "train/toy": "124cda8e60380e7a", "train/toy-long": "66d69562f825171d", "train/toy-sub": "78c21b5aa1638f93"}
    for where, pin in pins.items():
        split, name = where.split("/")
        rows = toy.dataset(split, name)
        assert hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16] == pin, where


def test_the_toy_names_read_the_worlds_rows_and_toy_world_marks_a_model_folder_as_toy(tmp_path, monkeypatch):
    """The toy benchmark names read the world's rows (train.py's --data / --eval-data, evaluate.py's
    benchmarks and toy post-hoc fits); --toy-world given with a --model folder applies the toy world's
    defaults; a run keeps its world on resume and refuses another."""
    from harness.files import UserError
    rows = {split: toy.dataset(split, "toy") for split in ("train", "test")}
    assert data.load_rows("toy", split="test") == rows["test"]
    [(name, got, _, _)] = benchmarks.load_benchmarks(["toy"], limit=3)
    assert (name, got) == ("toy", rows["test"][:3])
    from test_evaluate import fit_rows
    assert fit_rows("toy", monkeypatch, tmp_path, 10 * toy.N_TRAIN) == rows["train"]
    assert fit_rows("toy-pooled", monkeypatch, tmp_path, 3)[:3] == [toy.dataset("train", b)[0] for b in data.TOY_BENCHMARKS]

    cfg = config.resolve_args(["--model", toy.BASE_DIR, "--toy-world", toy.WORLD, "--out", str(tmp_path / "a")])
    assert (cfg["toy_world"], cfg["data"], cfg["max_new_tokens"], cfg["lr"], cfg["lam"]) == \
        (toy.WORLD, "toy", 72, 2e-5, 1.0)
    assert config.resolve_args(["--model", toy.BASE_DIR, "--out", str(tmp_path / "b")])["data"] == "deepscaler"
    assert config.resolve_args(["--out", str(tmp_path / "c")])["toy_world"] is None   # --model toy: the world's
    for world, name in ((toy.WORLD, "toy"), (None, "real")):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps(dict(model=toy.BASE_DIR, toy_world=world, seed=0)))
    assert config.resolve_args(["--resume", str(tmp_path / "toy")])["max_new_tokens"] == 72   # the saved world's
    with pytest.raises(UserError, match="--toy-world cannot change on resume"):
        config.resolve_args(["--resume", str(tmp_path / "real"), "--toy-world", toy.WORLD])


def test_subtraction_traces_and_forced_answers():
    lines, totals = toy.trace(toy.terms_of("9-6+7"), random.Random(0), dict(toy.WARM, p_slip_carry=0.0, p_slip=0.0))
    assert "".join(lines).replace("?", "") == "9-6=3\n3+7=10\n" and totals == [9, 3, 10]
    assert toy.implied_sum("9-6+7", [9, -6, 7], lines, totals, 1) == "9-6+7"      # nothing written: the problem
    assert toy.implied_sum("9-6+7", [9, -6, 7], ["9-6=4\n", "4+7=11\n"], [9, 4, 11], 6) == "4+7"   # a slip carries on
    assert grade.integer_sum("4+7") == 11


def test_the_longest_trace_fits_the_positions_and_the_evaluation_budget():
    tok, rng, longest, response = toy.tokenizer(), random.Random(0), 0, 0
    for _ in range(300):
        for forced in (False, True):
            ids, mask = toy.example(tok, "+".join(["9"] * 8), rng, forced)
            longest = max(longest, len(ids))
            if not forced:
                response = max(response, sum(1 for m in mask if m))
    assert longest <= toy.MODEL["max_position_embeddings"]
    assert response <= benchmarks.TOY["max_new_tokens"]


def test_evaluate_loads_every_toy_benchmark_with_the_toy_settings():
    loaded = benchmarks.load_benchmarks(["toy", "toy-long", "toy-sub"], limit=5)
    assert [(name, source) for name, _, _, source in loaded] == [
        ("toy", "toy:test"), ("toy-long", "toy-long:test"), ("toy-sub", "toy-sub:test")]
    assert loaded[1][1] == toy.dataset("test", "toy-long")[:5] and loaded[2][2] == toy.INSTRUCTION
    assert all(source in confidence.TOY_SOURCES for *_, source in loaded)   # the post-hoc probe fits on toy train
    args = evaluate.parse_args(["--model", "toy", "--benchmarks", "toy-long"])
    s = benchmarks.settings("toy-long", args)
    assert (s["n"], s["max_new_tokens"], s["every"], s["forced_k"]) == (4, 128, 8, 4)
    assert data.load_rows("toy-sub", split="train")[:2] == toy.dataset("train", "toy-sub")[:2]


def test_rl_trains_on_the_toy_training_split_only():
    assert config.TOY["data"] == "toy" and data.load_rows("toy", split="train") == toy.dataset("train")


def test_advantage_parts_split_the_group_advantage():
    # correct (1, 0), R (1.05, -0.97): mean 0.04, std |2.02| / sqrt(2) = 1.4284; A_nat = +-1 / 1.4284,
    # A_cal = +-0.01 / 1.4284. A unanimous group (1, 1), R (1.05, 1.01): A_nat 0, A_cal +-0.7071.
    nat, cal = metrics.advantage_parts([1, 0, 1, 1], [1.05, -0.97, 1.05, 1.01], 2)
    assert nat == pytest.approx(2 / 1.428356, abs=1e-5) and cal == pytest.approx(0.02 / 1.428356 + 2 * 0.707106, abs=1e-4)   # eps 1e-6 in the std
    R = torch.tensor([1.05, -0.97, 1.05, 1.01, -1.02, 0.99])
    correct = torch.tensor([1.0, 0, 1, 1, 0, 1])
    # without a calibration term (GRPO) its share is 0; the parts add up to |A| where they share a sign
    assert metrics.advantage_parts(correct, 2 * correct - 1, 3)[1] == 0
    total = group_advantages(R, 3).abs().sum().item()
    assert total <= sum(metrics.advantage_parts(correct, R, 3)) + 1e-6
    # the filter's unanimous group (R set to 0, --drop-unanimous) adds nothing to either part
    assert metrics.advantage_parts([1, 1], [0.0, 0.0], 2) == (0.0, 0.0)
    # eps is added to the std: a group of std 1e-6 has A_cal = +-0.707e-6 / 2e-6 (not a division by 0)
    assert metrics.advantage_parts([1, 1], [1.0, 1.0 + math.sqrt(2) * 1e-6], 2) == (0.0, pytest.approx(0.7071, abs=1e-4))
    # each group is centred on its own mean: a term of +0.1 on all of group 1 moves no advantage
    nat, cal = metrics.advantage_parts([1, 0, 1, 0], [1.1, -0.9, 1.0, -1.0], 2)
    assert nat == pytest.approx(2 * math.sqrt(2)) and cal == pytest.approx(0, abs=1e-9)
    # a group of one sample has A = 0, as in group_advantages (its std would be nan)
    assert metrics.advantage_parts([1, 0], [1.05, -0.97], 1) == (0.0, 0.0)


def test_default_seeds_give_the_headline_pair_five():
    _, methods, seeds, _ = reproduce.parse_args([])
    assert methods == reproduce.MAIN
    assert seeds == dict(base=[0, 1, 2], grpo=[0, 1, 2, 3, 4], rlcr=[0, 1, 2], c2gspg=[0, 1, 2], rlcm=[0, 1, 2, 3, 4])
    assert reproduce.parse_args(["--seeds", "7"])[2]["rlcm"] == [7]
    cmd = reproduce.eval_cmd("rlcm", 0, "RUN", "EV")
    assert cmd[cmd.index("--benchmarks") + 1] == "toy,toy-long,toy-sub"


def test_t_quantile_and_paired_interval_worked_numbers():
    assert reproduce.t_quantile(4) == pytest.approx(2.776445, abs=1e-5)
    assert reproduce.t_quantile(1) == pytest.approx(12.706205, abs=1e-4)
    # differences 0.5, 0, 1: mean 0.5, sd 0.5, t(0.975, 2) = 4.302653 -> +- 4.302653 * 0.5 / sqrt(3) = 1.242069
    d = reproduce.paired({0: 1.0, 1: 2.0, 2: 3.0, 9: 0.0}, {0: 1.5, 1: 2.0, 2: 4.0})
    assert d["per_seed"] == {0: 0.5, 1: 0.0, 2: 1.0} and d["n"] == 3   # seed 9: GRPO only, not paired
    assert (d["mean"], d["pm"]) == (pytest.approx(0.5), pytest.approx(1.242069, abs=1e-5))
    assert reproduce.paired({0: 1.0}, {0: 2.0}) is None


def _fake(out, method, seed, acc, pce, ece):
    """A run (for a trained method) and its evaluation: the given numbers on every toy benchmark except
    toy-long, which gets acc - 0.2 (so Overall acc is acc - 0.2 / 3)."""
    label, run = "toy", None
    if method != "base":
        run = os.path.join(out, "runs", f"{method}-seed{seed}")
        ckpt = os.path.join(run, "checkpoints", "step_000002")
        os.makedirs(ckpt)
        for path in (os.path.join(run, "config.json"), os.path.join(ckpt, "config.json")):
            with open(path, "w") as f:
                json.dump(dict(steps=2), f)
        from safetensors.torch import save_file
        save_file({"w": torch.zeros(2)}, os.path.join(ckpt, "model.safetensors"))
        label = f"{method}-seed{seed}/step_000002"
    ev = os.path.join(out, "eval", f"{method}-seed{seed}")
    os.makedirs(ev)
    benches = {b: dict(acc=acc - (0.2 if b == "toy-long" else 0), pce=pce, ece=ece, brier=0.2, auroc=0.7, n=40)
               for b in reproduce.BENCHMARKS}
    with open(os.path.join(ev, "results.json"), "w") as f:
        json.dump({label: dict(confidence="probe-posthoc", benchmarks=benches, model_id=reproduce.model_of(run)[1],
                               settings={b: dict(questions=40, n=1) for b in benches})}, f)


def test_reproduce_prints_the_benchmarks_overall_and_differences(tmp_path):
    out, seeds = str(tmp_path), [0, 1, 2, 3, 4]
    grpo_acc, rlcm_acc = [0.60, 0.62, 0.58, 0.61, 0.59], [0.61, 0.62, 0.60, 0.60, 0.62]   # diffs .01 0 .02 -.01 .03
    for s in seeds:
        _fake(out, "grpo", s, grpo_acc[s], 0.10, 0.05)
        _fake(out, "rlcm", s, rlcm_acc[s], 0.08, 0.05 + 0.01 * s)
    md = reproduce.write_outputs(out, ["grpo", "rlcm"], dict(grpo=seeds, rlcm=seeds), [])
    res = json.load(open(os.path.join(out, "results.json")))
    assert res["methods"]["grpo"]["mean"]["Overall"]["acc"] == pytest.approx(0.6 - 0.2 / 3)
    assert res["methods"]["rlcm"]["mean"]["toy-long"]["acc"] == pytest.approx(0.61 - 0.2)
    # Acc differences 0.01, 0, 0.02, -0.01, 0.03: mean 0.01, sd 0.015811, t(0.975, 4) 2.776445 -> +- 0.019632
    acc = res["differences"]["Overall"]["acc"]
    assert acc["mean"] == pytest.approx(0.01) and acc["pm"] == pytest.approx(0.019632, abs=1e-5)
    assert "| Overall | +0.010 [-0.010, +0.030] (n 5) | -0.020 [-0.020, -0.020] (n 5) |" in md
    # ECE: RLCM 0.05 + 0.01 s against 0.05: differences 0 .. 0.04, mean 0.02, sd 0.015811
    assert "+0.020 [+0.000, +0.040] (n 5) |" in md
    assert res["differences"]["Overall"]["acc"]["per_seed"]["4"] == pytest.approx(0.03)
    assert "| RLCM | probe-posthoc | 0.610 +- 0.010 | 0.080 +- 0.000 | 0.070 +- 0.016 | 0.410 +- 0.010 |" in md
    assert "seeds GRPO: 0, 1, 2, 3, 4; RLCM: 0, 1, 2, 3, 4" in md and "Overall: their unweighted mean" in md


@pytest.mark.slow   # three benchmarks x 40 generations with the committed base
def test_the_base_policy_is_above_chance_on_every_benchmark():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = AutoModelForCausalLM.from_pretrained(toy.BASE_DIR).eval(), AutoTokenizer.from_pretrained(toy.BASE_DIR)
    for name in toy.BENCHMARKS:
        rows = toy.dataset("test", name)[:40]
        prompts = [data.chat_prompt(tok, r["problem"], toy.INSTRUCTION) for r in rows]
        out = rollout.generate(model, tok, prompts, max_new_tokens=128, temperature=0.6, seed=0)
        acc = sum(grade.is_correct(t, r["answer"]) for t, r in zip(out.texts, rows)) / len(rows)
        print(f"\n{name}: base accuracy at T=0.6 on 40 problems {acc:.3f}")
        assert acc > 0.2


@pytest.mark.parametrize("given, want", [([], 240), (["--probe-questions", "80"], 80)])
def test_the_pooled_fit_takes_the_released_size_from_each_benchmark(given, want, tmp_path, monkeypatch):
    """--probe-data toy-pooled: 80 questions from each toy benchmark in turn (240), so each is fitted on as
    many as the released fit (`toy`, 80) has; --probe-questions still sets the total."""
    seen = {}
    monkeypatch.setattr(confidence, "posthoc_probe",
                        lambda cache, model, tok, questions, *a, **k: seen.update(rows=questions) or (None, {}))
    for data_, size in (("toy-pooled", want), ("toy", 80)):
        args = evaluate.parse_args(["--model", "toy", "--probe-data", data_, *given])
        seen.clear()
        confidence.get_probe("probe-posthoc", None, None, "base", toy.BASE_DIR, str(tmp_path), args, 0)
        assert len(seen["rows"]) == size
    assert [r["problem"] for r in seen["rows"][:2]] == [r["problem"] for r in toy.dataset("train")[:2]]
