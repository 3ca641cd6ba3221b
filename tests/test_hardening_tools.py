"""Red team 2, the tools: reproduce.py decides "done" from the arguments a run or evaluation was made
with and refuses extra arguments that would relabel a row (D4, D7), its children die with it (D10),
bad --jobs and damaged result entries (D21); study/bench.py's flag checks (D20); the curves plot reads a
damaged metrics.jsonl (D18)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from study import bench
import reproduce
from study import comparison
from harness import runlog
import train
from harness.files import UserError
from test_reproduce import EVAL, TRAIN, _load, _mtimes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    plain = TRAIN.replace(" --log-samples 0", "")   # as a plain run: the default --log-samples 4
    code, err = _exit(argv[:-4] + ["--train-args", plain, "--eval-args", EVAL], capsys)
    run = os.path.join(out, "runs", "grpo-seed0")
    assert code == 2 and f"{run} was trained with other settings: --log-samples 0 (this command: 4)" in err
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


@pytest.mark.slow   # the `done` reproduction
@pytest.mark.parametrize("damage", ["missing pce", "acc a string"])
def test_a_damaged_entry_is_evaluated_again(done, capsys, damage):
    out, argv = done
    path, res = _base_entry(out)
    toy = res["toy"]["benchmarks"]["toy"]
    good = dict(toy)
    if damage == "missing pce":
        del toy["pce"]
    else:
        toy["acc"] = str(toy["acc"])
    with open(path, "w") as f:
        json.dump(res, f)
    assert comparison.eval_entry(os.path.dirname(path), "toy", comparison.model_of(None)[1]) is None
    with pytest.raises(UserError, match=f"{path} holds no complete toy results for toy: run the command again"):
        comparison.aggregate(out, ["base"], {"base": [0]})
    reproduce.main(argv)   # at 81f6578: a KeyError traceback / a FAILED line that no rerun clears
    printed = capsys.readouterr().out
    assert "base seed 0: evaluated in" in printed and "grpo seed 0: evaluated already" in printed
    assert _base_entry(out)[1]["toy"]["benchmarks"]["toy"]["acc"] == good["acc"]
    assert comparison.aggregate(out, ["base"], {"base": [0]})["base"]["mean"]["toy"]["pce"] == good["pce"]


POISON = "--lr -1"   # at 81f6578 the flags below are passed on: this makes the child fail at once


@pytest.mark.parametrize("methods,flags,named", [
    ("grpo", ["--train-args", f"{POISON} --reward rlcm"], "--reward"),
    ("grpo", ["--seeds", "0,1", "--train-args", f"{POISON} --see 0"], "--seed"),  # argparse's abbreviation (of --reward every one is ambiguous: --reward-fn)
    ("grpo", ["--seeds", "0,1", "--train-args", f"{POISON} --seed 0"], "--seed"),  # seed 1's is overridden
    ("grpo", ["--train-args", f"{POISON} --out elsewhere"], "--out"),
    ("grpo", ["--train-args", f"{POISON} --resume elsewhere"], "--resume"),
    ("base", ["--eval-args", "--limit 0 --confidence logits"], "--confidence"),
    ("base", ["--eval-args", "--limit 0 --seed 5"], "--seed"),
    ("base", ["--eval-args", "--limit 0 --benchmarks math500"], "--benchmarks"),
    ("base", ["--eval-args", "--limit 0 --model other"], "--model"),
])
def test_args_that_change_a_methods_reward_seed_confidence_or_folder_are_refused(tmp_path, capsys, methods,
                                                                                 flags, named):
    out = tmp_path / "rep"
    code, err = _exit(["--methods", methods, "--seeds", "0", "--out", str(out), *flags], capsys)
    assert code == 2 and f"{named} is reproduce.py's to set for each method and seed" in err
    assert err.startswith("reproduce.py: error: --")
    assert not out.exists()


def test_an_ambiguous_abbreviation_in_the_train_args_is_refused_in_one_line(tmp_path, capsys):
    """--rew could be --reward or --reward-fn: refused before anything runs, like a named flag."""
    out = tmp_path / "rep"
    code, err = _exit(["--methods", "grpo", "--seeds", "0", "--out", str(out), "--train-args",
                       f"{POISON} --rew rlcm"], capsys)
    assert code == 2 and "ambiguous option: --rew could match --reward, --reward-fn" in err and not out.exists()


@pytest.mark.parametrize("flags", [["--jobs", "²"], ["--train-args", "--steps ²"]])
def test_superscript_numbers_are_one_line(tmp_path, capsys, flags):
    out = tmp_path / "rep"
    code, err = _exit(["--methods", "grpo", "--seeds", "0", "--out", str(out), *flags], capsys)
    assert code == 2 and "²" in err and not out.exists()


def test_an_equal_seed_and_reordered_flags_are_not_refused(tmp_path):
    args, _, _, jobs = reproduce.parse_args(["--methods", "grpo", "--seeds", "3", "--out", str(tmp_path / "r"),
                                             "--train-args", "--seed 3 --steps 1", "--eval-args=--seed=3"])
    assert args.train_args == ["--seed", "3", "--steps", "1"] and jobs == 2
    ev = str(tmp_path / "ev")
    entry = dict(provenance=dict(command=f"evaluate.py --limit 4 --model toy --out {ev} --seed 1 --benchmarks toy,toy-long,toy-sub "
                                         "--confidence logits --no-early-exit"))
    cmd = reproduce.eval_cmd("c2gspg", 1, None, ev)
    assert comparison.made_with(entry, cmd + ["--limit", "4"]) and not comparison.made_with(entry, cmd)
    assert not comparison.made_with({}, cmd)


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


METRICS = json.dumps(dict(step=1, reward=0.5, accuracy=0.25, len_mean=30)) + "\n"


@pytest.mark.parametrize("tail,lines,values", [
    ('{"step": 2, "rew', 1, 0),                                  # a kill mid-write
    ("[1, 2, 3]\n", 1, 0),                                      # not an object
    ('{"step": 2, "reward": Infinity, "accuracy": NaN}\n', 0, 2),
    ('{"step": 2, "reward": "0.7", "len_mean": [3]}\n{"step": "3", "reward": 1}\n', 1, 2),
])
def test_the_plot_skips_what_it_cannot_draw_and_says_so(tmp_path, capsys, tail, lines, values):
    path = tmp_path / "metrics.jsonl"
    path.write_text(METRICS + tail)
    train.main(["--plot", str(tmp_path)])
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "curves.png") and os.path.getsize(out.strip()) > 0
    assert err.strip() == (f"{path}: skipped {lines} line(s) that are not rows and {values} value(s) that are "
                           "not finite numbers")
    assert path.read_text() == METRICS + tail   # only read
    assert runlog.read_metrics(str(path))[0] == dict(step=1, reward=0.5, accuracy=0.25, len_mean=30)


@pytest.mark.parametrize("flags,line", [
    (["--prompts", "0"], "--prompts 0: must be >= 1"),
    (["--samples", "-1"], "--samples -1: must be >= 1"),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--repeat", "0"], "--repeat 0: must be >= 1"),
    (["--device", "cuda:99"], "--device cuda:99: this torch build and machine show"),
    (["--device", "gpu"], "--device gpu: not a device"),
])
def test_bench_checks_its_flags_before_loading_anything(flags, line):
    with pytest.raises(UserError) as e:
        bench.main(flags)
    assert str(e.value).startswith(line)


@pytest.mark.slow   # study/bench.py in a subprocess
def test_bench_flag_error_is_one_line_exit_2():
    p = subprocess.run([sys.executable, "-m", "study.bench", "--repeat", "0"], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.strip() == "error: --repeat 0: must be >= 1"
