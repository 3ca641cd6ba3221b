"""reproduce.py: a tiny end-to-end comparison (and a rerun that redoes nothing), the aggregation on
hand-made results with pinned means and stds, bad flags, and a failed child."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

import reproduce
from runs import ROOT

TRAIN = "--steps 1 --prompts-per-step 4 --group-size 4 --max-new-tokens 40 --eval-n 8 --eval-every 0"
EVAL = "--limit 4 --n-samples 1 --max-new-tokens 64 --probe-questions 4 --probe-samples 2 --posthoc-budgets 2"


def _load(path):
    with open(path) as f:
        return json.load(f)


def _mtimes(root):
    return {os.path.join(d, n): os.stat(os.path.join(d, n)).st_mtime_ns
            for d, _, names in os.walk(root) for n in names}


@pytest.mark.slow   # two trainings and three evaluations
def test_tiny_comparison_writes_the_table_and_a_rerun_redoes_nothing(tmp_path, capsys):
    out = str(tmp_path / "rep")
    argv = ["--methods", "rlcm,grpo", "--seeds", "0", "--jobs", "2", "--out", out,
            "--train-args", TRAIN, "--eval-args", EVAL]
    reproduce.main(argv)
    printed = capsys.readouterr().out
    assert "[4/4]" in printed and "grpo seed 0: trained in" in printed and "rlcm seed 0: evaluated in" in printed
    for name in ("table.md", "results.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    res = _load(os.path.join(out, "results.json"))
    assert list(res["methods"]) == ["grpo", "rlcm"] and res["seeds"] == dict(grpo=[0], rlcm=[0])
    for m in ("grpo", "rlcm"):
        seed = res["methods"][m]["seeds"]["0"]
        ev = _load(os.path.join(out, "eval", f"{m}-seed0", "results.json"))
        assert list(ev) == [f"{m}-seed0/step_000001"] == [seed["model"]]
        assert ev[seed["model"]]["confidence"] == "probe-posthoc"
        for b in reproduce.BENCHMARKS:
            got = ev[seed["model"]]["benchmarks"][b]
            assert got["n"] == 4
            for key in ("acc", "pce", "ece", "brier", "auroc"):   # auroc: None (nan) in both when one class
                assert seed["benchmarks"][b][key] == got[key] == res["methods"][m]["mean"][b][key]
        assert res["methods"][m]["std"]["toy"]["acc"] is None   # one seed: no spread
        run_cfg = _load(os.path.join(out, "runs", f"{m}-seed0", "config.json"))
        assert (run_cfg["reward"], run_cfg["seed"], run_cfg["steps"]) == (m, 0, 1)
    table = open(os.path.join(out, "table.md")).read()
    assert table.index("| GRPO | probe-posthoc |") < table.index("| RLCM | probe-posthoc |")
    assert "+-" not in table.split("| GRPO")[1].splitlines()[0]   # one seed: the mean only
    assert "seeds GRPO: 0; RLCM: 0 " in table and "--methods rlcm,grpo" in table

    before = _mtimes(out + "/runs") | _mtimes(out + "/eval") | _mtimes(out + "/logs")
    reproduce.main(argv)
    printed = capsys.readouterr().out
    assert printed.count("trained already") == 2 and printed.count("evaluated already") == 2
    assert " in " not in printed.split("total")[0]   # nothing trained or evaluated "in N s"
    assert (_mtimes(out + "/runs") | _mtimes(out + "/eval") | _mtimes(out + "/logs")) == before

    run, ev = os.path.join(out, "runs", "grpo-seed0"), os.path.join(out, "eval", "grpo-seed0")
    cmd, train = reproduce.train_cmd("grpo", 0, run), TRAIN.split()
    assert reproduce.training(run, ev, "grpo", 0, train) is None   # made with these settings, at its --steps
    more = TRAIN.replace("--steps 1", "--steps 2").split()
    assert reproduce.training(run, ev, "grpo", 0, more) == ["--resume", run, "--steps", "2", *more]   # continue it
    none = str(tmp_path / "none")
    assert reproduce.training(none, ev, "grpo", 0, train) == [*cmd[:-1], none, *train]


def _fake_run(out, name, step):
    """A run folder with a loadable-looking checkpoint at `step`."""
    run = os.path.join(out, "runs", name)
    ckpt = os.path.join(run, "checkpoints", f"step_{step:06d}")
    os.makedirs(ckpt)
    for path in (os.path.join(run, "config.json"), os.path.join(ckpt, "config.json")):
        with open(path, "w") as f:
            json.dump(dict(steps=step), f)
    save_file({"w": torch.zeros(2)}, os.path.join(ckpt, "model.safetensors"))


def _fake_eval(out, name, label, numbers, n=40, extra=None, per_bench=None):
    """EVAL/results.json with `numbers` on every toy benchmark (per_bench: {benchmark: numbers} instead)."""
    ev = os.path.join(out, "eval", name)
    os.makedirs(ev)
    benches = {b: dict((per_bench or {}).get(b, numbers), n=n) for b in reproduce.BENCHMARKS}
    run = None if name.startswith("base") else os.path.join(out, "runs", name)   # (made by _fake_run first)
    res = {label: dict(confidence="probe-posthoc", benchmarks=benches, model_id=reproduce.model_of(run)[1],
                       settings={b: dict(questions=n, n=1) for b in benches})}
    res.update(extra or {})
    with open(os.path.join(ev, "results.json"), "w") as f:
        json.dump(res, f)


def test_aggregate_pins_mean_and_sample_std(tmp_path):
    out = str(tmp_path)
    m = lambda acc, ece, auroc: dict(acc=acc, pce=0.01, ece=ece, brier=0.2, auroc=auroc)  # noqa: E731
    _fake_eval(out, "base-seed0", "toy", m(0.5, 0.10, 0.6))
    _fake_eval(out, "base-seed1", "toy", m(0.6, 0.20, None))   # nan AUROC (one class) is skipped
    _fake_run(out, "grpo-seed0", 3)
    _fake_run(out, "grpo-seed1", 3)
    stale = {"grpo-seed0/step_000001": dict(benchmarks={b: dict(m(0.0, 0.9, 0.1), n=40) for b in reproduce.BENCHMARKS})}
    _fake_eval(out, "grpo-seed0", "grpo-seed0/step_000003", m(0.7, 0.05, 0.8), extra=stale)
    _fake_eval(out, "grpo-seed1", "grpo-seed1/step_000003", m(0.9, 0.15, 0.6))
    for method in ("rlcr", "final-brier"):
        for seed in (0, 1):
            _fake_run(out, f"{method}-seed{seed}", 2)
            _fake_eval(out, f"{method}-seed{seed}", f"{method}-seed{seed}/step_000002", m(0.3, 0.2, 0.5))

    methods = ["base", "grpo", "rlcr", "final-brier"]
    md = reproduce.write_outputs(out, methods, dict.fromkeys(methods, [0, 1]), ["--seeds", "0,1", "--ablations"])
    res = _load(os.path.join(out, "results.json"))["methods"]
    for part in reproduce.BENCHMARKS + ("Overall",):   # the same numbers on each: so is their mean
        assert res["base"]["mean"][part]["acc"] == pytest.approx(0.55)
        assert res["base"]["std"][part]["acc"] == pytest.approx(math.sqrt(0.005))       # ddof=1: 0.0707
    assert res["base"]["mean"]["toy"]["auroc"] == pytest.approx(0.6) and res["base"]["std"]["toy"]["auroc"] is None
    assert res["grpo"]["mean"]["toy"]["acc"] == pytest.approx(0.8)                    # not the stale step_000001
    assert res["grpo"]["std"]["toy"]["ece"] == pytest.approx(math.sqrt(0.005))
    base = "0.550 +- 0.071 | 0.010 +- 0.000 | 0.150 +- 0.071"   # Acc, PCE, ECE
    assert f"| Base | probe-posthoc | {base} | {base} | {base} | {base} |" in md
    assert "| GRPO | probe-posthoc | 0.800 +- 0.141 |" in md
    assert "| Base | 0.200 +- 0.000 | 0.600 | 0.200 +- 0.000 | 0.600 |" in md   # Brier, AUROC beside
    main, side, ablations = md.split("\n\n")[1:4]   # the main table and its Brier/AUROC one, then the ablations
    assert main.splitlines()[0].startswith("| method | confidence | toy Acc | toy PCE | toy ECE | toy-long Acc |")
    assert main.splitlines()[0].endswith("| Overall Acc | Overall PCE | Overall ECE |")
    assert "| RLCR | verbal | 0.300 +- 0.000 |" in main and "Final-Brier" not in main
    assert ablations.splitlines()[0].startswith("| method | confidence | toy Acc |")
    assert "| Final-Brier | probe-posthoc |" in ablations and "GRPO" not in ablations
    assert reproduce.CONFIDENCE["c2gspg"] == "logits" and reproduce.CONFIDENCE["final-margin"] == "probe-posthoc"
    assert "RLCM - GRPO" not in md   # no RLCM: no paired difference
    assert open(os.path.join(out, "table.md")).read() == md
    assert reproduce.mean_std([0.25]) == (0.25, None) and reproduce.mean_std([None]) == (None, None)


@pytest.mark.parametrize("flags", [["--methods", "grpo,ppo"], ["--methods", ","], ["--seeds", "0,x"],
                                   ["--seeds", "1,1"], ["--seeds", "-1"], ["--jobs", "0"], ["--jobs", "two"],
                                   ["--train-args", "--lr '1"], ["--eval-args", "--limt 4"]])
def test_bad_values_exit_2_with_one_line_and_create_nothing(tmp_path, capsys, flags):
    out = tmp_path / "rep"
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--out", str(out), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("reproduce.py: error: --") and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("flags, said", [
    (["--train-args", "--rew rlcm"], "--train-args --rew rlcm: --reward would make"),
    (["--train-args", "--steps 2 --seed 3"], "--train-args --steps 2 --seed 3: --seed would make"),
    (["--train-args", "--model toy"], "--train-args --model toy: --model would make"),
    (["--train-args", "--out x"], "--train-args --out x: --out would make"),
    (["--train-args", "--config x.json"], "--train-args --config x.json: --config would make"),
    (["--eval-args", "--confidence logits"], "--eval-args --confidence logits: --confidence would make"),
    (["--eval-args", "--seed 0"], "--eval-args --seed 0: --seed would make")])
def test_args_that_set_what_a_row_is_are_refused(tmp_path, capsys, flags, said):
    """A row is its method and seed on the toy in its own folder: --train-args "--reward rlcm" trained
    RLCM under every row's name, exit 0, on af7d60d."""
    out = tmp_path / "rep"
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--out", str(out), *flags])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == (
        f"reproduce.py: error: {said} a row another run than its name says; reproduce.py sets it for each "
        "row: use --methods, --seeds or --out")
    assert not out.exists()


@pytest.mark.slow   # a training and an evaluation
def test_a_failed_child_exits_1_without_a_table_and_others_go_on(tmp_path, capsys):
    out = str(tmp_path / "rep")
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--methods", "base,grpo", "--seeds", "0", "--out", out, "--train-args", "--lr -1",
                        "--eval-args", EVAL])
    assert e.value.code == 1
    printed = capsys.readouterr()
    log = os.path.join(out, "logs", "grpo-seed0.train.log")
    assert "FAILED grpo seed 0: training (exit 2)" in printed.out and log in printed.out
    assert "--lr -1.0: must be > 0" in printed.out          # the log's last lines are shown
    assert "no table written" in printed.err
    assert not os.path.exists(os.path.join(out, "table.md"))
    assert not os.path.exists(os.path.join(out, "eval", "grpo-seed0"))      # its evaluation never ran
    assert "toy" in _load(os.path.join(out, "eval", "base-seed0", "results.json"))   # the base went on


FAST = ["--benchmarks", "toy,toy-long,toy-sub", "--limit", "6", "--n-samples", "2", "--max-new-tokens", "56",
        "--confidence", "logits"]


def retrain_in_place(folder):
    """The model in `folder` replaced by another of the same shapes (its embedding rows reversed), as a
    run deleted and trained again to the same step leaves it."""
    from safetensors.torch import load_file, save_file
    p = os.path.join(folder, "model.safetensors")
    sd = load_file(p)
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].flip(0).contiguous()
    save_file(sd, p, metadata={"format": "pt"})


def test_a_model_trained_again_in_place_is_evaluated_again_not_given_the_old_samples(tmp_path, capsys):
    # H7: at a7c59f5 a model was its path: the second evaluation into E printed the first model's
    # numbers (all its samples reused), and reproduce.py's eval_entry called it "evaluated already".
    import evaluate
    import toy
    model = str(tmp_path / "model")
    shutil.copytree(toy.BASE_DIR, model)
    first = evaluate.main(["--model", model, "--out", str(tmp_path / "e"), *FAST])["model"]
    assert reproduce.eval_entry(str(tmp_path / "e"), "model", evaluate.model_id(model))["model_id"] == first["model_id"]
    retrain_in_place(model)
    capsys.readouterr()
    again = evaluate.main(["--model", model, "--out", str(tmp_path / "e"), *FAST])
    assert "is of the model that was in" in capsys.readouterr().err
    fresh = evaluate.main(["--model", model, "--out", str(tmp_path / "e2"), *FAST])["model"]
    assert list(again) == ["model"] and again["model"]["benchmarks"] == fresh["benchmarks"]
    assert fresh["benchmarks"]["toy"]["acc"] != first["benchmarks"]["toy"]["acc"]
    assert again["model"]["model_id"] != first["model_id"] and again["model"]["model_id"].startswith(
        os.path.realpath(model) + "#")
    assert reproduce.eval_entry(str(tmp_path / "e"), "model", first["model_id"]) is None   # the old model's: gone


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """(out, argv) of a finished tiny reproduction of the base and GRPO, seed 0."""
    out = str(tmp_path_factory.mktemp("rep") / "rep")
    argv = ["--methods", "base,grpo", "--seeds", "0", "--out", out, "--train-args", TRAIN, "--eval-args", EVAL]
    reproduce.main(argv)
    return out, argv


def _exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        reproduce.main(argv)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return e.value.code, err


@pytest.mark.slow   # the `done` reproduction
def test_a_run_made_with_other_settings_is_refused_not_reused(done, capsys):
    out, argv = done
    capsys.readouterr()
    before = _mtimes(out)
    plain = TRAIN.replace(" --eval-every 0", "")   # as a plain run: the toy's default --eval-every 10
    code, err = _exit(argv[:-4] + ["--train-args", plain, "--eval-args", EVAL], capsys)
    run = os.path.join(out, "runs", "grpo-seed0")
    assert code == 2 and f"{run} was trained with other settings: --eval-every 0 (this command: 10)" in err
    assert os.path.join(out, "eval", "grpo-seed0") in err
    code, err = _exit(argv[:-4] + ["--eval-args", EVAL], capsys)   # the smoke test's 1 step, a plain 45
    assert code == 2 and "--prompts-per-step 4 (this command: 16)" in err
    assert _mtimes(out) == before   # refused before anything ran


def _base_entry(out):
    path = os.path.join(out, "eval", "base-seed0", "results.json")
    return path, _load(path)


@pytest.mark.slow   # the `done` reproduction, three evaluations
def test_an_evaluation_made_with_other_settings_is_redone(done, capsys):
    out, argv = done
    base = ["--methods", "base", "--seeds", "0", "--out", out]
    reproduce.main(base + ["--eval-args", EVAL + " --n-samples 2"])
    printed = capsys.readouterr().out
    assert "base seed 0: evaluated in" in printed and "evaluated already" not in printed
    assert _base_entry(out)[1]["toy"]["benchmarks"]["toy"]["n"] == 8   # 4 questions x 2
    reproduce.main(base + ["--eval-args", EVAL])                       # and back: 1 sample each
    assert "base seed 0: evaluated in" in capsys.readouterr().out
    assert _base_entry(out)[1]["toy"]["benchmarks"]["toy"]["n"] == 4
    reproduce.main(base + ["--eval-args", EVAL])
    assert "base seed 0: evaluated already" in capsys.readouterr().out


POISON = "--lr -1"   # were the flags below passed on, the child would fail at once


def test_an_ambiguous_abbreviation_in_the_train_args_is_refused_in_one_line(tmp_path, capsys):
    """--grad could be --grader, --grad-clip or --grad-ckpt: refused before anything runs, like a
    named flag."""
    out = tmp_path / "rep"
    code, err = _exit(["--methods", "grpo", "--seeds", "0", "--out", str(out), "--train-args",
                       f"{POISON} --grad 1"], capsys)
    assert code == 2 and not out.exists()
    assert "ambiguous option: --grad could match --grader, --grad-clip, --grad-ckpt" in err


@pytest.mark.parametrize("flags", [["--jobs", "²"], ["--train-args", "--steps ²"]])
def test_superscript_numbers_are_one_line(tmp_path, capsys, flags):
    out = tmp_path / "rep"
    code, err = _exit(["--methods", "grpo", "--seeds", "0", "--out", str(out), *flags], capsys)
    assert code == 2 and "²" in err and not out.exists()


def test_an_evaluation_made_with_reordered_flags_counts_as_made_with_them(tmp_path):
    args, _, _, jobs = reproduce.parse_args(["--methods", "grpo", "--seeds", "3", "--out", str(tmp_path / "r"),
                                             "--train-args", "--lr 2e-5 --steps 1", "--eval-args=--limit=3"])
    assert args.train_args == ["--lr", "2e-5", "--steps", "1"] and args.eval_args == ["--limit=3"] and jobs == 2
    ev = str(tmp_path / "ev")
    entry = dict(provenance=dict(command=f"evaluate.py --limit 4 --model toy --out {ev} --seed 1 --benchmarks toy,toy-long,toy-sub "
                                         "--confidence logits --no-early-exit"))
    cmd = reproduce.eval_cmd("c2gspg", 1, None, ev)
    assert reproduce.made_with(entry, cmd + ["--limit", "4"]) and not reproduce.made_with(entry, cmd)
    assert not reproduce.made_with({}, cmd)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow   # reproduce.py in a subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_reproduce_kills_its_children(tmp_path, sig):
    """reproduce.py with its train.py replaced by one that sleeps: killed, it leaves no child running."""
    fake = tmp_path / "fake"
    fake.mkdir()
    pid_file = fake / "child.pid"
    (fake / "train.py").write_text(
        "import os, time\n"
        f"open({str(pid_file) + '.tmp'!r}, 'w').write(str(os.getpid()))\n"
        f"os.replace({str(pid_file) + '.tmp'!r}, {str(pid_file)!r})\n"
        "time.sleep(120)\n")
    code = "import sys, reproduce; reproduce.ROOT = sys.argv[1]; reproduce.main(sys.argv[2:])"
    parent = subprocess.Popen([sys.executable, "-c", code, str(fake), "--methods", "grpo", "--seeds", "0",
                               "--out", str(tmp_path / "rep")], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT))
    child = None
    try:
        deadline = time.time() + 120
        while not pid_file.exists():
            assert parent.poll() is None and time.time() < deadline, parent.stderr.read()
            time.sleep(0.2)
        child = int(pid_file.read_text())
        parent.send_signal(sig)
        parent.wait(30)
        deadline = time.time() + 10
        while _alive(child) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(child)   # at 81f6578: still sleeping, re-parented
        if sig == signal.SIGTERM:
            assert parent.returncode == 130
            assert "run the same command again" in parent.stderr.read().decode()
    finally:
        if parent.poll() is None:
            parent.kill()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
