"""harness/files.py on folders someone else may have prepared: one writer per folder (a live lock
refuses, a stale one is taken over), files written whole, and a full disk in one line."""
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager

import pytest

import config
import evaluate
import toy
import train
from evaluation import report
from harness import checkpoint, files
from runs import (ENV, EVAL_SMALL, ROOT, SMALL, ckpt, file_size_limit, jsonl, metric_rows, one_line,
                  snapshot, write)


@contextmanager
def lock_holder(folder):
    """Another live process holding FOLDER's lock."""
    code = "import sys, time\nfrom harness import files\nwith files.locked(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(300)\n"
    p = subprocess.Popen([sys.executable, "-c", code, folder], cwd=ROOT, env=ENV, stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"held"
        yield p
    finally:
        p.kill()
        p.wait()


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_second_writer_on_a_run_folder_exits_2_and_changes_nothing(run_copy, capsys):
    with lock_holder(run_copy) as holder:
        before = snapshot(run_copy)
        for argv in (["--resume", run_copy, "--steps", "3"], ["--out", run_copy, "--steps", "1", *SMALL]):
            with pytest.raises(SystemExit) as e:
                train.main(argv)
            assert e.value.code == 2
            err = one_line(capsys)
            assert f"in use by pid {holder.pid} on " in err and run_copy in err
            assert snapshot(run_copy) == before


def test_stale_run_lock_is_taken_over(run_copy, capsys):
    with open(os.path.join(run_copy, files.LOCK), "w") as f:
        json.dump(dict(pid=dead_pid(), host="h", since="x"), f)
    train.main(["--resume", run_copy, "--steps", "3"])
    assert "taking over the stale lock of pid" in capsys.readouterr().err
    assert [r["step"] for r in metric_rows(run_copy) if not r.get("eval")] == [1, 2, 3]
    assert not os.path.exists(os.path.join(run_copy, files.LOCK))   # released at the end


def test_second_writer_on_an_eval_folder_exits_2_and_stale_lock_is_taken_over(tmp_path, capsys):
    out = str(tmp_path / "eval")
    evaluate.main(["--model", "toy", "--out", out, *EVAL_SMALL])
    capsys.readouterr()
    with lock_holder(out) as holder:
        before = snapshot(out)
        with pytest.raises(SystemExit) as e:
            evaluate.main(["--model", "toy", "--out", out, *EVAL_SMALL, "--seed", "1"])
        assert e.value.code == 2
        err = one_line(capsys)
        assert f"in use by pid {holder.pid}" in err and snapshot(out) == before
    with open(os.path.join(out, files.LOCK), "w") as f:
        json.dump(dict(pid=dead_pid(), host="h", since="x"), f)
    with open(os.path.join(out, "samples.jsonl"), "a") as f:
        f.write('{"model": "toy", "bench')   # a kill in the middle of a row
    evaluate.main(["--model", "toy", "--out", out, *EVAL_SMALL])
    err = capsys.readouterr().err
    assert "taking over the stale lock" in err and "dropped a cut-off last line" in err
    assert len(evaluate.read_samples(os.path.join(out, "samples.jsonl"))) == 2


def victim(path, text="precious\n"):
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def read(path):
    with open(path) as f:
        return f.read()


def test_resume_writes_nothing_through_links_planted_at_temporary_names(run_copy, tmp_path):
    names = ["metrics.jsonl.tmp", "config.json.tmp", "samples.jsonl.tmp", "curves.png.tmp"]
    for n in names:
        os.symlink(victim(tmp_path / f"victim_{n}"), os.path.join(run_copy, n))
    os.makedirs(tmp_path / "victim_dir")
    victim(tmp_path / "victim_dir" / "keep.txt")
    os.symlink(tmp_path / "victim_dir", ckpt(run_copy, 3) + ".tmp")   # the old fixed name of step 3's folder
    train.main(["--resume", run_copy, "--steps", "3"])
    assert all(read(tmp_path / f"victim_{n}") == "precious\n" for n in names)
    assert os.listdir(tmp_path / "victim_dir") == ["keep.txt"]
    assert [r["step"] for r in metric_rows(run_copy) if not r.get("eval")] == [1, 2, 3]
    assert checkpoint.missing(ckpt(run_copy, 3), resume=True) == []


def test_evaluate_replaces_links_it_rewrites(tmp_path):
    out = tmp_path / "eval"
    os.makedirs(out)
    planted = ["results.json.tmp", "reliability_toy_toy.png"]
    for n in planted:
        os.symlink(victim(tmp_path / f"victim_{n}"), out / n)
    evaluate.main(["--model", "toy", "--out", str(out), *EVAL_SMALL, "--confidence", "logits"])
    assert all(read(tmp_path / f"victim_{n}") == "precious\n" for n in planted)
    assert not os.path.islink(out / "reliability_toy_toy.png") and os.path.getsize(out / "reliability_toy_toy.png") > 0


def test_a_full_disk_while_plotting_keeps_the_old_png(tmp_path):
    rel = [dict(lo=i / 10, hi=(i + 1) / 10, accuracy=0.5, count=3) for i in range(10)]
    path = str(tmp_path / "reliability.png")
    report.plot_reliability(rel, "t", path)
    old = open(path, "rb").read()
    with file_size_limit(len(old) // 4), pytest.raises(files.UserError, match="cannot write .*reliability.png"):
        report.plot_reliability(rel, "t2", path)
    assert open(path, "rb").read() == old and os.listdir(tmp_path) == ["reliability.png"]


NOT_RUNS = {   # red team 5, cases 3 and 4: train.py took each for a new run and wrote over its files
    "evaluation": ("is an evaluation's folder (it has samples.jsonl, results.json)", lambda out: [
        jsonl(out / "samples.jsonl", [dict(model="toy", benchmark="toy", question=0, sample=0, correct=1,
                                           confidence=0.5)]), write(out / "results.json", "{}")]),
    "model": ("is a model's folder (it has config.json, model.safetensors)",
              lambda out: shutil.copytree(toy.BASE_DIR, out, dirs_exist_ok=True)),
    "notes": ("holds files and is no training run's folder (it has notes.txt)",
              lambda out: write(out / "notes.txt", "x")),
}


@pytest.mark.parametrize("kind", NOT_RUNS)
def test_train_refuses_an_out_that_is_no_run_in_one_line_and_leaves_its_files(kind, tmp_path, capsys):
    says, make = NOT_RUNS[kind]
    out = tmp_path / "out"
    os.makedirs(out)
    make(out)
    before = snapshot(out)
    model = str(out) if kind == "model" else "toy"   # --model DIR --out DIR: the model's own folder
    with pytest.raises(SystemExit) as e:
        train.main(["--model", model, "--steps", "1", "--out", str(out), *SMALL])
    assert e.value.code == 2 and one_line(capsys) == (
        f"error: --out {out} {says}: train.py writes only into a new or empty folder (or resumes a run "
        "there); pass another --out")
    assert snapshot(out) == before


def test_train_takes_an_empty_folder_one_with_a_stale_lock_and_its_own_run(run_copy, tmp_path):
    os.makedirs(tmp_path / "empty")
    write(tmp_path / "empty" / files.LOCK, "")   # a run killed as it began leaves its lock
    for out in (str(tmp_path / "empty"), run_copy):   # its own run: RunFolder asks for --resume
        assert config.resolve_args(["--out", out])["out"] == out
