"""`python train.py --nproc 2`: the launcher starts two gloo workers, stops them all when one fails,
takes them down with it when killed, and a resumed two-process run ends where an uninterrupted one does."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from runs import sigint_default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "40", "--eval-n", "8",
         "--eval-every", "0", "--gen-batch", "64"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONHASHSEED": "0"}


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


@pytest.mark.slow   # the launcher and two workers
def test_a_failing_worker_stops_the_others_and_its_error_is_shown_once(tmp_path):
    script = tmp_path / "work.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    time.sleep(1)\n"
                      "    raise RuntimeError('boom on rank ' + os.environ['RANK'])\n"
                      "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], flush=True)\n"
                      "time.sleep(120)\n")
    code = ("import sys\nfrom harness import parallel\nsys.exit(parallel.launch(sys.argv[1], [], 2))")
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code, str(script)], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert time.monotonic() - start < 30  # rank 0 was stopped, not waited for
    assert "rank 0 of 2" in res.stdout
    assert res.stderr.count("RuntimeError: boom on rank 1") == 1, res.stderr
    assert "worker 1 of 2 failed" in res.stderr


def test_ctrl_c_lets_the_workers_say_how_to_continue_and_leaves_no_logs(tmp_path):
    """Red team 6, row 6: the launcher stopped the workers at once, so rank 0 never printed train.py's
    "continue with: --resume" line, and the workers' logs stayed in the temporary folder."""
    script = tmp_path / "work.py"
    script.write_text("import os, sys, time\n"
                      "rank = os.environ['RANK']\n"
                      "try:\n"
                      "    open(os.path.join(sys.argv[1], 'ready' + rank), 'w').close()\n"
                      "    time.sleep(120)\n"
                      "except KeyboardInterrupt:   # rank 1 stops first, rank 0 takes its time to say where it is\n"
                      "    time.sleep(0.5 * (rank == '0'))\n"
                      "    print('interrupted on rank', rank, '; continue with: --resume', file=sys.stderr)\n"
                      "    sys.exit(130)\n")
    code = "import sys\nfrom harness import parallel\nsys.exit(parallel.launch(sys.argv[1], sys.argv[2:], 2))"
    temp = tmp_path / "temp"   # where the launcher keeps the workers' logs
    os.makedirs(temp)
    proc = subprocess.Popen([sys.executable, "-c", code, str(script), str(tmp_path)], cwd=ROOT,
                            env={**ENV, "TMPDIR": str(temp)}, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=sigint_default)
    deadline = time.time() + 60
    while not all(os.path.exists(tmp_path / f"ready{r}") for r in "01") and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)   # Ctrl-C: the terminal signals the whole process group
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted on rank 0 ; continue with: --resume", err
    assert os.listdir(temp) == []


def test_sigterm_to_the_launcher_reaches_every_worker_and_a_saved_stop_is_exit_75(tmp_path):
    """A scheduler's SIGTERM to `python train.py --nproc N` went to the launcher alone, which died and
    took its workers with it, nothing saved. Now each worker gets it; rank 1's early exit 75 (a saved
    stop) does not make the launcher stop rank 0 while it still saves."""
    script = tmp_path / "work.py"
    script.write_text("import os, signal, sys, time\n"
                      "rank = os.environ['RANK']\n"
                      "got = []\n"
                      "signal.signal(signal.SIGTERM, lambda *a: got.append(1))\n"
                      "open(os.path.join(sys.argv[1], 'ready' + rank), 'w').close()\n"
                      "while not got:\n"
                      "    time.sleep(0.01)\n"
                      "time.sleep(1.0 * (rank == '0'))   # rank 0 saves the step\n"
                      "open(os.path.join(sys.argv[1], 'saved' + rank), 'w').close()\n"
                      "sys.exit(75)\n")
    code = "import sys\nfrom harness import parallel\nsys.exit(parallel.launch(sys.argv[1], sys.argv[2:], 2))"
    proc = subprocess.Popen([sys.executable, "-c", code, str(script), str(tmp_path)], cwd=ROOT, env=ENV,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not all(os.path.exists(tmp_path / f"ready{r}") for r in "01") and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 75 and "error" not in err, err
    assert os.path.exists(tmp_path / "saved0") and os.path.exists(tmp_path / "saved1")


@pytest.mark.slow   # train.py --nproc 2
def test_a_user_error_in_the_workers_is_one_line(tmp_path):
    run, missing = tmp_path / "run", tmp_path / "no-such-train.jsonl"   # the data is read by the workers
    res = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--nproc", "2", "--out", str(run),
                          "--data", str(missing)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    err = res.stderr.strip()
    assert res.returncode == 2 and "Traceback" not in err, err
    assert err.count("error:") == 1 and "file not found" in err and str(missing) in err, err


@pytest.mark.slow   # train.py --nproc 2
def test_fewer_prompts_than_workers_is_refused_in_one_line(tmp_path):
    """A worker without a prompt group crashed in pack([]) while the others waited in a collective."""
    start = time.monotonic()
    res = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--nproc", "2", "--prompts-per-step", "1",
                          "--steps", "1", "--out", str(tmp_path / "run")], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=120)
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1, err
    assert err == "error: --prompts-per-step 1 leaves some of the 2 workers without a prompt: use " \
                  "--prompts-per-step >= 2 or fewer GPUs (--nproc 1)", err
    assert time.monotonic() - start < 60 and not os.path.exists(tmp_path / "run")


def test_each_worker_gets_its_share_of_the_cores(monkeypatch):
    """Every rank fits the probe on the CPU at the same time (on CUDA too): 16 cores, 8 ranks -> 2
    threads each, at least 1, and an OMP_NUM_THREADS the user set is kept."""
    from harness import parallel as launcher
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    env = launcher.worker_env(3, 8, "1234")
    assert env["OMP_NUM_THREADS"] == "2"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("3", "3", "8", "1234")
    assert launcher.worker_env(0, 32, "1234")["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert launcher.worker_env(0, 8, "1234")["OMP_NUM_THREADS"] == "5"


def launch(args, out):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--nproc", "2", *args,
                             "--out", out], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow   # an uninterrupted two-process run; one killed, resumed, stopped, resumed
def test_two_process_run_killed_then_stopped_by_sigusr1_resumes_bit_identical(tmp_path):
    """Uninterrupted run vs a run whose launcher is SIGKILLed after step 1 and resumed, and whose
    resume a scheduler's SIGUSR1 stops (the launcher forwards it: every rank stops after the same
    step, rank 0 saves it, exit 75) and is resumed again: the same weights at step 4."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from harness.parallel import PREEMPTED
    args = ["--steps", "4", "--save-every", "1", *SMALL]
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    a, b = launch(args, full), launch(args, cut)
    first = os.path.join(cut, "checkpoints", "step_000001")
    deadline = time.time() + 400
    while not os.path.isdir(first) and b.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    workers = children(b.pid)
    b.send_signal(signal.SIGKILL)
    b.wait()
    assert os.path.isdir(first), "the run should have reached step 1 before the kill"
    assert len(workers) == 2
    deadline = time.time() + 20
    while any(alive(p) for p in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers), "workers outlived their launcher"
    resume = [sys.executable, os.path.join(ROOT, "train.py"), "--nproc", "2", "--resume", cut]
    c = subprocess.Popen(resume, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    second = os.path.join(cut, "checkpoints", "step_000002")  # the resume's first save
    deadline = time.time() + 400
    while not os.path.isdir(second) and c.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    c.send_signal(signal.SIGUSR1)
    err = c.communicate(timeout=400)[1]
    assert c.returncode == PREEMPTED, err[-3000:]
    assert "stopped by SIGUSR1 after step" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not os.path.isdir(os.path.join(cut, "checkpoints", "step_000004"))  # stopped before the end
    assert a.wait(timeout=400) == 0, a.stderr.read()[-3000:]
    res = subprocess.run(resume, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]

    steps = [json.loads(line) for line in open(os.path.join(full, "metrics.jsonl"))]
    steps = [r for r in steps if not r.get("eval")]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # one row per step
    # one rank holds 2 prompts x 4 samples x at most 3 cuts = 24 prefixes: more means both were pooled
    assert all(r["prefixes"] > 24 for r in steps)
    assert all(r["ratio_mean"] == 1.0 and r["clip_frac"] == 0.0 for r in steps)  # exactly on-policy
    wa = load_file(os.path.join(full, "checkpoints", "step_000004", "model.safetensors"))
    wb = load_file(os.path.join(cut, "checkpoints", "step_000004", "model.safetensors"))
    w0 = load_file(os.path.join(ROOT, "toy_base", "model.safetensors"))
    assert max((wa[k] - w0[k]).abs().max().item() for k in w0) > 0  # training moved the weights
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert "lm_head.weight" not in wb and "model.embed_tokens.weight" in wb   # tied: saved once
    model = AutoModelForCausalLM.from_pretrained(os.path.join(cut, "checkpoints", "step_000004"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
