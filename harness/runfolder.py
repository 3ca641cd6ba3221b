"""A training run's folder: one writer at a time, resume from its last complete checkpoint, atomic
checkpoints, and the exit codes of train.py (layout: docs/reference.md, "What a run leaves").

Exit codes: 2 a user error (one line "error: ..."), 3 a numeric fault (non-finite loss or gradient:
the last good checkpoint is untouched), 130 Ctrl-C (one line saying how to continue).
"""
import json
import os
import sys
from contextlib import ExitStack, contextmanager

import torch

from harness import checkpoint as ckpt_lib, files, lora
from harness.files import UserError
from harness.parallel import MASTER, all_gather, load_optimizer, teardown

LOCKS = ExitStack()  # the run folder's lock, released by exit_codes() however the run ends
LOGS = ("metrics.jsonl", "samples.jsonl", "heldout.jsonl")
MADE = []  # the run folder this process created (RunFolder.lock), for exit_codes' clean-up


def hold_lock(out, new=False):
    """Rank 0 holds OUT/lock until the run ends. new: the folder was absent at the start; a run found
    there now is refused."""
    err = None
    if MASTER:
        try:
            LOCKS.enter_context(files.locked(out, "training run"))
            found = [f for f in ("config.json", "checkpoints") if os.path.lexists(os.path.join(out, f))]
            if new and found:
                raise UserError(f"{out} was taken by another run while this one loaded (it holds {found[0]}): "
                                f"pass --resume {out} to continue that run, or another --out")
        except UserError as e:
            err = str(e)
    err = all_gather(err)[0]
    if err:
        raise UserError(err)


class RunFolder:
    """cfg["out"] and the checkpoint this run starts from (None: a new run)."""

    def __init__(self, cfg, say, data_digest):
        self.out, self.say = cfg["out"], say
        self.metrics, self.samples, self.heldout = (os.path.join(self.out, f) for f in LOGS)
        self.existed = all_gather(os.path.isdir(self.out))[0]
        if self.existed:  # locked before its checkpoints are read
            hold_lock(self.out)
        self.check_data(cfg, data_digest)
        self.ckpt = ckpt = ckpt_lib.latest_checkpoint(self.out, say=say, resume=True)
        if cfg["resume"] and ckpt is None:
            raise UserError(f"--resume {self.out}: the run has no complete checkpoint; start it again "
                            "without --resume")
        if ckpt and not cfg["resume"]:
            raise UserError(f"{self.out} already holds a run: pass --resume {self.out} to continue it, "
                            "or another --out")
        self.done = bool(ckpt) and ckpt_lib.step_of(ckpt) >= cfg["steps"]
        if self.done:
            say(f"{self.out} is at step {ckpt_lib.step_of(ckpt)} already (--steps {cfg['steps']}): "
                "nothing to train; pass a larger --steps")

    def check_data(self, cfg, digest):
        """A --data file changed since the run began is refused on resume (its cursor reads other rows)."""
        now = all_gather(digest(cfg["data"]) if MASTER else None)[0]
        saved, cfg["data_sha256"] = cfg.get("data_sha256"), now
        if cfg["resume"] and saved and saved != now:
            raise UserError(f"--resume {self.out}: {cfg['data']} changed since the run began (sha256 {saved[:12]} "
                            f"in config.json, now {(now or 'no file')[:12]}): put the run's data back, or start "
                            "a new run with another --out")

    def lock(self):
        """A new folder is locked only once the data and the model are known to load."""
        if not self.existed:
            hold_lock(self.out, new=True)
            if MASTER:
                MADE.append(self.out)

    def start(self, cfg):
        """A new run: config.json and empty logs."""
        if MASTER:
            os.makedirs(self.out, exist_ok=True)
            files.write_json(os.path.join(self.out, "config.json"), cfg)
            for path in (self.metrics, self.samples, self.heldout):
                with files.replacing(path):
                    pass

    def restore(self, cfg, policy, opt, sched, load_probe):
        """(probe, probe_opt, step, cursor), the checkpoint's optimizer, scheduler and RNG state loaded."""
        ckpt = self.ckpt
        with ckpt_lib.reading(os.path.join(ckpt, "state.pt")):
            # mmap: only rank 0 reads the optimizer state (load_optimizer broadcasts it)
            state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=True, mmap=True)
            load_optimizer(policy, opt, state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            step, cursor = state["step"], state["cursor"]
        with ckpt_lib.reading(os.path.join(ckpt, "probe.pt")):
            probe, probe_opt = load_probe(os.path.join(ckpt, "probe.pt"), cfg["probe_lr"])
        ckpt_lib.set_rng_state(state["rng"])  # last: building the probe draws from torch's RNG
        ckpt_lib.apply_rates(opt, sched, cfg["lr"], probe_opt, cfg["probe_lr"])
        if MASTER:
            for path in (self.metrics, self.samples, self.heldout):
                files.truncate_metrics(path, step)
            changed = changes(read_config(self.out), cfg)
            if changed:
                files.write_json(os.path.join(self.out, "config.json"), {**cfg, "resume": None})
                self.say("changed on resume (written to config.json): " +
                         ", ".join(f"{k} {a} -> {b}" for k, a, b in changed))
        self.say(f"resuming {self.out} from step {step}")
        return probe, probe_opt, step, cursor

    def first_accuracy(self, cfg, n):
        """(step 0's held-out accuracy or None, whether it was of another set), for a resume's last line."""
        rows = files.read_jsonl(self.metrics) if MASTER else []
        first = next((r for r in rows if r.get("eval") and r.get("step") == 0), {})
        other = (first.get("eval_n", n), first.get("eval_data", cfg["eval_data"])) != (n, cfg["eval_data"])
        return first.get("eval_accuracy"), other

    def save(self, at, model, model_sd, tok, save_probe, state, keep):
        """Checkpoint `at` (save_checkpoint); state: state.pt's step, cursor, optimizer, scheduler."""
        if MASTER:
            def write(tmp):
                if lora.has_adapter(model):
                    lora.save(tmp, model, model_sd)
                else:
                    model.save_pretrained(tmp, state_dict=model_sd)
                tok.save_pretrained(tmp)
                save_probe(os.path.join(tmp, "probe.pt"))
                torch.save(dict(state, rng=ckpt_lib.rng_state()), os.path.join(tmp, "state.pt"))
            ckpt_lib.save_checkpoint(self.out, at, write, keep=keep)


def check_out(path, flag="--out", writer=None):
    """A folder we can create or write into: not a file, and its nearest existing parent writable.
    writer "train.py" or "evaluate.py": nor a folder of another kind whose files it would overwrite."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is a file, not a folder: pass a folder path")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {parent} is not writable; pass a folder you can write to")
    kind, shown = folder_kind(path) if writer and os.path.isdir(path) else ("empty", [])
    if kind not in TAKES.get(writer, ("empty",)):
        what = dict(run="is a training run's folder", model="is a model's folder", evaluation="is an "
                    "evaluation's folder", other="holds files and is no training run's folder")
        takes = ", or an evaluation's" if writer == "evaluate.py" else " (or resumes a run there)"
        fix = (f"evaluate into {os.path.join(path, 'eval')} (the default for --model {path}) or another "
               "folder" if kind == "run" else
               f"{writer} writes only into a new or empty folder{takes}; pass another {flag}")
        raise UserError(f"{flag} {path} {what[kind]} (it has {', '.join(shown[:3])}): {fix}")


# What each writer's --out may already be: train.py only its own runs (a resume, or a new run's
# refusal later), evaluate.py anything but a run or a model (a sweep may share a folder).
TAKES = {"train.py": ("empty", "run"), "evaluate.py": ("empty", "evaluation", "other")}


def folder_kind(path):
    """(kind, the names that show it) of a folder: run, model, evaluation, empty (but a lock) or other."""
    names = sorted(set(os.listdir(path)) - {files.LOCK})
    weights = [n for n in names if n.endswith((".safetensors", ".bin"))]
    run = ("metrics.jsonl", "checkpoints", "wandb_run.json")
    for kind, shown in (("run", [n for n in run if n in names]),
                        ("model", ["config.json", *weights] if weights and "config.json" in names else []),
                        ("evaluation", [n for n in ("samples.jsonl", "results.json") if n in names])):
        if shown:
            return kind, shown
    return ("other", names) if names else ("empty", [])


def read_config(run, flag="--resume"):
    """RUN/config.json as a dict, or one UserError line saying what is wrong with it."""
    path = os.path.join(run, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{flag} {run}: no run there (config.json missing); "
                        "pass the --out directory of an earlier run")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (ValueError, OSError) as e:
        raise UserError(f"{flag} {run}: {path} is unreadable ({type(e).__name__}: {e}); "
                        "restore it or start a new run") from None
    if not isinstance(saved, dict):
        raise UserError(f"{flag} {run}: {path} is not a JSON object; restore it or start a new run")
    return saved


def changes(saved, cfg):
    """[(key, saved value, new value)] for saved keys whose value differs in cfg."""
    skip = ("resume", "out", "trust_remote_code")
    return [(k, saved[k], cfg[k]) for k in saved if k in cfg and k not in skip and saved[k] != cfg[k]]


def interrupted(cfg):
    """The one line printed on Ctrl-C: where the run stands and how to continue it."""
    out = cfg and cfg["out"]
    ckpt = out and os.path.isdir(out) and ckpt_lib.latest_checkpoint(out, say=lambda m: None, resume=True)
    if not ckpt:
        return "interrupted before the first checkpoint: nothing to resume; run the command again"
    flag = " --trust-remote-code" if cfg["trust_remote_code"] else ""
    return (f"interrupted: {ckpt} is the last checkpoint; continue with: "
            f"python train.py --resume {out}{flag}")


def remove_unstarted():
    """A user error before the first step leaves no run folder: the one this process made goes if it
    holds only config.json and empty logs."""
    for out in filter(os.path.isdir, MADE):
        names = set(os.listdir(out))
        logs = [os.path.join(out, f) for f in LOGS if f in names]
        if names <= {"config.json", *LOGS} and not any(os.path.getsize(p) for p in logs):
            for name in names:
                os.remove(os.path.join(out, name))
            os.rmdir(out)


@contextmanager
def exit_codes():
    """train.py's main runs inside this: the exit codes above, the lock released and the process group
    torn down however it ends. Yields a dict whose "cfg" the Ctrl-C line reads."""
    state, stopped, user_error, finished = {}, False, False, False
    MADE.clear()  # a run in this process before (tests) is not this one
    try:
        yield state
        finished = True
    except UserError as e:   # data.DataError and probe.NotAProbe too
        print(f"error: {e}", file=sys.stderr)
        user_error = True
        sys.exit(2)
    except FloatingPointError as e:
        print(f"stopped: {e}; the last good checkpoint is left untouched", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:  # nothing new is finished or saved: the last checkpoint stays
        stopped = True         # the line is printed below, once the progress bar has closed
    finally:
        LOCKS.close()
        if user_error:
            remove_unstarted()
        teardown(finished)
    if stopped:
        if MASTER:
            print(f"\n{interrupted(state.get('cfg'))}", file=sys.stderr)
        sys.exit(130)
