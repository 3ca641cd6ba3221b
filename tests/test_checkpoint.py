"""harness/checkpoint.py: pruning that never takes a good checkpoint for a damaged or newer one,
checkpoint folders that must be what their name says, and a checkpoint on disk before it is published;
load_model: a checkpoint pruned while it loads and weights that do not fit their config each end in one line."""
import json
import os
import shutil

import pytest
import torch
import transformers

import toy
import train
from harness import checkpoint, files
from harness.files import UserError
from runs import ckpt, file_size_limit, write


def test_resume_with_keep_1_beside_a_damaged_newer_checkpoint_keeps_the_new_good_one(run_copy, capsys):
    os.rename(ckpt(run_copy, 2), ckpt(run_copy, 3))
    os.truncate(os.path.join(ckpt(run_copy, 3), "model.safetensors"), 1000)
    train.main(["--resume", run_copy, "--steps", "2", "--keep", "1"])
    out = capsys.readouterr().out
    assert "from step 1" in out and f"(latest checkpoint: {ckpt(run_copy, 2)})" in out
    # step 1 pruned (one complete one is kept); the damaged step 3 is not counted and not removed
    assert sorted(os.listdir(os.path.join(run_copy, "checkpoints"))) == ["run", "step_000002", "step_000003"]   # run: the mark
    assert checkpoint.latest_checkpoint(run_copy, resume=True) == ckpt(run_copy, 2)


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


def test_a_checkpoint_is_fsynced_before_its_rename_and_the_rename_before_any_prune(run_copy, monkeypatch):
    events, real_fsync, real_replace, real_rmtree = [], os.fsync, os.replace, shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.path.realpath(a), os.path.realpath(b)))
        return real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", lambda p, **k: events.append(("prune", p)) or real_rmtree(p, **k))

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


def test_a_checkpoint_pruned_while_loading_is_said_plainly(run_copy, monkeypatch):
    load = transformers.AutoTokenizer.from_pretrained

    def pruned_first(path, **kw):   # the training process prunes the checkpoint as we start reading it
        shutil.rmtree(path)
        return load(path, **kw)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", pruned_first)
    with pytest.raises(files.UserError, match=f"its checkpoint {ckpt(run_copy, 2)} was removed while loading"):
        checkpoint.load_model(run_copy)


def test_weights_that_do_not_fit_the_config_are_one_line(tmp_path):
    model = str(tmp_path / "model")
    shutil.copytree(toy.BASE_DIR, model)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    write(os.path.join(model, "config.json"), json.dumps(dict(cfg, vocab_size=5000)))
    with pytest.raises(UserError) as e:
        checkpoint.load_model(model)
    # transformers refuses them (its report above names the tensor); one line says what to do
    assert str(e.value).startswith(f"cannot load model {model!r}: ")
    assert str(e.value).endswith("its weights do not fit its config.json: restore the matching one")


def test_a_checkpoint_pruned_while_it_loads_is_one_line(tmp_path, monkeypatch):
    # L5 (C63): at a7c59f5 safetensors' "unable to open file <...> in read-only mode" (a RuntimeError)
    # came out bare, a traceback in evaluate.py, when the run pruned the checkpoint mid-load.
    from harness.files import UserError
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    shutil.copytree(toy.BASE_DIR, ckpt)

    def pruned(path, **kw):
        shutil.rmtree(ckpt)
        raise RuntimeError(f"unable to open file <{path}/model.safetensors> in read-only mode: No such file")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", pruned)
    with pytest.raises(UserError, match=f"^cannot load model '{tmp_path / 'run'}': its checkpoint {ckpt} was "
                                        "removed while loading"):
        checkpoint.load_model(str(tmp_path / "run"))


def test_a_copied_run_whose_checkpoints_are_a_link_cannot_prune_the_originals(run_copy, tmp_path, capsys):
    """cp -r RUN RUN2 copies the link: --resume RUN2 --keep 1 wrote into and pruned RUN's checkpoints.
    A run whose checkpoints/ links to a bigger disk keeps working, moved or not."""
    disk = tmp_path / "disk"
    shutil.move(os.path.join(run_copy, "checkpoints"), disk)
    os.symlink(disk, os.path.join(run_copy, "checkpoints"))
    train.main(["--resume", run_copy, "--steps", "3", "--eval-n", "0"])   # the link to a bigger disk
    before = sorted(os.listdir(disk))
    assert "step_000003" in before
    copy = str(tmp_path / "copy")
    shutil.copytree(run_copy, copy, symlinks=True)
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", copy, "--steps", "4", "--keep", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err == (
        f"error: --resume {copy}: its checkpoints/ is a link to the checkpoints of the run "
        f"{os.path.realpath(run_copy)}; resuming would write into and prune them: copy a run with cp -rL, "
        f"or link {os.path.join(copy, 'checkpoints')} to a folder of its own")
    assert sorted(os.listdir(disk)) == before
    moved = str(tmp_path / "moved")
    shutil.move(run_copy, moved)   # the original gone: the copy, or the moved run, is the owner
    train.main(["--resume", moved, "--steps", "4", "--keep", "1", "--eval-n", "0"])
    assert [n for n in sorted(os.listdir(disk)) if n.startswith("step_")] == ["step_000004"]


def test_a_dangling_link_as_out_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    os.symlink(tmp_path / "nowhere", out)
    with pytest.raises(SystemExit) as e:
        train.main(["--out", str(out), "--steps", "1"])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == (
        f"error: --out {out} is a link to {tmp_path / 'nowhere'}, which does not exist: create that folder, "
        "or pass another --out")
