import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import data
import evaluate
import metrics
import probe as probe_lib
import rollout
import toy
import train
from evaluation import benchmarks, confidence, report
from harness import files
from harness.files import UserError
from runs import ENV, EVAL_SMALL, PROBE_SMALL, jsonl, refusal, sigint_default, write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")   # the benchmarks' files
FIXTURE_7B = os.path.join(ROOT, "..", "shared", "fixtures", "r1_distill_qwen_7b")   # outside the repository
FAST = ["--limit", "6", "--n-samples", "2", "--max-new-tokens", "48"]


@pytest.fixture(scope="module")
def toy_dir():
    return toy.BASE_DIR


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, toy_dir):
    """A run with two complete checkpoints (the later one with a probe.pt) and one half-written."""
    run = tmp_path_factory.mktemp("runs") / "toyrun"
    for name in ("step_000010", "step_000020", "step_000030.tmp"):
        shutil.copytree(toy_dir, run / "checkpoints" / name)
    torch.manual_seed(0)
    prb = probe_lib.Probe(128)
    probe_lib.save(str(run / "checkpoints" / "step_000020" / "probe.pt"), prb, probe_lib.make_optimizer(prb))
    return str(run)


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_resolve_model(run_dir, tmp_path):
    assert evaluate.resolve_model("deepseek-r1-distill-qwen-7b") == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    assert evaluate.resolve_model("qwen3-4b-instruct") == "Qwen/Qwen3-4B-Instruct-2507"
    assert evaluate.resolve_model("someone/some-model") == "someone/some-model"
    latest = os.path.join(run_dir, "checkpoints", "step_000020")          # not the .tmp one
    assert evaluate.resolve_model(run_dir) == latest
    assert evaluate.resolve_model(latest) == latest
    assert evaluate.model_label(run_dir, latest) == "toyrun/step_000020"
    assert evaluate.default_out(run_dir, latest) == os.path.join(run_dir, "eval")
    assert evaluate.default_out("someone/m", "someone/m") == os.path.join("eval_out", "someone_m")
    os.makedirs(tmp_path / "empty" / "checkpoints")
    with pytest.raises(evaluate.UserError, match="no complete checkpoint"):
        evaluate.resolve_model(str(tmp_path / "empty"))
    with pytest.raises(evaluate.UserError, match="alias"):
        evaluate.resolve_model("no_such_model")
    with pytest.raises(evaluate.UserError, match="does not exist"):
        evaluate.resolve_model(str(tmp_path / "typo"))          # a local path, not an HF id


@pytest.mark.parametrize("name, count, first_answer", [
    ("math500", 500, "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("aime24", 30, None), ("aime25", 30, "70"), ("amc23", 40, "27"),
])
def test_benchmark_fixtures_in_their_real_layout(name, count, first_answer):
    path = os.path.join(FIXTURES, f"{name}.jsonl")
    with open(path) as f:
        raw = [json.loads(line) for line in f]
    bench, rows, instruction, _ = benchmarks.load_benchmark(f"{name}={path}")
    assert bench == name and len(rows) == count and instruction == data.INSTRUCTION
    assert rows[0]["problem"] == (raw[0].get("problem") or raw[0]["question"]).strip()
    assert rows[0]["answer"] == (first_answer or str(raw[0]["answer"]))
    assert benchmarks.load_benchmark(path, limit=3)[0] == name          # a bare file is named by its stem
    assert len(benchmarks.load_benchmark(path, limit=3)[1]) == 3
    n = benchmarks.settings(name, evaluate.parse_args(["--model", "x"]))["n"]
    assert n == (32 if name in ("aime24", "aime25", "amc23") else 4)


def test_the_released_gate_needs_a_box_in_the_thinking():
    # An R1-style response that boxes only after </think>: right by its last box, wrong under the
    # released gate (natural_eval._evaluate_boxed), the default for real benchmarks.
    after = "3+5=8\n</think>\n\nThe answer is \\boxed{8}"
    inside = "3+5=8, so \\boxed{8}\n</think>\n\nThe answer is \\boxed{8}"
    assert evaluate.natural_correct(after, "8", "8", gate="none")
    assert not evaluate.natural_correct(after, "8", "8", gate="thinking")
    assert evaluate.natural_correct(inside, "8", "8", gate="thinking")
    assert not evaluate.natural_correct(inside, "9", "8", gate="thinking")
    # RLCR answers need their tag, not a box
    assert evaluate.natural_correct("</think><answer>8</answer>", "8", "8", form="tag", gate="thinking")
    args = evaluate.parse_args(["--model", "x"])
    assert benchmarks.settings("math500", args)["gate"] == "thinking"
    assert benchmarks.settings("toy", args)["gate"] == "none"        # the toy boxes after </think> by design
    assert benchmarks.settings("math500", evaluate.parse_args(["--model", "x", "--gate", "none"]))["gate"] == "none"


def test_short_names_resolve_to_hub_ids_without_downloading(monkeypatch):
    asked = []

    def fake_hub(hf_id, config, split, files=None):
        asked.append((hf_id, config, split))
        return [{"problem": "1+1", "answer": 2.0, "url": "https://x/2023_AMC_12A"},
                {"problem": "2+2", "answer": 4.0, "url": "https://x/2022_AMC_12A"}]

    monkeypatch.setattr(data, "_from_hub", fake_hub)
    for name in ("math500", "aime24", "aime25", "amc23"):
        benchmarks.load_benchmark(name)
    assert asked == [("HuggingFaceH4/MATH-500", None, "test"), ("HuggingFaceH4/aime_2024", None, "train"),
                     ("yentinglin/aime_2025", None, "train"), ("AI-MO/aimo-validation-amc", None, "train")]
    assert benchmarks.load_benchmark("amc23")[1] == [{"problem": "1+1", "answer": "2"}]   # 2023 rows only


def test_unknown_benchmark_is_one_line_and_lists_known_names(tmp_path, capsys):
    msg = refusal(capsys, evaluate.main, ["--model", "toy", "--benchmarks", "toy,mathh500",
                                          "--out", tmp_path])
    assert "mathh500" in msg and "known: toy, toy-long, toy-sub, math500, aime24" in msg
    assert "does-not-exist.jsonl" in refusal(capsys, evaluate.main, ["--model", "toy", "--benchmarks",
                                                                      "does-not-exist.jsonl"])
    assert "unknown benchmark 'aime26'" in refusal(capsys, evaluate.main, [
        "--model", "toy", "--benchmarks", f"aime26={tmp_path}/aime25.jsonl"])


@pytest.mark.skipif(not os.path.isdir(FIXTURE_7B), reason="shared fixture r1_distill_qwen_7b not present")
def test_a_model_without_weights_is_one_line(tmp_path, capsys):
    model = FIXTURE_7B   # the real tokenizer and config, no weights
    msg = refusal(capsys, evaluate.main, ["--model", model, "--benchmarks", "toy", "--out", tmp_path])
    assert re.search("cannot load model .*no file named model.safetensors", msg), msg


def test_two_models_side_by_side_and_metrics_match_samples(toy_dir, run_dir, tmp_path, capsys):
    qfile = tmp_path / "sums.jsonl"
    qfile.write_text("".join(json.dumps(r) + "\n" for r in toy.dataset("test")[50:56]))
    out = str(tmp_path / "out")
    evaluate.main(["--model", toy_dir, "--model", run_dir, "--benchmarks", f"toy,{qfile}",
                  "--out", out, "--confidence", "logits"] + FAST)
    printed = capsys.readouterr().out
    blocks = printed.split("### ")[1:]
    assert [b.split()[0] for b in blocks] == ["toy_base", "toyrun/step_000020"]
    for b in blocks:
        rows = [line.split("|")[1:-1] for line in b.splitlines() if line.startswith("| ")]
        assert [r[0].strip() for r in rows[1:]] == ["toy", "sums", "Overall"]
        # every benchmark row names its confidence source, grader and sampling settings
        head = [c.strip() for c in rows[0]]
        for r in rows[1:3]:
            got = dict(zip(head, (c.strip() for c in r)))
            assert (got["confidence"], got["grader"], got["samples"], got["temp"], got["top-p"],
                    got["max tokens"]) == ("logits", "math", "2", "0.6", "1.0", "48")
        assert "(confidence: logits)" in b

    saved = json.load(open(os.path.join(out, "results.json")))
    samples = _rows(os.path.join(out, "samples.jsonl"))
    assert len(samples) == 2 * 2 * 6 * 2
    for label in ("toy_base", "toyrun/step_000020"):
        for bench in ("toy", "sums"):
            mine = [r for r in samples if r["model"] == label and r["benchmark"] == bench]
            want = metrics.calibration([r["confidence"] for r in mine], [r["correct"] for r in mine])
            got = saved[label]["benchmarks"][bench]
            for key in ("acc", "ece", "pce", "brier", "n"):
                assert got[key] == pytest.approx(want[key]), (label, bench, key)
            assert sum(r["count"] for r in got["reliability"]) == len(mine)
            assert os.path.getsize(os.path.join(out, f"reliability_{label.replace('/', '_')}_{bench}.png")) > 5000
            st = saved[label]["settings"][bench]
            assert {k: st[k] for k in ("confidence", "grader", "n", "temperature", "top_p", "max_new_tokens")} == \
                dict(confidence="logits", grader="math", n=2, temperature=0.6, top_p=1.0, max_new_tokens=48)
        ov = saved[label]["overall"]["acc"]
        assert ov == pytest.approx((saved[label]["benchmarks"]["toy"]["acc"] + saved[label]["benchmarks"]["sums"]["acc"]) / 2)


def test_default_confidence_is_the_posthoc_probe_with_the_released_fit_data():
    for model in ("deepseek-r1-distill-qwen-7b", "runs/toy"):
        assert evaluate.parse_args(["--model", model]).confidence == "probe-posthoc"
    assert evaluate.parse_args(["--model", "toy", "--mode", "rlcr"]).confidence == "verbal-forced"
    for w in (benchmarks.REAL, benchmarks.TOY):
        assert (w["probe_questions"], w["probe_samples"], w["posthoc_budgets"]) == (80, 8, 16)
    assert (benchmarks.REAL["every"], benchmarks.REAL["forced_k"]) == (500, 16)   # budgets 500 .. 8000


def test_the_runs_own_probe_is_read_at_its_training_budgets(run_dir, tmp_path, monkeypatch):
    """--confidence probe passes the run's budget fractions (config.json) to the confidence code, which
    reads the probe at the last of them (tests/test_confidence.py pins that position)."""
    seen = []
    real = confidence.sample_confidences

    def spy(*a, **kw):
        seen.append(kw["fractions"])
        return real(*a, **kw)

    monkeypatch.setattr(confidence, "sample_confidences", spy)
    out = str(tmp_path / "out")
    results = evaluate.main(["--model", run_dir, "--benchmarks", "toy", "--out", out, "--confidence", "probe"] + FAST)
    assert results["toyrun/step_000020"]["confidence"] == "probe"
    assert seen and set(seen) == {(0.25, 0.5, 0.75)}       # the fixture run has no config.json
    samples = _rows(os.path.join(out, "samples.jsonl"))
    # The run's probe is read at exit checkpoints too: every 8 thinking tokens on the toy benchmark.
    assert all("checkpoints" in r for r in samples) and any(r["checkpoints"] for r in samples)
    assert all([c[0] for c in r["checkpoints"]] == list(range(8, 8 * len(r["checkpoints"]) + 1, 8)) for r in samples)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"budgets": [1.0]}))
    assert benchmarks.run_config(str(run / "checkpoints" / "step_000001"))["budgets"] == [1.0]
    assert benchmarks.run_config(str(run))["budgets"] == [1.0]


def test_interrupted_evaluation_resumes_without_regenerating(toy_dir, tmp_path, monkeypatch):
    args = ["--model", toy_dir, "--benchmarks", "toy", "--limit", "5", "--n-samples", "3",
            "--max-new-tokens", "48", "--batch-size", "2", "--out", str(tmp_path), "--confidence", "logits"]
    evaluate.main(args)
    path = tmp_path / "samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 15
    kept = lines[:7]                                 # a kill mid-batch: 7 rows and a cut-off line
    path.write_text("".join(kept) + lines[7][:20])
    generated = []
    real = rollout.generate

    def counting(model, tok, prompts, n=1, **kw):
        generated.append(len(prompts) * n)
        return real(model, tok, prompts, n=n, **kw)

    monkeypatch.setattr(rollout, "generate", counting)
    evaluate.main(args)
    again = path.read_text().splitlines(keepends=True)
    assert again[:7] == kept and len(again) == 15 and sum(generated) == 8
    keys = {(r["question"], r["sample"]) for r in map(json.loads, again)}
    assert keys == {(q, j) for q in range(5) for j in range(3)}
    generated.clear()
    evaluate.main(args)
    assert generated == [] and path.read_text().splitlines(keepends=True) == again


@pytest.mark.slow   # a full post-hoc fit (40 x 4) and evaluation
def test_posthoc_probe_beats_the_base_rate_and_early_exit_keeps_its_bound(toy_dir, tmp_path, capsys):
    out = str(tmp_path)
    args = ["--model", toy_dir, "--benchmarks", "toy", "--limit", "40", "--n-samples", "4", "--out", out,
            "--probe-questions", "40", "--probe-samples", "4"]   # released 80 x 8: smaller for test time
    res = evaluate.main(args)                        # default confidence: the post-hoc probe
    rep = res["toy_base"]["posthoc_probe"]
    assert "post-hoc probe: fitting it" in capsys.readouterr().err
    # The released protocol, scaled for the toy (budgets 8 .. 128), saved with the fit.
    p = rep["protocol"]
    assert (p["questions"], p["n"], p["count"], p["every"], p["epochs"], p["patience"], p["batch"], p["seed"]) == \
        (40, 4, 16, 8, 100, 30, 64, 42)
    assert (p["lead"], p["close"], p["stop"]) == ("", "think", ["\n"])
    assert rep["examples"] == rep["n_train"] + rep["n_val"] == 40 * 4 * 16
    assert 0.2 <= rep["n_val"] / rep["examples"] < 0.2 + 4 * 16 / rep["examples"] + 1e-9
    assert rep["val_problems"] + rep["train_problems"] == 40
    assert rep["epochs"] <= 100 and rep["best_epoch"] <= rep["epochs"] and len(rep["grid"]) == 12
    assert 0 < rep["natural_copied"] <= rep["past_end"] < rep["examples"]
    soft = rep["base_bce"] - rep["val_bce"]
    print(f"\npost-hoc probe on {rep['n_val']} validation prefixes: BCE {rep['val_bce']:.4f} vs a constant "
          f"{rep['base_bce']:.4f} (gain {soft:.4f})")
    assert soft > 0.01
    b = res["toy_base"]["benchmarks"]["toy"]
    rows = [r for r in _rows(os.path.join(out, "samples.jsonl"))]
    assert all(r["source"] == "probe-posthoc" for r in rows)
    ee = b["early_exit"]
    assert [e["epsilon"] for e in ee] == [0.1, 0.2, 0.3]
    for e in ee:
        assert e["threshold"] is not None and e["cal_bound"] <= e["epsilon"]
        assert 0.0 <= e["tokens_saved"] <= 1.0 and 0.0 <= e["test_risk"] <= 1.0
    # The bound recomputed from samples.jsonl with the same split as report.early_exit_of.
    again = report.early_exit_of(rows)["early_exit"]
    assert [e["threshold"] for e in again] == [e["threshold"] for e in ee]
    # A second evaluation reuses the cached fit (same protocol): nothing refitted, same report.
    res2 = evaluate.main(args)
    assert "post-hoc probe: fitting it" not in capsys.readouterr().err
    assert res2["toy_base"]["posthoc_probe"]["val_bce"] == rep["val_bce"]


def test_an_rlcr_run_is_prompted_and_graded_in_its_answer_tags(toy_dir, tmp_path):
    # The run's config.json says rlcr: its instruction is reused and the answer is the last <answer>
    # tag (the box is absent), so the toy base, which speaks the format, scores as it does in boxes.
    run = tmp_path / "rlcrrun"
    shutil.copytree(toy_dir, run / "checkpoints" / "step_000010")
    (run / "config.json").write_text(json.dumps(dict(reward="rlcr", instruction=toy.RLCR_INSTRUCTION)))
    out = str(tmp_path / "out")
    res = evaluate.main(["--model", str(run), "--benchmarks", "toy", "--out", out, "--confidence", "verbal",
                         "--limit", "40", "--n-samples", "2"])
    rows = _rows(os.path.join(out, "samples.jsonl"))
    golds = {i: r["answer"] for i, r in enumerate(toy.dataset("test")[:40])}
    assert all(r["answer"] is not None and r["correct"] == int(r["answer"] == golds[r["question"]]) for r in rows)
    assert all(r["verbal_missing"] is False for r in rows)   # the base writes a confidence tag
    b = res["rlcrrun/step_000010"]["benchmarks"]["toy"]
    assert 0.3 < b["acc"] < 0.9 and res["rlcrrun/step_000010"]["settings"]["toy"]["answer"] == "tag"
    # graded by boxes instead, the same samples would all be wrong: there is no box
    again = evaluate.main(["--model", str(run), "--benchmarks", "toy", "--out", str(tmp_path / "box"),
                           "--confidence", "verbal", "--limit", "4", "--n-samples", "1", "--answer", "box"])
    assert again["rlcrrun/step_000010"]["benchmarks"]["toy"]["acc"] == 0.0


def fit_rows(src, monkeypatch, tmp_path, count):
    """The questions get_probe fits the post-hoc probe on for --probe-data src (the fit itself skipped)."""
    seen = {}
    with monkeypatch.context() as m:
        m.setattr(confidence, "posthoc_probe", lambda cache, model, tok, questions, *a, **k:
                  seen.update(rows=questions) or (None, {}))
        args = evaluate.parse_args(["--model", "toy", "--probe-data", src, "--probe-questions", str(count)])
        confidence.get_probe("probe-posthoc", None, None, "base", toy.BASE_DIR, str(tmp_path), args, 0)
    return seen["rows"]


def test_the_pooled_toy_fit_takes_every_toy_benchmarks_train_split_in_turn(toy_dir, tmp_path, monkeypatch):
    # --probe-data toy-pooled: the matched fit, on every toy benchmark's train split, so the post-hoc
    # confidence is not fixed at RL's distribution's accuracy (docs/toy-world.md).
    splits = {name: data.load_rows(name, split="train") for name in data.TOY_BENCHMARKS}
    rows = fit_rows("toy-pooled", monkeypatch, tmp_path, 10 * toy.N_TRAIN)
    assert rows[:6] == [splits[name][i] for i in (0, 1) for name in data.TOY_BENCHMARKS]
    assert len(rows) == 3 * toy.N_TRAIN and fit_rows("toy", monkeypatch, tmp_path, 10 * toy.N_TRAIN) == splits["toy"]
    res = evaluate.main(["--model", toy_dir, "--benchmarks", "toy-sub", *FAST, "--out", str(tmp_path),
                         "--probe-data", "toy-pooled", "--probe-questions", "6", "--probe-samples", "2",
                         "--posthoc-budgets", "2"])
    rep = res["toy_base"]["posthoc_probe"]
    assert rep["data"] == "toy-pooled" and rep["protocol"]["questions"] == 6
    assert rep["n_train"] + rep["n_val"] == 6 * 2 * 2


def test_the_readmes_c2gspg_command_reads_forced_rlcr_confidences_on_a_toy_c2gspg_run(tmp_path, capsys):
    """The released evaluation reads C2GSPG in --mode rlcr (its README): RLCR-format prompts, the
    answer in <answer>, the confidence the mean <confidence> of forced re-answers. The README's row
    names `--mode rlcr`; `--confidence verbal` alone keeps the run's boxed prompt, under which a
    C2GSPG run writes no tag: 0.5 on every sample."""
    run = str(tmp_path / "c2gspg")
    train.main(["--reward", "c2gspg", "--steps", "2", "--out", run, "--prompts-per-step", "4", "--group-size", "4",
                "--max-new-tokens", "48", "--eval-n", "0", "--save-every", "0"])
    assert json.load(open(os.path.join(run, "config.json")))["instruction"] == toy.INSTRUCTION   # boxed
    few = ["--benchmarks", "toy", "--limit", "12", "--n-samples", "2"]
    evaluate.main(["--model", run, "--confidence", "verbal", "--out", str(tmp_path / "verbal"), *few])
    rows = _rows(str(tmp_path / "verbal" / "samples.jsonl"))
    assert {r["confidence"] for r in rows} == {0.5} and all(r["verbal_missing"] for r in rows)
    res = evaluate.main(["--model", run, "--mode", "rlcr", "--out", str(tmp_path / "rlcr"), *few])
    rows = _rows(str(tmp_path / "rlcr" / "samples.jsonl"))
    st = res["c2gspg/step_000002"]["settings"]["toy"]
    assert (st["confidence"], st["answer"], st["instruction"]) == ("verbal-forced", "tag", toy.RLCR_INSTRUCTION)
    conf = [r["confidence"] for r in rows]
    # each the mean of 4 re-answers' tags, which the toy draws from 0.1 .. 0.9: a multiple of 1/40
    assert len(set(conf)) > 3 and all(0.1 <= c <= 0.9 and abs(c * 40 - round(c * 40)) < 1e-9 for c in conf)
    assert all(0 <= r["verbal_missing"] <= 4 for r in rows)   # re-answers without a tag, of 4 (read 0.5)
    assert sum(r["verbal_missing"] for r in rows) <= len(rows) * 4 // 10
    assert all(r["answer"] is not None for r in rows) and 0 < res["c2gspg/step_000002"]["benchmarks"]["toy"]["acc"]
    assert "--mode rlcr: lcb has no RLCR-format evaluation" in refusal(capsys, evaluate.main, [
        "--model", run, "--mode", "rlcr", "--benchmarks", f"lcb={ROOT}/tests/fixtures/lcb.jsonl",
        "--out", tmp_path / "lcb"])


def test_a_missing_model_is_one_line_and_exit_2_as_in_train_py(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", str(tmp_path / "runs" / "nope"), "--benchmarks", "toy"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == f"evaluate.py: error: model directory {tmp_path}/runs/nope does not exist", err


def test_an_empty_rlcr_answer_tag_followed_by_a_box_is_graded_by_the_box_as_released():
    # released: 1_obtain --use_rlcr falls back to the strict box where the tag is blank; natural_eval
    # gates on the tag being there, so without a tag the box does not count
    s = {"gate": "thinking"}
    texts = ["</think><answer></answer> so \\boxed{5}", "</think>\\boxed{5}", "</think><answer></answer> \\boxed{4}"]
    assert evaluate.grade_call(texts, ["5"] * 3, "math500", s, "tag") == (["5", None, "4"], [True, False, False])


def test_the_released_token_counting_reaches_the_protocol(tmp_path, monkeypatch):
    # the released token counting is one flag away; a cache fitted under it is another protocol
    seen = {}
    monkeypatch.setattr(confidence, "posthoc_probe",
                        lambda cache, model, tok, questions, instruction, close_id, protocol, **k:
                        seen.update(protocol) or (None, {}))
    for given, tokens in (([], None), (["--posthoc-tokens", "text"], "text")):
        seen.clear()
        confidence.get_probe("probe-posthoc", None, None, "base", toy.BASE_DIR, str(tmp_path),
                             evaluate.parse_args(["--model", "toy", *given]), 0)
        assert seen.get("tokens") == tokens


@pytest.fixture
def verl_files(tmp_path, monkeypatch):
    """(benchmark parquet, fit parquet, rendered): toy problems in verl's layout, the release's (its
    third benchmark question with a wrong gold), and every chat list the chat template renders."""
    from test_data import write_verl
    bench, fit = toy.dataset("test")[:3], toy.dataset("train")[:4]
    golds = [bench[0]["answer"], bench[1]["answer"], "-1"]
    rendered, render = [], data._render
    monkeypatch.setattr(data, "_render", lambda tok, m, **kw: rendered.append(m) or render(tok, m, **kw))
    return (write_verl(tmp_path / "math500.parquet", [(r["problem"], g) for r, g in zip(bench, golds)]),
            write_verl(tmp_path / "lead_80.parquet", [(r["problem"], r["answer"]) for r in fit]), rendered)


def test_verl_layout_parquets_are_evaluated_and_fitted_on_as_released(verl_files, tmp_path, capsys):
    """--benchmarks math500=FILE.parquet and --probe-data FILE.parquet in verl's layout: each prompt is
    the parquet's chat list rendered as is (math500's instruction not appended again), each gold its
    reward_model.ground_truth. Before, both stopped with "no answer field"."""
    from evaluation.benchmarks import digest
    bench_file, fit_file, rendered = verl_files
    res = evaluate.main(["--model", "toy", "--benchmarks", f"math500={bench_file}", "--probe-data", fit_file,
                         "--out", str(tmp_path / "out"), "--n-samples", "4", "--max-new-tokens", "48", "--gate",
                         "none", "--every", "8", "--probe-questions", "4", "--probe-samples", "2",
                         "--posthoc-budgets", "2"])
    bench, fit = data.load_rows(bench_file), data.load_rows(fit_file)
    for r in bench + fit:
        assert [{"role": "user", "content": r["problem"]}] in rendered
        assert [{"role": "user", "content": r["problem"] + data.INSTRUCTION}] not in rendered
    samples = _rows(str(tmp_path / "out" / "samples.jsonl"))
    assert len(samples) == 12 and {s["benchmark"] for s in samples} == {"math500"}
    assert [digest([r["problem"], r["answer"]], 12) for r in bench] == [
        next(s["q"] for s in samples if s["question"] == q) for q in range(3)]
    right = [sum(s["correct"] for s in samples if s["question"] == q) for q in range(3)]
    assert right[0] + right[1] > 0 and right[2] == 0    # graded against the ground truths: "-1" is never right
    (report,) = [m["posthoc_probe"] for m in res.values()]
    assert report["data"] == fit_file and report["protocol"]["questions"] == 4
    assert "--mode rlcr: math500's prompts are a verl file's, as released, and do not " in refusal(
        capsys, evaluate.main, ["--model", "toy", "--benchmarks", f"math500={bench_file}", "--mode", "rlcr"])


def test_train_reads_verl_layout_parquets(verl_files, tmp_path):
    """train.py --data FILE.parquet and --eval-data FILE.parquet in verl's layout: the training and
    held-out prompts are their chat lists."""
    bench_file, fit_file, rendered = verl_files
    train.main(["--data", fit_file, "--eval-data", bench_file, "--eval-n", "3", "--steps", "1", "--out",
                str(tmp_path / "run"), "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "40",
                "--save-every", "0"])
    for r in data.load_rows(fit_file) + data.load_rows(bench_file):
        assert [{"role": "user", "content": r["problem"]}] in rendered
    metrics = _rows(str(tmp_path / "run" / "metrics.jsonl"))
    held = [m for m in metrics if m.get("eval")]
    assert [m.get("step") for m in metrics if not m.get("eval")] == [1] and len(held) == 2
    assert all(m["eval_n"] == 3 and m["eval_accuracy"] <= 2 / 3 for m in held)   # the third gold, "-1", is never right


def test_an_unbounded_row_stops_train_and_evaluate_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """A 300,000-character problem or a lone surrogate in a data file: one line naming the file and the
    row, before any model is loaded (red team 4, cases 26 and 27: before, 46 s and 2.3 GB, then the
    model's chat template was blamed). train.py exits 2; evaluate.py ends, as for every user error, with
    its one line."""
    def no_model(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(train, "load_policy", no_model)
    monkeypatch.setattr(evaluate.checkpoint, "load_model", no_model)
    big, lone = tmp_path / "big.jsonl", tmp_path / "lone.jsonl"
    big.write_text(json.dumps({"problem": "1+" * 150_000, "answer": "1"}) + "\n")
    lone.write_text('{"problem": "2+2", "answer": "4"}\n{"problem": "2+2 \\ud800", "answer": "4"}\n')
    # red team 5, case 6: an integer over Python's 4,300 digits was a ValueError traceback naming no file
    row, long = '{"problem": "2+2", "answer": 4}', '{"problem": "2+2", "answer": %s}' % ("4" * 5000)
    digits = "holds an integer of over 4,300 digits, which Python does not read as a number: fix the row"
    cases = [(big, "row 0 has a problem of 300,000 characters"), (lone, "row 1 problem is not valid Unicode")]
    for name, text, line in (("int3.jsonl", f"{row}\n{row}\n{long}\n", 3),
                             ("int1.jsonl", f"{long}\n{row}\n", 1), ("int2.json", f"[{row},\n{long}]", 2)):
        cases.append((tmp_path / name, f"line {line} {digits}"))
        cases[-1][0].write_text(text)
    for path, why in cases:
        with pytest.raises(SystemExit) as e:
            train.main(["--data", str(path), "--steps", "1", "--out", str(tmp_path / f"run_{path.stem}")])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith(f"error: {path}: {why}") and "\n" not in err, err
        line = refusal(capsys, evaluate.main, ["--model", "toy", "--benchmarks", f"math500={path}", "--out",
                                               tmp_path / "eval"])
        assert line.startswith(f"evaluate.py: error: {path}: {why}"), line


def test_the_posthoc_fit_shows_each_phase_and_evaluate_ends_naming_its_folder(tmp_path, capsys):
    # newcomer 6: minutes of silence after the forced answers' bar, and no word of where the results went
    out = tmp_path / "eval"
    evaluate.main(["--model", "toy", *EVAL_SMALL, "--out", str(out)])
    printed = capsys.readouterr()
    phases = ["post-hoc probe: fitting it (then cached in", "post-hoc rollouts: 100%",
              "post-hoc forced answers: 100%", "post-hoc probe: grading ",
              "post-hoc probe: reading the hidden state at 16 prefixes",   # 4 questions x 2 samples x 2
              "post-hoc fit, 12 settings at once: "]
    at = [printed.err.find(p) for p in phases]
    assert -1 not in at and at == sorted(at), dict(zip(phases, at))
    assert printed.out.splitlines()[-1] == f"results: {out}  (results.json, samples.jsonl, reliability_*.png)"
    assert sorted(os.listdir(out))[-3:] == ["reliability_toy_toy.png", "results.json", "samples.jsonl"]


def test_responses_made_elsewhere_give_the_table_of_evaluating_them_here(tmp_path, capsys):
    # issue 53: another engine's responses (--responses) are graded and scored as if sampled here
    argv = ["--model", "toy", "--benchmarks", "toy,toy-sub", "--limit", "4", "--n-samples", "2",
            "--max-new-tokens", "36", *PROBE_SMALL]
    evaluate.main([*argv, "--out", str(tmp_path / "here")])
    here = capsys.readouterr().out.splitlines()[:-1]   # the last line names the folder
    drawn = _rows(tmp_path / "here" / "samples.jsonl")
    # by problem text or by index, in any question order (a question's samples in their order)
    made = [dict(benchmark=r["benchmark"], response=r["text"], **(
        {"problem": r["problem"]} if r["sample"] else {"question": r["question"]}))
        for r in sorted(drawn, key=lambda r: (-r["question"], r["sample"]))]
    evaluate.main([*argv, "--out", str(tmp_path / "there"), "--responses", jsonl(tmp_path / "r.jsonl", made)])
    assert capsys.readouterr().out.splitlines()[:-1] == here
    graded = _rows(tmp_path / "there" / "samples.jsonl")
    strip = lambda r: {k: v for k, v in r.items() if k != "key"}  # noqa: E731
    assert list(map(strip, graded)) == list(map(strip, drawn)) and graded[0]["key"] != drawn[0]["key"]
    assert {r["finish"] for r in drawn} == {"eos", "length"}   # EOS after a response, none at the cap
    # the file's texts are what is graded, as many per question as it holds
    gold = [dict(benchmark=b, question=q, response=f"</think>\\boxed{{{row['answer']}}}")
            for b in ("toy", "toy-sub") for q, row in enumerate(data.load_rows(b, split="test", limit=4))]
    res = evaluate.main([*argv, "--out", str(tmp_path / "there"), "--responses",
                         jsonl(tmp_path / "g.jsonl", gold)])
    assert [(b["acc"], b["n"]) for b in res["toy"]["benchmarks"].values()] == [(1.0, 4), (1.0, 4)]


def test_the_help_header_says_what_evaluate_does_and_how_to_call_it():
    # issue 60: the header was the docstring's first line, cut off mid-sentence ("... and a")
    header = " ".join(evaluate.build_parser().format_help().split("options:")[0].split())
    assert ("Evaluate models: accuracy, calibration (ECE, PCE, Brier, AUROC), reliability diagrams, and a use of "
            "the confidence (conformal early exit).") in header
    assert "python evaluate.py --model runs/toy --benchmarks toy" in header


def test_responses_past_the_cap_are_cut_there_and_graded_on_what_is_left(tmp_path):
    # red team 6, row 1: a response longer than --max-new-tokens was graded and scored in full, while
    # results.json recorded the cap; now it is cut at the cap as a sample drawn here would be
    work = "1+1=2\n" * 20   # 120 tokens of the toy's tokenizer before the box
    made = [dict(benchmark="toy", question=q, response=f"{work}</think>\\boxed{{{row['answer']}}}")
            for q, row in enumerate(data.load_rows("toy", split="test", limit=2))]
    res = evaluate.main(["--model", "toy", "--benchmarks", "toy", "--limit", "2", "--n-samples", "1",
                         "--max-new-tokens", "24", "--confidence", "logits", "--out", str(tmp_path / "e"),
                         "--responses", jsonl(tmp_path / "r.jsonl", made)])
    graded = _rows(tmp_path / "e" / "samples.jsonl")
    assert [(r["length"], r["finish"], r["text"], r["correct"]) for r in graded] == [(24, "length", work[:24], 0)] * 2
    assert res["toy"]["benchmarks"]["toy"]["acc"] == 0.0 and res["toy"]["settings"]["toy"]["max_new_tokens"] == 24


def test_exported_prompts_sampled_elsewhere_give_the_table_of_evaluating_here(tmp_path, capsys):
    # issue 60, item 5: the exact prompts out (--export-prompts), another engine's responses back in;
    # the project's own sampler stands in for the engine, greedy so that both draw the same responses
    argv = ["--model", "toy", "--benchmarks", "toy,toy-sub", "--limit", "4", "--n-samples", "2",
            "--max-new-tokens", "36", "--temperature", "0", "--confidence", "logits"]
    assert evaluate.main([*argv, "--export-prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "x")]) is None
    assert not os.path.exists(tmp_path / "x")   # nothing generated, nothing written but the prompts
    model, tok = evaluate.checkpoint.load_model("toy")
    made = []
    for p in _rows(tmp_path / "p.jsonl"):
        out = rollout.generate(model, tok, [p["prompt_ids"]], n=p["n"], max_new_tokens=p["max_tokens"],
                               temperature=p["temperature"], top_p=p["top_p"])
        made += [dict(benchmark=p["benchmark"], question=p["question"], response=t) for t in out.texts]
    capsys.readouterr()
    evaluate.main([*argv, "--out", str(tmp_path / "here")])
    here = capsys.readouterr().out.splitlines()[:-1]   # the last line names the folder
    evaluate.main([*argv, "--out", str(tmp_path / "there"), "--responses", jsonl(tmp_path / "r.jsonl", made)])
    assert capsys.readouterr().out.splitlines()[:-1] == here
    golds = {b: [r["answer"] for r in data.load_rows(b, split="test", limit=4)] for b in ("toy", "toy-sub")}
    assert [r["gold"] for r in _rows(tmp_path / "there" / "samples.jsonl")] == [
        g for b in golds for g in golds[b] for _ in range(2)]   # each sample carries its gold


EVAL_CASES = {
    "n-samples 0": (lambda t: ["--n-samples", "0"], "--n-samples 0: must be >= 1"),
    "limit 0": (lambda t: ["--limit", "0"], "--limit 0: must be >= 1"),
    "max-new-tokens -1": (lambda t: ["--max-new-tokens", "-1"], "--max-new-tokens -1: must be >= 1"),
    "top-p nan": (lambda t: ["--top-p", "nan"], "--top-p nan: must be in (0, 1]"),
    "out is a file": (lambda t: ["--out", write(t / "f", "x")], "is a file, not a folder"),
    "{} line in samples.jsonl": (lambda t: ["--out", t / "eval"], "samples.jsonl line 2 is not a row of this log"),
    "100,000-char prompt": (lambda t: ["--benchmarks", jsonl(t / "q.jsonl", [{"problem": "1" * 100_000, "answer": "1"}])],
                            "do not fit the model's context of 256 tokens"),
    "responses of another benchmark": (lambda t: ["--responses", jsonl(t / "r.jsonl", [
        dict(benchmark="math500", question=0, response="2")])],
        "row 1: benchmark 'math500' is not in --benchmarks toy"),
    "responses to another question": (lambda t: ["--responses", jsonl(t / "r.jsonl", [
        dict(benchmark="toy", question=0, response="2"),
        dict(benchmark="toy", problem="1+1", response="2")])],
        "row 2: no question '1+1' among toy's 2"),
    "responses past --limit": (lambda t: ["--responses", jsonl(t / "r.jsonl", [
        dict(benchmark="toy", question=2, response="2")])], "row 1: no question 2 among toy's 2"),
    "a response without its text": (lambda t: ["--responses", jsonl(t / "r.jsonl", [
        dict(benchmark="toy", question=0, text="2")])], "row 1 is not a response: write {\"benchmark\""),
    "responses to one question of two": (lambda t: ["--responses", jsonl(t / "r.jsonl", [
        dict(benchmark="toy", question=0, response="2")])],
        "toy's questions have 0 to 1 responses (question 1: 0)"),
    "responses not JSON": (lambda t: ["--responses", write(t / "r.jsonl", "{oops\n")], "is neither JSON nor"),
    "no responses file": (lambda t: ["--responses", t / "none.jsonl"], "file not found"),
}


@pytest.mark.parametrize("case", EVAL_CASES)
def test_evaluate_refuses_in_one_line(case, tmp_path, capsys):
    make, words = EVAL_CASES[case]
    if case.startswith("{}"):
        os.makedirs(tmp_path / "eval")
        jsonl(tmp_path / "eval" / "samples.jsonl", [dict(model="toy", benchmark="toy", question=0, sample=0,
                                                          correct=1, confidence=0.5), {}])
    msg = refusal(capsys, evaluate.main, ["--model", "toy", *EVAL_SMALL, "--out", tmp_path / "new",
                                          *make(tmp_path)])
    assert words in msg, msg
    assert not os.path.exists(tmp_path / "new")


@pytest.mark.slow   # evaluate.py killed and resumed
def test_ctrl_c_in_evaluate_exits_130_and_the_same_command_resumes(tmp_path):
    out = str(tmp_path / "eval")
    cmd = [sys.executable, os.path.join(ROOT, "evaluate.py"), "--model", "toy", "--benchmarks", "toy",
           "--limit", "60", "--n-samples", "2", "--max-new-tokens", "24", "--batch-size", "4", *PROBE_SMALL,
           "--out", out]
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    samples = os.path.join(out, "samples.jsonl")
    deadline = time.time() + 300
    while not (os.path.exists(samples) and os.path.getsize(samples)) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("interrupted: the samples so far are kept")
    assert not os.path.exists(os.path.join(out, files.LOCK))
    subprocess.run(cmd, env=ENV, cwd=ROOT, check=True, capture_output=True)
    rows = evaluate.read_samples(samples)
    assert sorted((r["question"], r["sample"]) for r in rows) == [(q, j) for q in range(60) for j in range(2)]


EVAL = ["--benchmarks", "toy", "--limit", "2", "--n-samples", "1", "--max-new-tokens", "8",
        "--confidence", "logits"]


def test_evaluating_a_nan_model_writes_no_nan_rows(nan_model, tmp_path):
    out = tmp_path / "eval"
    for _ in range(2):   # 81f6578: NaN rows appended, then every rerun failed on them
        with pytest.raises(SystemExit) as e:
            evaluate.main(["--model", nan_model, *EVAL, "--out", str(out)])
        assert e.value.code == ("evaluate.py: error: 2 of 2 logit confidences are NaN or inf: the model's "
                                "weights hold NaN or inf")
        assert not os.path.exists(out / "samples.jsonl") or os.path.getsize(out / "samples.jsonl") == 0


def test_results_json_that_is_not_an_object_is_refused_before_sampling(tmp_path, capsys):
    out = tmp_path / "eval"
    os.makedirs(out)
    write(out / "results.json", "[]")
    assert refusal(capsys, evaluate.main, ["--model", "toy", *EVAL, "--out", out]) == (
        f"evaluate.py: error: {out / 'results.json'} is not an object of results per model: "
        "remove it (samples.jsonl keeps every sample)")
    assert not os.path.exists(out / "samples.jsonl")


RUN_CONFIG_CASES = {
    "a list": ("[1, 2]", "is not a JSON object"),
}


@pytest.mark.parametrize("case", RUN_CONFIG_CASES)
def test_a_bad_run_config_is_one_line_when_evaluating_the_run(case, tmp_path):
    content, words = RUN_CONFIG_CASES[case]
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    os.makedirs(ckpt)
    write(tmp_path / "run" / "config.json", content)
    with pytest.raises(UserError) as e:
        benchmarks.run_config(str(ckpt))
    assert str(tmp_path / "run") in str(e.value) and words in str(e.value), str(e.value)
