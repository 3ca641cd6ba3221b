"""Constants and plain functions the tests of commands share: small toy-run flags, a subprocess
train.py, the one line a refusal prints, a folder's bytes, a checkpoint's path, a full disk."""
import json
import os
import resource
import signal
import subprocess
import sys
from contextlib import contextmanager

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "40", "--eval-n", "8",
         "--eval-every", "0", "--gen-batch", "64"]
# SMALL with shorter responses and no held-out check: for refusals of damaged inputs
SMALL_NO_EVAL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "24", "--eval-n", "0",
                 "--gen-batch", "64"]
# A small post-hoc probe (released: 80 questions x 8 rollouts x 16 budgets, minutes on a CPU): these
# tests check locks, resume and refusals, which do not depend on the probe's size.
PROBE_SMALL = ["--probe-questions", "4", "--probe-samples", "2", "--posthoc-budgets", "2"]
EVAL_SMALL = ["--benchmarks", "toy", "--limit", "2", "--n-samples", "1", "--max-new-tokens", "24", *PROBE_SMALL]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONHASHSEED": "0"}


@pytest.fixture(scope="module", name="base_run")
def one_step_run(tmp_path_factory):
    """A 1-step toy run with its checkpoint (copy it before changing it): a module that imports this
    fixture gets it as `base_run`, in place of conftest's 2-step run."""
    import train
    run = str(tmp_path_factory.mktemp("base") / "run")
    train.main(["--steps", "1", "--out", run, *SMALL_NO_EVAL])
    return run


def one_line(capsys):
    """The one line on stderr (transformers' weight-loading progress bar aside)."""
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("Loading weights")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def one_line_past_bars(capsys):
    """The one line on stderr (progress bars aside)."""
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and "it/s]" not in x]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def refusal(capsys, main, argv):
    """The one error line main(argv) ends with on stderr as it exits 2, as bad input does (after
    progress, if any)."""
    capsys.readouterr()   # what ran before is not this command's
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines()
             if x.strip() and not ("it/s]" in x or "s/it]" in x or x.startswith("Loading weights"))]
    errors = [x for x in lines if x.startswith("error: ") or ": error: " in x]
    assert e.value.code == 2 and errors == lines[-1:] and "Traceback" not in err, (e.value.code, err)
    return lines[-1]


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


def sigint_default():
    """Children of a shell's background job start with SIGINT ignored; Ctrl-C tests need it live."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def write(path, content):
    with open(path, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)
    return str(path)


def jsonl(path, rows):
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def ckpt(run, step):
    return os.path.join(run, "checkpoints", f"step_{step:06d}")


@contextmanager
def file_size_limit(n):
    """Writes past n bytes in any file fail with EFBIG (Python ignores SIGXFSZ), like a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
