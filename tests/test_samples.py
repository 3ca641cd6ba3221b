"""What identifies a model, a benchmark and a sample in an evaluation folder (evaluation/benchmarks.py
and results.json): different things never share samples, post-hoc probes or results entries."""
import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from evaluation import confidence
import evaluate
import metrics
import runs
import toy
from runs import EVAL_SMALL, snapshot
from test_evaluate import _rows

EVAL = [*EVAL_SMALL, "--confidence", "logits"]
FAST = ["--limit", "4", "--n-samples", "2", "--max-new-tokens", "56", "--confidence", "logits"]


PH = ["--probe-questions", "4", "--probe-samples", "2", "--posthoc-budgets", "2"]


def jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return runs.jsonl(path, rows)


def run(*args):
    return evaluate.main([str(a) for a in args])


def refused(capsys, *args):
    return runs.refusal(capsys, evaluate.main, args)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """a/model (the toy base) and b/model (its embedding rows reversed: another model, same folder name)."""
    root = tmp_path_factory.mktemp("models")
    for side in "ab":
        shutil.copytree(toy.BASE_DIR, root / side / "model")
    p = str(root / "b" / "model" / "model.safetensors")
    sd = load_file(p)
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].flip(0).contiguous()
    save_file(sd, p, metadata={"format": "pt"})
    return str(root / "a" / "model"), str(root / "b" / "model")


def test_two_models_with_one_folder_name_keep_their_own_samples_and_results(two_models, tmp_path):
    # D3: at 81f6578 b/model found a/model's samples under the label "model": one entry, a's accuracy.
    a, b = two_models
    alone = run("--model", b, "--benchmarks", "toy", "--out", tmp_path / "b_alone", *FAST)["model"]
    res = run("--model", a, "--model", b, "--benchmarks", "toy", "--out", tmp_path / "both", *FAST)
    assert len(res) == 2
    (la, ra), (lb, rb) = res.items()
    assert la == "model" and lb.startswith("model@") and rb["path"] == b
    assert rb["benchmarks"]["toy"]["acc"] == alone["benchmarks"]["toy"]["acc"]
    assert ra["benchmarks"]["toy"]["acc"] != rb["benchmarks"]["toy"]["acc"]
    saved = json.load(open(tmp_path / "both" / "results.json"))
    assert set(saved) == {la, lb} and saved[lb]["model_id"] != saved[la]["model_id"]
    assert len(_rows(tmp_path / "both" / "samples.jsonl")) == 2 * 4 * 2
    # the same command again: each model finds its own label and samples, nothing is added
    again = run("--model", a, "--model", b, "--benchmarks", "toy", "--out", tmp_path / "both", *FAST)
    assert list(again) == [la, lb] and again[lb]["benchmarks"]["toy"] == rb["benchmarks"]["toy"]
    assert len(_rows(tmp_path / "both" / "samples.jsonl")) == 2 * 4 * 2


def test_two_models_with_one_folder_name_fit_their_own_posthoc_probe(two_models, tmp_path, capsys):
    # D3: at 81f6578 the post-hoc probe of b/model was a/model's, read from posthoc_probe_model.pt.
    a, b = two_models
    fast = [x for x in FAST if x not in ("--confidence", "logits")]
    run("--model", a, "--benchmarks", "toy", "--out", tmp_path, *fast, *PH)
    assert "post-hoc probe: fitting it" in capsys.readouterr().err
    run("--model", b, "--benchmarks", "toy", "--out", tmp_path, *fast, *PH)
    assert "post-hoc probe: fitting it" in capsys.readouterr().err  # fitted for b, not a's cache
    run("--model", a, "--benchmarks", "toy", "--out", tmp_path, *fast, *PH)
    assert "post-hoc probe: fitting it" not in capsys.readouterr().err  # a's own cache is there


def test_a_resumed_evaluation_with_other_settings_samples_anew(tmp_path, capsys):
    # D5: at 81f6578 no sample was made and the old 24-token samples were reported as 8-token ones.
    run("--model", "toy", "--out", tmp_path, *FAST)
    capsys.readouterr()
    res = run("--model", "toy", "--out", tmp_path, *FAST, "--temperature", "1.5", "--seed", "9",
              "--max-new-tokens", "8")["toy"]
    rows = _rows(tmp_path / "samples.jsonl")
    new = rows[8:]
    assert len(rows) == 16 and max(r["length"] for r in new) <= 8 < max(r["length"] for r in rows[:8])
    want = metrics.calibration([r["confidence"] for r in new], [r["correct"] for r in new])
    assert res["benchmarks"]["toy"]["acc"] == want["acc"] and res["benchmarks"]["toy"]["n"] == 8
    assert res["settings"]["toy"]["key"] == new[0]["key"] != rows[0]["key"]


def test_benchmarks_are_their_files_and_rows_not_their_names(tmp_path):
    # D6: at 81f6578 b2/q.jsonl reused b1/q.jsonl's samples (one row "q", n 16), and my/toy.jsonl
    # (every gold 999) reused the built-in toy's samples and its accuracy.
    test = toy.dataset("test")
    q1 = jsonl(tmp_path / "b1" / "q.jsonl", test[:4])
    q2 = jsonl(tmp_path / "b2" / "q.jsonl", test[10:14])
    out = tmp_path / "out"
    res = run("--model", "toy", "--benchmarks", f"{q1},{q2}", "--out", out, *FAST)["toy"]["benchmarks"]
    assert list(res) == ["q", q2] and res["q"]["n"] == res[q2]["n"] == 8
    alone = run("--model", "toy", "--benchmarks", q2, "--out", tmp_path / "q2", *FAST)["toy"]["benchmarks"]["q"]
    assert res[q2]["acc"] == alone["acc"]
    assert run("--model", "toy", "--out", out, *FAST)["toy"]["benchmarks"]["toy"]["acc"] > 0
    wrong = jsonl(tmp_path / "my" / "toy.jsonl", [dict(r, answer="999") for r in test[:4]])
    mine = run("--model", "toy", "--benchmarks", wrong, "--out", out, *FAST)["toy"]
    assert list(mine["benchmarks"]) == [wrong] and mine["benchmarks"][wrong]["acc"] == 0.0
    assert mine["settings"][wrong]["suffix"] == confidence.EVAL_SUFFIX     # not the toy world's settings
    assert mine["settings"][wrong]["benchmark_source"] == wrong
    # a file edited in place: its changed rows are sampled again, against their new golds
    jsonl(q1, [dict(r, answer="999") for r in test[:4]])
    again = run("--model", "toy", "--benchmarks", q1, "--out", out, *FAST)["toy"]["benchmarks"]["q"]
    assert again["acc"] == 0.0 and again["n"] == 8


def test_samples_rows_are_checked_and_duplicates_count_once(tmp_path, capsys):
    # D12: at 81f6578 a duplicated row was counted twice (n 9 for 4 x 2), and rows with question
    # "3" (TypeError), -5 (counted) or without an answer (KeyError in evaluation/report.py) were not refused.
    first = run("--model", "toy", "--out", tmp_path, *FAST)["toy"]["benchmarks"]["toy"]
    path = tmp_path / "samples.jsonl"
    good = path.read_text()
    row = json.loads(good.splitlines()[0])
    path.write_text(good + json.dumps(row) + "\n")
    assert run("--model", "toy", "--out", tmp_path, *FAST)["toy"]["benchmarks"]["toy"] == first
    no_answer = {k: v for k, v in row.items() if k != "answer"}
    for bad in (dict(row, question="3"), dict(row, question=-5), dict(row, question=1.5), dict(row, sample=True),
                dict(row, confidence=float("nan")), dict(row, correct=7), no_answer):
        path.write_text(good + json.dumps(bad) + "\n" + good.splitlines()[1] + "\n")
        msg = refused(capsys, "--model", "toy", "--out", tmp_path, *FAST)
        assert f"{path} line 9 is not a row of this log" in msg, bad


def test_rows_of_an_older_version_are_not_reused(tmp_path, capsys):
    # Old rows have no settings key: at 81f6578's format they are sampled again.
    run("--model", "toy", "--out", tmp_path, *FAST)
    path = tmp_path / "samples.jsonl"
    old = [{k: v for k, v in r.items() if k not in ("key", "q")} for r in _rows(path)]
    jsonl(path, old)
    capsys.readouterr()
    res = run("--model", "toy", "--out", tmp_path, *FAST)
    assert len(_rows(path)) == 16 and list(res) == ["toy"] and res["toy"]["benchmarks"]["toy"]["n"] == 8


def test_evaluate_refuses_a_training_run_folder_as_out(tmp_path, capsys):
    # D16: at 81f6578 the evaluation rows went into the run's own samples.jsonl.
    run_dir = tmp_path / "run"
    jsonl(run_dir / "metrics.jsonl", [{"step": 1}])
    (run_dir / "samples.jsonl").write_text("")
    before = snapshot(run_dir)
    msg = refused(capsys, "--model", "toy", "--out", run_dir, *FAST)
    assert "is a training run's folder" in msg and str(run_dir) in msg
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("adapter", [False, True])
def test_evaluate_refuses_a_model_folder_as_out(adapter, tmp_path, capsys):
    # red team 5: before, samples.jsonl, results.json and the reliability diagrams went in beside the weights;
    # red team 6, row 9: a LoRA checkpoint (adapter_config.json beside its weights) was taken for "other"
    model = str(shutil.copytree(toy.BASE_DIR, tmp_path / "model"))
    has = "config.json, model.safetensors"
    if adapter:   # what a --lora-rank run's checkpoint holds in place of config.json and the full weights
        os.rename(f"{model}/config.json", f"{model}/adapter_config.json")
        os.rename(f"{model}/model.safetensors", f"{model}/adapter_model.safetensors")
        has = "adapter_config.json, adapter_model.safetensors"
    before = snapshot(model)
    assert refused(capsys, "--model", "toy" if adapter else model, "--out", model, *FAST) == (
        f"evaluate.py: error: --out {model} is a model's folder (it has {has}): "
        "evaluate.py writes only into a new or empty folder, or an evaluation's; pass another --out")
    assert snapshot(model) == before


def test_an_empty_benchmark_list_is_refused_and_keeps_the_results(tmp_path, capsys):
    # D17: at 81f6578 `--benchmarks ,` exited 0 and replaced the model's entry with an empty one.
    run("--model", "toy", "--out", tmp_path, *FAST)
    before = snapshot(tmp_path)
    capsys.readouterr()
    msg = refused(capsys, "--model", "toy", "--benchmarks", " , ", "--out", tmp_path, *FAST)
    assert "--benchmarks ' , ' names no benchmark" in msg
    assert snapshot(tmp_path) == before


def test_probe_data_that_is_all_benchmark_questions_is_one_line(tmp_path, capsys):
    # D25: at 81f6578 "torch.cat(): expected a non-empty list of Tensors".
    q = jsonl(tmp_path / "q.jsonl", toy.dataset("test")[:4])
    fast = [x for x in FAST if x not in ("--confidence", "logits")]
    msg = refused(capsys, "--model", "toy", "--benchmarks", q, "--probe-data", q, "--out", tmp_path / "out",
                  *fast, *PH)
    assert "no fit questions are left" in msg and q in msg


def test_an_evaluation_cut_after_a_batch_draws_only_the_missing_samples(tmp_path):
    out = tmp_path / "e"
    evaluate.main(["--model", "toy", *EVAL, "--out", str(out)])
    path = out / "samples.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2   # 2 questions x 1 sample
    path.write_text(lines[0] + "\n")   # as a cut after the first batch leaves it
    res = evaluate.main(["--model", "toy", *EVAL, "--out", str(out)])["toy"]
    assert res["benchmarks"]["toy"]["n"] == 2 and path.read_text().splitlines() == lines
