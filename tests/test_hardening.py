"""What careless or hostile users and damaged files do: no code from a run folder, one writer per
folder, resume that repairs what it can, --resume flags that apply, and one line for every bad input."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from harness import checkpoint, files
import config
import evaluate
import toy_warm
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "40", "--eval-n", "8",
         "--eval-every", "0", "--gen-batch", "64"]
# A small post-hoc probe (released: 80 questions x 8 rollouts x 16 budgets, minutes on a CPU): these
# tests check locks, resume and refusals, which do not depend on the probe's size.
PROBE_SMALL = ["--probe-questions", "4", "--probe-samples", "2", "--posthoc-budgets", "2"]
EVAL_SMALL = ["--benchmarks", "toy", "--limit", "2", "--n-samples", "1", "--max-new-tokens", "24", *PROBE_SMALL]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONHASHSEED": "0"}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A 2-step toy run with a checkpoint after each step (copy it before changing it)."""
    run = str(tmp_path_factory.mktemp("base") / "run")
    train.main(["--steps", "2", "--save-every", "1", "--out", run, *SMALL])
    return run


@pytest.fixture
def run_copy(base_run, tmp_path):
    dst = str(tmp_path / "run")
    shutil.copytree(base_run, dst)
    return dst


def one_line(capsys):
    """The one line on stderr (transformers' weight-loading progress bar aside)."""
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("Loading weights")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(folder):
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), folder)] = f.read()
    return out


def metric_rows(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_py(*args, check=False):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, check=check)


# ---- point 1: trust_remote_code never comes from a run folder

EVIL = """import os
open(os.environ["RLCM_MARKER"], "w").write("ran")
from transformers import Qwen2ForCausalLM


class EvilForCausalLM(Qwen2ForCausalLM):
    pass
"""


@pytest.mark.slow   # train.py in a subprocess
def test_trust_remote_code_is_never_taken_from_a_saved_config(run_copy, tmp_path):
    cfg_path = os.path.join(run_copy, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["trust_remote_code"] = True
    json.dump(cfg, open(cfg_path, "w"))
    for ckpt in checkpoint.checkpoints(run_copy):
        with open(os.path.join(ckpt, "modeling_evil.py"), "w") as f:
            f.write(EVIL)
        c = json.load(open(os.path.join(ckpt, "config.json")))
        c["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
        json.dump(c, open(os.path.join(ckpt, "config.json"), "w"))
    marker = tmp_path / "marker"
    ENV.update(RLCM_MARKER=str(marker), HF_MODULES_CACHE=str(tmp_path / "modules"))
    try:
        r = train_py("--resume", run_copy, "--steps", "3")
        assert r.returncode == 2 and not marker.exists()
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1 and "--trust-remote-code" in err and "Traceback" not in err, err
        r = train_py("--resume", run_copy, "--steps", "3", "--trust-remote-code")
        assert r.returncode == 0, r.stderr[-2000:]
        assert marker.read_text() == "ran"   # allowed when the flag is given now
    finally:
        ENV.pop("RLCM_MARKER"), ENV.pop("HF_MODULES_CACHE")
    assert json.load(open(cfg_path))["trust_remote_code"] is True


# ---- point 2: one writer per folder

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


def sigint_default():
    """Children of a shell's background job start with SIGINT ignored; Ctrl-C tests need it live."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


# ---- point 4: resume repairs what it can

def test_resume_drops_a_cut_off_metrics_line(run_copy, capsys):
    with open(os.path.join(run_copy, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "accur')
    train.main(["--resume", run_copy, "--steps", "3"])
    assert "dropped a cut-off last line" in capsys.readouterr().err
    assert [r["step"] for r in metric_rows(run_copy) if not r.get("eval")] == [1, 2, 3]


def test_resume_skips_a_checkpoint_without_state_pt(run_copy, capsys):
    os.remove(os.path.join(run_copy, "checkpoints", "step_000002", "state.pt"))
    train.main(["--resume", run_copy, "--steps", "2"])
    out = capsys.readouterr()
    assert "skipping incomplete checkpoint" in out.out + out.err and "missing state.pt" in out.out + out.err
    assert "resuming" in out.out and "from step 1" in out.out
    steps = [r["step"] for r in metric_rows(run_copy) if not r.get("eval")]
    assert steps == [1, 2]   # step 2 was logged again, once
    assert checkpoint.missing(os.path.join(run_copy, "checkpoints", "step_000002"), resume=True) == []


def test_resume_with_a_truncated_latest_safetensors_falls_back(run_copy, capsys):
    path = os.path.join(run_copy, "checkpoints", "step_000002", "model.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    assert checkpoint.missing(os.path.dirname(path)) == ["model.safetensors (cut short)"]
    train.main(["--resume", run_copy, "--steps", "2"])
    assert "from step 1" in capsys.readouterr().out


# ---- point 5: --resume with flags

def test_resume_applies_and_records_changed_lr_and_steps(run_copy, capsys):
    train.main(["--resume", run_copy, "--steps", "3", "--lr", "1e-3"])
    printed = capsys.readouterr().out
    assert "changed on resume" in printed and f"lr {config.TOY['lr']} -> 0.001" in printed and "steps 2 -> 3" in printed
    cfg = json.load(open(os.path.join(run_copy, "config.json")))
    assert cfg["steps"] == 3 and cfg["lr"] == 1e-3 and cfg["resume"] is None
    (row,) = [r for r in metric_rows(run_copy) if r["step"] == 3 and not r.get("eval")]
    assert row["lr"] == pytest.approx(1e-3)   # warm-up (3 steps) is over at step 3: the new rate in full
    # a plain --resume later remembers both
    train.main(["--resume", run_copy])
    assert "at step 3 already (--steps 3): nothing to train" in capsys.readouterr().out


def test_resume_applies_a_changed_weight_decay_over_the_restored_optimizers(run_copy):
    """The optimizer state restored from state.pt holds the decay it was saved with (the toy's 0.0);
    --weight-decay given with --resume replaces it, as --lr replaces the rate."""
    train.main(["--resume", run_copy, "--steps", "3", "--weight-decay", "0.05"])
    assert json.load(open(os.path.join(run_copy, "config.json")))["weight_decay"] == 0.05
    latest = checkpoint.latest_checkpoint(run_copy)
    state = torch.load(os.path.join(latest, "state.pt"), weights_only=True)
    assert latest.endswith("3") and [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.05]


def test_resume_lr_during_warmup_is_scaled_like_the_rest(run_copy, capsys):
    shutil.rmtree(os.path.join(run_copy, "checkpoints", "step_000002"))
    train.main(["--resume", run_copy, "--steps", "2", "--lr", "3e-3"])
    (row,) = [r for r in metric_rows(run_copy) if r["step"] == 2 and not r.get("eval")]
    assert row["lr"] == pytest.approx(3e-3 * 2 / 3)   # warm-up 3: factor (1 + 1) / 3 at the second step


# ---- points 6-8: silent no-ops, lost work, tracebacks

def test_save_every_0_saves_at_the_end_and_eval_n_0_evaluates_nothing(tmp_path):
    run = str(tmp_path / "run")
    train.main(["--steps", "2", "--out", run, *SMALL, "--save-every", "0", "--eval-n", "0"])
    assert os.listdir(os.path.join(run, "checkpoints")) == ["step_000002"]
    assert [r["step"] for r in metric_rows(run)] == [1, 2]   # no held-out rows


def test_steps_0_does_nothing_and_says_so(tmp_path, capsys):
    train.main(["--steps", "0", "--out", str(tmp_path / "run")])
    assert "--steps 0: nothing to train" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "run")


def write(path, content):
    with open(path, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)
    return str(path)


def jsonl(path, rows):
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def refused_pickle(run):
    ckpt = checkpoint.latest_checkpoint(run)
    torch.save({"step": 2, "hook": os.system}, os.path.join(ckpt, "state.pt"))   # a global: refused
    return ["--resume", run, "--steps", "3"]


def truncated_model(tmp_path):
    model = str(tmp_path / "model")
    shutil.copytree(toy_warm.base_model(), model)
    path = os.path.join(model, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    return ["--model", model, "--data", "toy", "--eval-data", "toy"]


TRAIN_CASES = {   # name: (argv from (tmp_path, run_copy), words in the one line)
    "group-size 1": (lambda t, r: ["--group-size", "1"], "--group-size 1: must be >= 2"),
    "group-size 0": (lambda t, r: ["--group-size", "0"], "--group-size 0: must be >= 2"),
    "prompts-per-step 0": (lambda t, r: ["--prompts-per-step", "0"], "--prompts-per-step 0: must be >= 1"),
    "prompts-per-step -3": (lambda t, r: ["--prompts-per-step", "-3"], "--prompts-per-step -3: must be >= 1"),
    "k 0": (lambda t, r: ["--k", "0"], "--k 0: must be >= 1"),
    "max-new-tokens 0": (lambda t, r: ["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    "lr nan": (lambda t, r: ["--lr", "nan"], "--lr nan: must be > 0"),
    "lr -1": (lambda t, r: ["--lr", "-1"], "--lr -1.0: must be > 0"),
    "temperature 0": (lambda t, r: ["--temperature", "0"], "--temperature 0.0: must be > 0"),
    "top-p 1.5": (lambda t, r: ["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    "save-every -1": (lambda t, r: ["--save-every", "-1"], "--save-every -1: must be >= 0"),
    "eval-n -1": (lambda t, r: ["--eval-n", "-1"], "--eval-n -1: must be >= 0"),
    "keep 0": (lambda t, r: ["--keep", "0"], "--keep 0: must be >= 1"),
    "out is a file": (lambda t, r: ["--out", write(t / "f", "x")], "is a file, not a folder"),
    "out not writable": (lambda t, r: ["--out", "/proc/1/run"], "is not writable"),
    "broken config.json": (lambda t, r: ["--resume", os.path.dirname(write(os.path.join(r, "config.json"), "{broken"))],
                           "config.json is unreadable (JSONDecodeError"),
    "truncated safetensors": (lambda t, r: truncated_model(t), "weights file is damaged"),
    "corrupt parquet": (lambda t, r: ["--data", write(t / "d.parquet", b"PAR1 not really")],
                        "is not a readable parquet file"),
    "non-UTF-8 data": (lambda t, r: ["--data", write(t / "d.jsonl", b'{"problem": "\xff\xfe", "answer": "1"}\n')],
                       "is not UTF-8 text (byte 0xff at offset 13)"),
    "data is a folder": (lambda t, r: ["--data", str(t)], "is a folder: pass one data file in it"),
    "mistyped extension": (lambda t, r: ["--data", str(t / "train.jsnol")], "file not found"),
    "missing model dir": (lambda t, r: ["--model", str(t / "no-model")], "model directory"),
    "missing HF model": (lambda t, r: ["--model", "no-such-org/no-such-model-xyz"],
                         "not in the local Hugging Face cache"),
    "100,000-char prompt": (lambda t, r: ["--data", jsonl(t / "d.jsonl", [{"problem": "1" * 100_000, "answer": "1"}])],
                            "do not fit the model's context of 256 tokens (row 0"),
    "refused pickle": (lambda t, r: refused_pickle(r), "was not loaded (that could run code)"),
    "seed changed on resume": (lambda t, r: ["--resume", r, "--seed", "7"], "--seed cannot change on resume"),
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_refuses_in_one_line_and_makes_no_folder(case, tmp_path, run_copy, capsys):
    make, words = TRAIN_CASES[case]
    argv = make(tmp_path, run_copy)
    resume = "--resume" in argv
    before = snapshot(run_copy)
    out = [] if resume or "--out" in argv else ["--out", str(tmp_path / "new")]
    with pytest.raises(SystemExit) as e:
        train.main(argv + out + ["--steps", "3"])
    err = one_line(capsys)
    assert e.value.code == 2 and err.startswith("error: ") and words in err, err
    assert "weights_only" not in err
    assert not os.path.exists(tmp_path / "new")
    if resume:
        assert snapshot(run_copy) == before


def test_a_mistyped_extension_on_an_existing_file_still_reads(tmp_path):
    import data
    path = jsonl(tmp_path / "d.jsnol", [{"problem": "1+1", "answer": "2"}])
    assert data.load_rows(path) == [{"problem": "1+1", "answer": "2"}]
    assert data.load_rows(path, limit=0) == []   # 0 means none, not all


EVAL_CASES = {
    "n-samples 0": (lambda t: ["--n-samples", "0"], "--n-samples 0: must be >= 1"),
    "limit 0": (lambda t: ["--limit", "0"], "--limit 0: must be >= 1"),
    "max-new-tokens -1": (lambda t: ["--max-new-tokens", "-1"], "--max-new-tokens -1: must be >= 1"),
    "top-p nan": (lambda t: ["--top-p", "nan"], "--top-p nan: must be in (0, 1]"),
    "out is a file": (lambda t: ["--out", write(t / "f", "x")], "is a file, not a folder"),
    "{} line in samples.jsonl": (lambda t: ["--out", t / "eval"], "samples.jsonl line 2 is not a row of this log"),
    "100,000-char prompt": (lambda t: ["--benchmarks", jsonl(t / "q.jsonl", [{"problem": "1" * 100_000, "answer": "1"}])],
                            "do not fit the model's context of 256 tokens"),
}


@pytest.mark.parametrize("case", EVAL_CASES)
def test_evaluate_refuses_in_one_line(case, tmp_path, capsys):
    make, words = EVAL_CASES[case]
    if case.startswith("{}"):
        os.makedirs(tmp_path / "eval")
        jsonl(tmp_path / "eval" / "samples.jsonl", [dict(model="toy", benchmark="toy", question=0, sample=0,
                                                          correct=1, confidence=0.5), {}])
    argv = ["--model", "toy", *EVAL_SMALL, "--out", str(tmp_path / "new")] + [str(a) for a in make(tmp_path)]
    with pytest.raises(SystemExit) as e:
        evaluate.main(argv)
    msg = e.value.code
    if msg == 2:   # a flag's value, checked before anything loads: on stderr, exit 2 like argparse's
        msg = one_line(capsys)
    assert isinstance(msg, str) and "\n" not in msg and words in msg, msg
    assert not os.path.exists(tmp_path / "new")


@pytest.mark.slow   # train.py killed and resumed
def test_ctrl_c_keeps_the_last_checkpoint_and_prints_the_resume_command(tmp_path):
    run = str(tmp_path / "run")
    args = [sys.executable, os.path.join(ROOT, "train.py"), "--steps", "40", "--save-every", "1", *SMALL]
    proc = subprocess.Popen(args + ["--out", run], env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    first = os.path.join(run, "checkpoints", "step_000001")
    deadline = time.time() + 300
    while not os.path.isdir(first) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("interrupted:")
    assert f"continue with: python train.py --resume {run}" in last
    ckpts = checkpoint.checkpoints(run)
    assert ckpts and all(checkpoint.missing(c, resume=True) == [] for c in ckpts)
    assert not os.path.exists(os.path.join(run, files.LOCK))
    n = checkpoint.step_of(ckpts[-1]) + 1
    r = train_py("--resume", run, "--steps", str(n))
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["step"] for x in metric_rows(run) if not x.get("eval")] == list(range(1, n + 1))


def test_prompts_past_the_context_are_refused_and_overflow_is_warned():
    import data
    import prompts as prompts_lib
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy_warm.base_model())   # context 256
    short = {"problem": "1+1", "answer": "2"}
    n = len(prompts_lib.chat_prompt(tok, short["problem"], ""))
    said = []
    prompts_lib.check_context(tok, [short], "", 256, 256 - n, "d", say=said.append)
    assert said == []                                        # exactly fills the context
    prompts_lib.check_context(tok, [short], "", 256, 257 - n, "d", say=said.append)
    assert len(said) == 1 and "1 of 1 prompts plus" in said[0]
    with pytest.raises(data.DataError, match=r"d: 1 prompt\(s\) do not fit .* \(row 1: "):
        prompts_lib.check_context(tok, [short, {"problem": "2" * 300, "answer": "2"}], "", 256, 10, "d")


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
