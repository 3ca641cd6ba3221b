"""What a run leaves around the loop: samples, held-out probe calibration, curves, prompts and
configs as data, and results.json provenance and intervals."""
import json
import math
import os

import numpy as np
import pytest

import evaluate
import grade
import metrics
import data
from harness import files, runlog
import toy
import train
from config import resolve_args
from runs import PROBE_SMALL
from test_train import SMALL, rows

K = 4


def run_main(argv):
    train.main(argv)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("runs") / "x")
    run_main(["--steps", "2", "--out", out, *SMALL, "--eval-every", "1"])
    return out


def test_samples_hold_four_trajectories_per_step_with_labels_and_confidences(run):
    samples = files.read_jsonl(os.path.join(run, "samples.jsonl"))
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4
    for s in samples:
        assert {"problem", "answer", "text", "correct", "reward", "margin", "cuts", "Y_b", "C_b"} <= set(s)
        assert s["text"] and s["cuts"] == sorted(s["cuts"]) and len(s["cuts"]) >= 1
        assert len(s["Y_b"]) == len(s["C_b"]) == len(s["cuts"])
        assert all(y in (0, 0.25, 0.5, 0.75, 1) for y in s["Y_b"]) and all(0 < c < 1 for c in s["C_b"])
        assert s["correct"] == float(grade.is_correct(s["text"], s["answer"]))
        # reward = r_nat + lam * margin with the toy's default lam 1
        assert s["reward"] == pytest.approx(2 * s["correct"] - 1 + 1.0 * s["margin"], abs=2e-4)
    # Spread over the batch: one from each of the step's 4 groups, not the first group twice.
    assert len({s["problem"] for s in samples[:4]}) == 4


def test_held_out_rows_carry_the_probe_calibration_of_the_logged_prefixes(run):
    evals = [r for r in rows(run) if r.get("eval")]
    held = files.read_jsonl(os.path.join(run, "heldout.jsonl"))
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:
        mine = [t for t in held if t["step"] == r["step"]]
        assert len(mine) == 8  # --eval-n 8 < the 32 the check labels
        Y = np.array([y for t in mine for y in t["Y_b"]])
        C = np.array([c for t in mine for c in t["C_b"]])
        assert r["eval_probe_prefixes"] == len(Y) >= 8
        assert r["eval_probe_ece"] == pytest.approx(metrics.ece(C, Y))
        bce = -np.mean(Y * np.log(C) + (1 - Y) * np.log(1 - C))
        assert r["eval_probe_bce"] == pytest.approx(bce)
        # AUROC over the K forced answers of every prefix: K * Y_b right ones, all with that prefix's C_b.
        conf = np.concatenate([[c] * K for c in C])
        right = np.concatenate([[1] * round(y * K) + [0] * (K - round(y * K)) for y in Y])
        want = metrics.auroc(conf, right)
        got = r["eval_probe_auroc"]
        assert got == pytest.approx(want) or (math.isnan(want) and math.isnan(got))
        assert r["eval_margin"] == pytest.approx(np.mean([t["margin"] for t in mine]))
    # The probe is trained between the checks, so its held-out numbers move. (Not necessarily down: after
    # two steps of 16 samples its held-out BCE read 0.724 -> 0.749; tests/test_probe.py tests the fit.)
    assert evals[-1]["eval_probe_bce"] != evals[0]["eval_probe_bce"]
    steps = [r for r in rows(run) if not r.get("eval")]
    assert all("probe_bce" in r and "probe_ece" in r for r in steps)  # the in-sample numbers stay


def test_curves_png_after_a_run(run):
    png = os.path.join(run, "curves.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 20000


def test_config_file_reproduces_a_run_except_steps_and_out(run, tmp_path):
    out = str(tmp_path / "y")
    run_main(["--config", os.path.join(run, "config.json"), "--steps", "1", "--out", out])
    a, b = (json.load(open(os.path.join(d, "config.json"))) for d in (run, out))
    differ = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    assert differ == {"steps", "out", "config", "provenance"} and b["steps"] == 1 and b["out"] == out
    assert b["prompts_per_step"] == 4  # not the default 16
    cfg = resolve_args(["--config", os.path.join(run, "config.json"), "--group-size", "2"])
    assert cfg["group_size"] == 2 and cfg["out"] == os.path.join("runs", "toy")  # a flag wins; x's --out is not reused
    with pytest.raises(train.UserError, match="no run.s config.json there"):
        resolve_args(["--config", str(tmp_path / "nope.json")])


def test_instruction_changes_the_prompt_and_evaluate_reuses_it(tmp_path, monkeypatch):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy.BASE_DIR)
    plain, marked = data.chat_prompt(tok, "1+2", ""), data.chat_prompt(tok, "1+2", " =")
    assert len(marked) > len(plain) and tok.decode(marked).replace(" =", "", 1) == tok.decode(plain)
    seen = []
    real = data.chat_prompt
    spy = lambda t, p, i=data.INSTRUCTION, s=None: seen.append((i, s)) or real(t, p, i, s)  # noqa: E731
    monkeypatch.setattr(data, "chat_prompt", spy)   # which data.row_prompt calls for every plain row
    out = str(tmp_path / "r")
    run_main(["--steps", "1", "--out", out, "--instruction", " =", *SMALL])
    assert json.load(open(os.path.join(out, "config.json")))["instruction"] == " ="
    assert seen and set(seen) == {(" =", None)}
    seen.clear()
    fast = ["--benchmarks", "toy", "--limit", "3", "--n-samples", "2", "--max-new-tokens", "16",
            *PROBE_SMALL]   # the post-hoc probe's prompts take the instruction too
    res = evaluate.main(["--model", out, "--out", str(tmp_path / "e"), *fast])
    assert set(seen) == {(" =", None)}
    (label,) = res
    assert res[label]["settings"]["toy"]["instruction"] == " ="
    seen.clear()
    evaluate.main(["--model", out, "--out", str(tmp_path / "e2"), "--instruction", "", *fast])
    assert set(seen) == {("", None)}
    with pytest.raises(SystemExit) as e:  # the toy chat template has no system turn: say so, not ignore it
        run_main(["--steps", "1", "--out", str(tmp_path / "s"), "--system-prompt", "be brief", *SMALL])
    assert e.value.code == 2


def test_results_json_holds_provenance_and_intervals(run, tmp_path, capsys):
    out = str(tmp_path / "e")
    evaluate.main(["--model", run, "--benchmarks", "toy", "--limit", "10", "--n-samples", "2",
                   "--max-new-tokens", "48", *PROBE_SMALL, "--out", out])
    printed = capsys.readouterr().out
    saved = json.load(open(os.path.join(out, "results.json")))
    (res,) = saved.values()
    prov = res["provenance"]
    assert set(prov) >= {"git_commit", "torch", "transformers", "date", "command", "device"}
    assert prov["git_commit"] == "unknown" or len(prov["git_commit"].split("+")[0]) == 40
    assert prov["command"].startswith("evaluate.py --model ") and prov["device"] == "cpu"
    b = res["benchmarks"]["toy"]
    for key in ("acc", "ece", "pce"):
        ci = b["ci95"][key]
        assert ci["lo"] <= b[key] <= ci["hi"] and ci["pm"] >= 0
        assert f"{b[key]:.3f} +- {ci['pm']:.3f}" in printed
    want = metrics.bootstrap([0.5], [1.0], [0])  # a single question: no spread
    assert want["acc"]["pm"] == 0.0


def test_clip_and_pick():
    text = "a" * 1500 + "b" * 1500
    c = runlog.clip(text, 1000)
    assert c.startswith("a" * 500) and c.endswith("b" * 500) and "[... 2000 characters cut ...]" in c
    assert runlog.clip("short") == "short" and len(runlog.clip("x" * 50000)) < runlog.TEXT_CHARS + 50
    got = runlog.pick(7, 3, text=list("abcdefghij"), y=[[i / 3] for i in range(10)])
    assert [r["text"] for r in got] == ["a", "e", "j"] and got[1]["y"] == [1.3333] and got[0]["step"] == 7
    assert runlog.pick(7, 0, text=["a"]) == [] and len(runlog.pick(1, 5, text=["a", "b"])) == 2


def test_evaluating_fewer_benchmarks_keeps_the_others_in_results_json(tmp_path, capsys):
    out = str(tmp_path / "e")
    argv = ["--model", "toy", "--limit", "3", "--n-samples", "1", "--max-new-tokens", "24", "--confidence",
            "logits", "--out", out]
    evaluate.main(argv + ["--benchmarks", "toy,toy-long"])
    first = json.load(open(os.path.join(out, "results.json")))["toy"]
    capsys.readouterr()
    evaluate.main(argv + ["--benchmarks", "toy", "--seed", "1"])   # other samples of toy
    printed = capsys.readouterr()
    assert "keeps toy's earlier toy-long beside these" in printed.err
    now = json.load(open(os.path.join(out, "results.json")))["toy"]
    # red team 5, case 14: that Overall averages toy-long at seed 0 with toy at seed 1, and says so
    assert now["mixed_settings"] == {"toy-long": {"seed": [0, 1]}}
    assert ("\n* mixed settings: results.json's Overall for toy also averages toy-long, evaluated earlier "
            "with seed 0 (here 1)\n") in printed.out
    assert list(now["benchmarks"]) == ["toy-long", "toy"] and now["settings"]["toy"]["seed"] == 1
    assert now["benchmarks"]["toy-long"] == first["benchmarks"]["toy-long"]
    assert now["settings"]["toy-long"] == first["settings"]["toy-long"]
    accs = [now["benchmarks"][b]["acc"] for b in ("toy", "toy-long")]
    assert now["overall"]["acc"] == pytest.approx(sum(accs) / 2) and now["math"] == now["overall"]
    evaluate.main(argv + ["--benchmarks", "toy-long", "--seed", "1"])   # toy's seed: one protocol again
    assert "mixed settings" not in capsys.readouterr().out
    assert "mixed_settings" not in json.load(open(os.path.join(out, "results.json")))["toy"]
    # another confidence (or model, or post-hoc probe) replaces the entry: its numbers are of another reading
    from evaluation import report
    assert report.write_results(out, "toy", dict(now, confidence="verbal", benchmarks={"toy": now["benchmarks"]["toy"]},
                                                 settings={})) == ([], {})
    assert list(json.load(open(os.path.join(out, "results.json")))["toy"]["benchmarks"]) == ["toy"]


METRICS = json.dumps(dict(step=1, reward=0.5, accuracy=0.25, len_mean=30)) + "\n"


def test_the_plot_skips_a_line_cut_off_by_a_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(METRICS + '{"step": 2, "rew')
    png = runlog.plot_curves(str(tmp_path))
    assert png == str(tmp_path / "curves.png") and os.path.getsize(png) > 0
    assert path.read_text() == METRICS   # the cut line dropped, as every log we append to


def test_the_probe_panel_says_which_way_each_metric_is_better(tmp_path, monkeypatch):
    """ECE (lower is better) and AUROC (higher is better) share an axis: each line's label says so."""
    import matplotlib.pyplot as plt
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure plot_curves drew
    rows = [dict(step=s, probe_ece=0.2, eval=1, eval_probe_ece=0.1, eval_probe_auroc=0.7) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runlog.plot_curves(str(tmp_path))
    ax = next(ax for ax in figs[0].axes if ax.get_title() == "probe calibration")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["probe_ece (in-sample; lower is better)", "eval_probe_ece (lower is better)",
                      "eval_probe_auroc (higher is better)"]
    monkeypatch.undo()
    plt.close(figs[0])
