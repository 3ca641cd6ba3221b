"""A day-long run a researcher can watch, stop and ship: a tracker's mirror (--report-to), curves
and provenance while it runs, a saved stop on SIGTERM / SIGUSR1 and one command that starts or
continues a run, RUN/model as a bf16 folder a serving engine takes as it is, and two nodes."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import train
from harness import checkpoint
from harness.parallel import PREEMPTED, free_port
from runs import ENV, ROOT, SMALL, ckpt, metric_rows, one_line_past_bars as one_line

def toy(steps, *more):
    """A small toy run of `steps`, saved at the end only, no held-out check unless `more` asks."""
    return ["--steps", str(steps), "--save-every", "10", "--eval-every", "0", *SMALL, "--eval-n", "0", *more]


def weights(run, step):
    return load_file(os.path.join(ckpt(run, step), "model.safetensors"))


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_stops_after_the_step_saved_and_the_resume_ends_bit_identical(tmp_path, monkeypatch, capsys):
    """SIGTERM during step 3 of 6: the step ends, a checkpoint of step 3 is saved, the curves drawn,
    exit 75 with the resume line; --resume then ends with the weights of an uninterrupted 6-step run."""
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    train.main(toy(6, "--out", full))
    real = train.logged_step

    def step(n, *a):
        if n == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(n, *a)

    monkeypatch.setattr(train, "logged_step", step)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(toy(6, "--out", cut))
    assert e.value.code == PREEMPTED == 75
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"stopped by SIGTERM after step 3, saved: {ckpt(cut, 3)}; continue with: python train.py --resume {cut}")
    assert [checkpoint.step_of(c) for c in checkpoint.checkpoints(cut)] == [3]
    assert os.path.isfile(os.path.join(cut, "curves.png"))
    monkeypatch.setattr(train, "logged_step", real)
    train.main(["--resume", cut])
    assert same(weights(full, 6), weights(cut, 6))
    assert [r["step"] for r in metric_rows(cut)] == [1, 2, 3, 4, 5, 6]


def wait_for_row(run, step, proc, limit=600):
    deadline = time.time() + limit
    while proc.poll() is None and time.time() < deadline:
        if os.path.isfile(os.path.join(run, "metrics.jsonl")) and any(
                r["step"] >= step for r in metric_rows(run) if not r.get("eval")):
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} row: {proc.poll()}")


def test_resume_of_an_absent_or_empty_folder_starts_the_run_there(tmp_path):
    """One command serves the first start and every requeue."""
    run = str(tmp_path / "run")
    train.main(["--resume", run, *toy(1)])
    assert [c for c in checkpoint.checkpoints(run)] == [ckpt(run, 1)]
    train.main(["--resume", run, "--steps", "2"])
    assert [r["step"] for r in metric_rows(run)] == [1, 2]
    with open(os.path.join(run, "config.json")) as f:
        cfg = json.load(f)
    prov = cfg["provenance"]
    assert prov["command"].startswith("train.py --resume ") and prov["world_size"] == 1
    assert {"git_commit", "torch", "transformers", "peft", "device"} <= set(prov)


def test_the_run_folder_holds_a_bf16_model_that_transformers_loads_and_generates_with(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run = str(tmp_path / "run")
    train.main(toy(1, "--out", run))
    model_dir = os.path.join(run, "model")
    assert sorted(os.listdir(model_dir)) == ["chat_template.jinja", "config.json", "generation_config.json",
                                             "model.safetensors", "probe.pt", "tokenizer.json",
                                             "tokenizer_config.json"]
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["dtype"] == "bfloat16" and config["use_cache"] is True
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in sd.values()) and "lm_head.weight" not in sd
    fp32 = weights(run, 1)
    assert all(torch.equal(sd[k], fp32[k].to(torch.bfloat16)) for k in sd)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert model.dtype == torch.bfloat16
    ids = tok("3+4=", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4


def test_a_lora_adapter_loads_with_peft_auto_class(tmp_path):
    from peft import AutoPeftModelForCausalLM
    run = str(tmp_path / "run")
    train.main(toy(1, "--lora-rank", "4", "--out", run))
    adapter = ckpt(run, 1)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert json.load(f)["task_type"] == "CAUSAL_LM"
    model = AutoPeftModelForCausalLM.from_pretrained(adapter)
    assert type(model).__name__ == "PeftModelForCausalLM"
    with open(os.path.join(run, "model", "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"   # the adapter merged into its base


STAND_IN = '''import json, os
PATH = os.environ["TRACKER_LOG"]
def _rec(*row):
    with open(PATH, "a") as f:
        f.write(json.dumps(row) + "\\n")
def init(**kw):
    _rec("init", {k: v for k, v in kw.items() if k != "config"}, sorted(kw["config"]))
def log(row, step=None):
    _rec("log", row, step)
def finish():
    _rec("finish")
'''


def test_report_to_mirrors_every_row_once_with_its_step_and_a_resume_continues_the_same_run(
        tmp_path, monkeypatch):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "wandb.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("TRACKER_LOG", str(record))
    run = str(tmp_path / "run")
    train.main(toy(2, "--eval-n", "4", "--out", run, "--report-to", "wandb"))
    train.main(["--resume", run, "--steps", "3"])
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    inits = [c[1] for c in calls if c[0] == "init"]
    assert len(inits) == 2 and inits[0] == inits[1] and inits[0]["resume"] == "allow"
    assert inits[0]["name"] == "run" and inits[0]["id"] == json.load(open(os.path.join(run, "tracker.json")))["id"]
    assert "lam" in calls[0][2] and "provenance" not in calls[0][2]
    logged = [(c[2], bool(c[1].get("eval"))) for c in calls if c[0] == "log"]
    rows = [(r["step"], bool(r.get("eval"))) for r in metric_rows(run)]
    assert logged == rows == [(0, True), (1, False), (2, False), (2, True), (3, False), (3, True)]
    assert [c[0] for c in calls].count("finish") == 2


def test_report_to_without_its_package_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else real(name, *a))
    monkeypatch.setattr(train.ckpt_lib, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        train.main(["--report-to", "trackio", "--out", str(tmp_path / "run")])
    assert e.value.code == 2 and one_line(capsys) == (
        "error: --report-to trackio: the package trackio is not installed: pip install trackio, or pass "
        "--report-to none")


@pytest.mark.slow   # two torchrun agents, a save and a resume
def test_two_nodes_of_one_process_each_train_save_once_and_resume(tmp_path):
    """torchrun --nnodes 2 --nproc-per-node 1, started twice on this machine (c10d rendezvous on
    127.0.0.1, gloo): a 2-step toy run and a resume to step 3. One checkpoint a save, written by the
    global rank 0 (on a GPU each rank takes its LOCAL_RANK device: 0 on both nodes here)."""
    run = str(tmp_path / "run")

    def nodes(*args):
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}",
               "train.py", *args]
        procs = [subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=900)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
        return outs

    nodes(*toy(2, "--save-every", "1", "--max-new-tokens", "24", "--out", run))
    assert [checkpoint.step_of(c) for c in checkpoint.checkpoints(run)] == [1, 2]
    with open(os.path.join(run, "config.json")) as f:
        assert json.load(f)["provenance"]["world_size"] == 2
    nodes("--resume", run, "--steps", "3")
    assert [r["step"] for r in metric_rows(run)] == [1, 2, 3]
    assert [checkpoint.step_of(c) for c in checkpoint.checkpoints(run)] == [2, 3]
    assert not [n for n in os.listdir(os.path.join(run, "checkpoints")) if n.endswith(".tmp")]
