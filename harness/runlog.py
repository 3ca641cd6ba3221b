"""What a run leaves for the people watching it (docs/reference.md, "What a run leaves"): samples,
curves.png; where a result came from.
"""
import json
import os
import platform
import shlex
import subprocess
from datetime import datetime, timezone

from harness.files import appending, read_jsonl, replacing

TEXT_CHARS = 2000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
PANELS = (  # (title, metrics.jsonl keys); eval_* keys come from the held-out rows
    ("reward", ("reward",)),
    ("accuracy", ("accuracy", "eval_accuracy")),
    ("calibration reward and signal fraction", ("margin", "brier", "signal_frac", "eval_margin", "eval_brier")),
    ("probe BCE", ("probe_bce", "eval_probe_bce")),
    ("probe calibration", ("probe_ece", "eval_probe_ece", "eval_probe_auroc")),
    ("response length (tokens)", ("len_mean",)),
)
# ECE and AUROC share the probe's panel but point opposite ways: each line says which way is good
LABELS = {"probe_bce": "probe_bce (in-sample)", "probe_ece": "probe_ece (in-sample; lower is better)",
          "eval_probe_ece": "eval_probe_ece (lower is better)",
          "eval_probe_auroc": "eval_probe_auroc (higher is better)"}


def clip(text, cap=TEXT_CHARS):   # text, or its head and tail with the number of characters cut
    if text is None or len(text) <= cap:
        return text
    half = cap // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def pick(step, n, **columns):
    """Rows {step, column: value} of n trajectories spread over the batch (columns: equal-length
    lists); strings clipped, floats rounded to 4 places."""
    size = len(next(iter(columns.values()), []))
    if n <= 0 or size == 0:
        return []
    m = min(n, size)
    idx = sorted({round(i * (size - 1) / max(m - 1, 1)) for i in range(m)})
    return [dict(step=step, **{k: _tidy(v[i]) for k, v in columns.items()}) for i in idx]


def _tidy(v):
    if isinstance(v, str):
        return clip(v)
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, (list, tuple)):
        return [_tidy(x) for x in v]
    return v


def append_jsonl(path, rows):
    if rows:
        with appending(path) as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300   # not NaN, inf or huge


def plot_curves(run_dir):
    """Draw PANELS from RUN/metrics.jsonl into RUN/curves.png; returns its path."""
    rows = [{k: v for k, v in r.items() if _number(v)}
            for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                held_out = key.startswith("eval_")
                ax.plot(*zip(*pts), "o--" if held_out else "-", markersize=4, label=LABELS.get(key, key))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{os.path.basename(os.path.abspath(run_dir))}  (dashed: held-out checks)", fontsize=11)
    fig.tight_layout()
    path = os.path.join(run_dir, "curves.png")
    with replacing(path, "wb") as f:
        fig.savefig(f, dpi=72, format="png")
    plt.close(fig)
    return path


def git_commit():   # the project's commit, "+dirty" when tracked files differ; or "unknown"
    try:
        run = lambda *a: subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True,  # noqa: E731
                                        timeout=10, check=True).stdout.strip()
        sha = run("rev-parse", "HEAD")
        return sha + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(argv, device):
    """Where a result comes from: commit, versions, UTC date, command line, device."""
    import torch
    import transformers
    name = str(device)
    if name.startswith("cuda") and torch.cuda.is_available():
        name = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return dict(git_commit=git_commit(), torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(shlex.quote(a) for a in argv), device=name)
