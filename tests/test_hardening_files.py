"""Checkpoints and files in folders someone else may have prepared: pruning that never takes a good
checkpoint for a damaged or newer one, checkpoint folders that must be what their name says, writes
that never follow a planted link, and a full disk or a checkpoint pruned mid-load that end in one line."""
import os
import resource
import shutil
from contextlib import contextmanager

import pytest
import torch
import transformers

from harness import checkpoint, files, models
import evaluate
from evaluation import report
import train
from test_hardening import EVAL_SMALL, base_run, metric_rows, one_line, run_copy  # noqa: F401 (fixtures)
from test_train import SMALL


def ckpt(run, step):
    return os.path.join(run, "checkpoints", f"step_{step:06d}")


def victim(path, text="precious\n"):
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def read(path):
    with open(path) as f:
        return f.read()


@contextmanager
def file_size_limit(n):
    """Writes past n bytes in any file fail with EFBIG (Python ignores SIGXFSZ), like a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# ---- D1: pruning counts only complete checkpoints at or below the step just saved

def test_resume_with_keep_1_beside_a_damaged_newer_checkpoint_keeps_the_new_good_one(run_copy, capsys):
    os.rename(ckpt(run_copy, 2), ckpt(run_copy, 3))
    os.truncate(os.path.join(ckpt(run_copy, 3), "model.safetensors"), 1000)
    train.main(["--resume", run_copy, "--steps", "2", "--keep", "1"])
    out = capsys.readouterr().out
    assert "from step 1" in out and f"(latest checkpoint: {ckpt(run_copy, 2)})" in out
    # step 1 pruned (one complete one is kept); the damaged step 3 is not counted and not removed
    assert sorted(os.listdir(os.path.join(run_copy, "checkpoints"))) == ["step_000002", "step_000003"]
    assert checkpoint.latest_checkpoint(run_copy, resume=True) == ckpt(run_copy, 2)


# ---- D24: a checkpoint folder must be the run's own and hold the step its name says

@pytest.mark.parametrize("case", ["link to another run's checkpoint", "state.pt of another step"])
def test_a_checkpoint_folder_that_is_a_link_or_misnamed_is_skipped(case, base_run, run_copy):
    if case.startswith("link"):
        os.symlink(ckpt(base_run, 1), ckpt(run_copy, 5))
        words = "missing a folder of its own (it is a link)"
    else:
        shutil.copytree(ckpt(run_copy, 1), ckpt(run_copy, 5))
        words = "missing state.pt of step 5 (it holds step 1)"
    said = []
    assert checkpoint.latest_checkpoint(run_copy, say=said.append, resume=True) == ckpt(run_copy, 2)
    assert said == [f"skipping incomplete checkpoint {ckpt(run_copy, 5)}: {words}"]


def test_resume_beside_a_linked_checkpoint_neither_follows_nor_prunes_it(base_run, run_copy, capsys):
    os.symlink(ckpt(base_run, 1), ckpt(run_copy, 5))
    train.main(["--resume", run_copy, "--steps", "3", "--keep", "1"])
    assert "from step 2" in capsys.readouterr().out
    assert sorted(os.listdir(os.path.join(run_copy, "checkpoints"))) == ["step_000003", "step_000005"]
    assert os.path.islink(ckpt(run_copy, 5)) and checkpoint.missing(ckpt(base_run, 1), resume=True) == []


# ---- D2: no write follows a link planted in a run or an evaluation folder

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


def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(run_copy, tmp_path, capsys):
    os.symlink(victim(tmp_path / "v.txt"), os.path.join(run_copy, files.LOCK))
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", run_copy, "--steps", "3"])
    err = one_line(capsys)
    assert e.value.code == 2 and "lock is a symbolic link" in err, err
    assert read(tmp_path / "v.txt") == "precious\n"
    out = tmp_path / "eval"
    os.makedirs(out)
    os.symlink(tmp_path / "v.txt", out / files.LOCK)
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", "toy", "--out", str(out), *EVAL_SMALL, "--confidence", "logits"])
    assert "lock is a symbolic link" in str(e.value.code) and read(tmp_path / "v.txt") == "precious\n"


def test_evaluate_replaces_links_it_rewrites_and_refuses_one_it_would_append_through(tmp_path):
    out = tmp_path / "eval"
    os.makedirs(out)
    planted = ["results.json.tmp", "reliability_toy_toy.png"]
    for n in planted:
        os.symlink(victim(tmp_path / f"victim_{n}"), out / n)
    evaluate.main(["--model", "toy", "--out", str(out), *EVAL_SMALL, "--confidence", "logits"])
    assert all(read(tmp_path / f"victim_{n}") == "precious\n" for n in planted)
    assert not os.path.islink(out / "reliability_toy_toy.png") and os.path.getsize(out / "reliability_toy_toy.png") > 0
    os.remove(out / "samples.jsonl")
    os.symlink(victim(tmp_path / "victim_samples"), out / "samples.jsonl")
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", "toy", "--out", str(out), *EVAL_SMALL, "--confidence", "logits", "--seed", "1"])
    assert "samples.jsonl is a symbolic link" in str(e.value.code) and "\n" not in str(e.value.code)
    assert read(tmp_path / "victim_samples") == "precious\n"


# ---- D22: a full disk mid-write is one line and leaves what was there

def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_keeps_the_last(run_copy, capsys):
    before = sorted(os.listdir(os.path.join(run_copy, "checkpoints")))
    with file_size_limit(1 << 20), pytest.raises(SystemExit) as e:   # model.safetensors is 3.3 MB
        train.main(["--resume", run_copy, "--steps", "3"])
    out = capsys.readouterr().err   # the training's progress bars, then one error line
    err = out.splitlines()[-1]
    assert "Traceback" not in out and [x for x in out.splitlines() if x.startswith("error: ")] == [err]
    assert e.value.code == 2 and f"cannot write checkpoint {ckpt(run_copy, 3)} (" in err and "disk full" in err, err
    assert sorted(os.listdir(os.path.join(run_copy, "checkpoints"))) == before   # no temporary folder left
    assert checkpoint.latest_checkpoint(run_copy, resume=True) == ckpt(run_copy, 2)


def test_a_full_disk_while_plotting_keeps_the_old_png(tmp_path):
    rel = [dict(lo=i / 10, hi=(i + 1) / 10, accuracy=0.5, count=3) for i in range(10)]
    path = str(tmp_path / "reliability.png")
    report.plot_reliability(rel, "t", path)
    old = open(path, "rb").read()
    with file_size_limit(len(old) // 4), pytest.raises(files.UserError, match="cannot write .*reliability.png"):
        report.plot_reliability(rel, "t2", path)
    assert open(path, "rb").read() == old and os.listdir(tmp_path) == ["reliability.png"]


# ---- D23: a run read while it trains with --keep 1 (its checkpoint pruned meanwhile)

def test_a_checkpoint_pruned_while_loading_is_said_plainly(run_copy, monkeypatch):
    load = transformers.AutoTokenizer.from_pretrained

    def pruned_first(path, **kw):   # the training process prunes the checkpoint as we start reading it
        shutil.rmtree(path)
        return load(path, **kw)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", pruned_first)
    with pytest.raises(files.UserError, match=f"its checkpoint {ckpt(run_copy, 2)} was removed while loading"):
        models.load_model(run_copy)


def test_a_checkpoint_pruned_while_listing_is_passed_over_for_the_newer_one(run_copy, monkeypatch):
    listed = checkpoint.checkpoints(run_copy)
    shutil.copytree(ckpt(run_copy, 2), ckpt(run_copy, 3))
    state = os.path.join(ckpt(run_copy, 3), "state.pt")
    torch.save({**torch.load(state, weights_only=True), "step": 3}, state)
    for step in (1, 2):   # the run saved step 3 and pruned the others since
        shutil.rmtree(ckpt(run_copy, step))
    real = checkpoint.checkpoints
    listings = iter([listed])   # the first look saw steps 1 and 2
    monkeypatch.setattr(checkpoint, "checkpoints", lambda run: next(listings, None) or real(run))
    said = []
    assert checkpoint.latest_checkpoint(run_copy, say=said.append) == ckpt(run_copy, 3) and said == []


# ---- red team 4, case 30: a checkpoint is on disk before it is published and before any older one goes

def test_a_checkpoint_is_fsynced_before_its_rename_and_the_rename_before_any_prune(run_copy, monkeypatch):
    events, real_fsync, real_replace, real_remove = [], os.fsync, os.replace, checkpoint._remove

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.path.realpath(a), os.path.realpath(b)))
        return real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(checkpoint, "_remove", lambda p: events.append(("prune", p)) or real_remove(p))

    def write(tmp):   # step 2's files, saved as step 3
        for n in os.listdir(ckpt(run_copy, 2)):
            shutil.copy(os.path.join(ckpt(run_copy, 2), n), tmp)
        state = os.path.join(tmp, "state.pt")
        torch.save({**torch.load(state, weights_only=True), "step": 3}, state)
    checkpoint.save_checkpoint(run_copy, 3, write, keep=1)
    root = os.path.realpath(os.path.join(run_copy, "checkpoints"))
    (i,) = [i for i, e in enumerate(events) if e[0] == "replace"]
    tmp, final = events[i][1:]
    assert final == os.path.join(root, "step_000003")
    files_synced = [e[1] for e in events[:i - 1]]
    assert sorted(files_synced) == sorted(os.path.join(tmp, n) for n in os.listdir(final))   # each file, then
    assert events[i - 1] == ("fsync", tmp)                                                  # the folder, then
    assert events[i + 1:] == [("fsync", root), ("prune", ckpt(run_copy, 1)), ("prune", ckpt(run_copy, 2))]


# ---- red team 4, case 25: a link at --out is refused before anything loads

@pytest.mark.parametrize("target", ["dangling", "a folder"])
def test_a_link_at_out_is_refused_in_one_line_before_anything_loads(target, tmp_path, monkeypatch, capsys):
    import data

    def loads(*a, **k):
        raise AssertionError("nothing may load before --out is checked")
    monkeypatch.setattr(data, "load_rows", loads)
    monkeypatch.setattr(models, "load_model", loads)
    where, link = tmp_path / "elsewhere", str(tmp_path / "out")
    if target == "a folder":
        os.makedirs(where)
    os.symlink(where, link)
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "1", "--out", link, *SMALL])
    assert e.value.code == 2 and one_line(capsys) == f"error: --out {link} is a symbolic link (to {where}): pass " \
        "the folder itself, or another path"
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", "toy", "--out", link, *EVAL_SMALL])
    assert e.value.code == 2 and one_line(capsys) == f"evaluate.py: error: --out {link} is a symbolic link (to " \
        f"{where}): pass the folder itself, or another path"
    assert os.path.islink(link) and (os.listdir(where) == [] if target == "a folder" else not os.path.exists(where))


# ---- newcomer 5: a resumed run ends with the held-out line, its start from the run's log

def test_a_resumed_run_prints_the_held_out_line_with_the_start_from_its_log(run_copy, capsys):
    start = [r["eval_accuracy"] for r in metric_rows(run_copy) if r.get("eval") and r["step"] == 0]
    train.main(["--resume", run_copy, "--steps", "3"])
    end = [r["eval_accuracy"] for r in metric_rows(run_copy) if r.get("eval") and r["step"] == 3]
    assert len(start) == len(end) == 1
    assert f"held-out accuracy: {start[0]:.3f} at the start -> {end[0]:.3f} at step 3" in capsys.readouterr().out
