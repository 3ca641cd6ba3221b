"""What a run leaves for the people watching it (docs/reference.md, "What a run leaves"): samples,
curves.png, a tracker's mirror (--report-to); where a result came from."""
import json
import os
import platform
import shlex
import subprocess
from datetime import datetime, timezone

from harness.files import UserError, appending, read_json, read_jsonl, replacing, write_json

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
    m = min(n, size)   # n <= 0 or no rows: none
    idx = sorted({round(i * (size - 1) / max(m - 1, 1)) for i in range(m)})
    return [dict(step=step, **{k: _tidy(v[i]) for k, v in columns.items()}) for i in idx]


def _tidy(v):
    if isinstance(v, (list, tuple)):
        return [_tidy(x) for x in v]
    return clip(v) if isinstance(v, str) else round(v, 4) if isinstance(v, float) else v


def append_jsonl(path, rows):
    if rows:
        with appending(path) as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def _number(v):   # a plain number: not a bool, NaN, inf or huge
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300


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
            if pts:   # held-out (eval_) curves dashed
                ax.plot(*zip(*pts), "o--" if key.startswith("eval_") else "-", markersize=4,
                        label=LABELS.get(key, key))
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


def provenance(argv, device, world=1):
    """Where a result comes from: commit, versions, UTC date, command line, device, world size."""
    import importlib.metadata
    import torch
    import transformers
    name = str(device)
    if name.startswith("cuda") and torch.cuda.is_available():
        name = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    try:
        peft = importlib.metadata.version("peft")
    except importlib.metadata.PackageNotFoundError:
        peft = None
    return dict(git_commit=git_commit(), torch=torch.__version__,
                transformers=transformers.__version__, peft=peft, python=platform.python_version(),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                command=" ".join(shlex.quote(a) for a in argv), device=name, world_size=world)


TRACKERS = ("none", "wandb", "trackio")   # --report-to: both take wandb's init / log / finish


def check_tracker(kind):
    """UserError (one line) when --report-to's package is not installed, before any model loads."""
    import importlib.util
    if kind != "none" and importlib.util.find_spec(kind) is None:
        raise UserError(f"--report-to {kind}: the package {kind} is not installed: pip install "
                        f"{kind}, or pass --report-to none")


class Tracker:
    """--report-to wandb or trackio on rank 0: the run's config at init, each logged row mirrored
    once with its step. Its run id is kept in RUN/tracker.json: a resume continues the same run."""

    def __init__(self, kind, run_dir, cfg):
        import importlib
        import uuid
        self.lib = importlib.import_module(kind)
        path = os.path.join(run_dir, "tracker.json")
        saved = read_json(path) if os.path.isfile(path) else {}
        run_id = (saved.get("id") if saved.get("kind") == kind else None) or uuid.uuid4().hex[:12]
        name = os.path.basename(os.path.abspath(run_dir))
        project = os.environ.get("WANDB_PROJECT" if kind == "wandb" else "TRACKIO_PROJECT", "rlcm")
        if kind == "wandb":
            self.lib.init(project=project, name=name, id=run_id, resume="allow", config=cfg,
                          dir=run_dir)
        else:   # trackio resumes a run by its name
            self.lib.init(project=project, name=f"{name}-{run_id}", config=cfg, resume="allow")
        write_json(path, dict(kind=kind, id=run_id, project=project))

    def log(self, rows):
        for row in rows:
            self.lib.log({k: v for k, v in row.items() if _number(v) or isinstance(v, bool)},
                         step=row["step"])

    def finish(self):
        self.lib.finish()
