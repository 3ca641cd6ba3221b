"""What identifies a model's samples (model_id, model_label, filed_label, sample_key), and the
samples file evaluate.py appends to (read_samples, own_rows); one writer per output folder (hold).
"""
import hashlib
import json
import os
import sys
from contextlib import ExitStack

from evaluation.report import read_results
from harness import files
from harness.checkpoint import ALIASES
from harness.runfolder import check_out

LOCKS = ExitStack()  # the lock of every output folder written, held until evaluate.main() ends


def run_dir(path):
    """RUN for RUN/checkpoints/step_*, else None."""
    parent = os.path.dirname(os.path.abspath(path))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None


def model_label(name, path):
    """Short stable name used in samples.jsonl and tables: 'toy', alias, 'run/step_000010', dir name."""
    if name == "toy" or name in ALIASES or not os.path.isdir(path):
        return name
    run = run_dir(path)
    base = os.path.basename(os.path.abspath(path))
    return f"{os.path.basename(run)}/{base}" if run else base


def model_id(path):
    """"FOLDER#HASH", its resolved folder and content (harness/files.identity: a run trained
    again in place is another model); else its hub id."""
    return f"{os.path.realpath(path)}#{files.identity(path)}" if os.path.isdir(path) else path


def _folder(ident):
    return ident.partition("#")[0]


def digest(obj, size=16):
    """A short hash of a JSON value: the keys of samples, their questions and post-hoc probe files."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:size]


def filed_label(label, ident, out_dir):
    """The name a model is filed under in OUT: its label, or label@HASH where OUT's results.json
    files another model under it (a/model evaluated, then b/model)."""
    entry = read_results(out_dir).get(label)
    if entry is None or entry.get("model_id") == ident:
        return label
    if "model_id" not in entry:
        print(f"{os.path.join(out_dir, 'results.json')}: the entry of {label} has no model identity (an "
              "older version): it is evaluated again and replaced", file=sys.stderr)
        return label
    if isinstance(entry["model_id"], str) and _folder(entry["model_id"]) == _folder(ident):
        print(f"{os.path.join(out_dir, 'results.json')}: the entry of {label} is of the model that was in "
              f"{_folder(ident)} before (trained again or replaced since): it is evaluated again and replaced",
              file=sys.stderr)
        return label
    return f"{label}@{digest(ident, 8)}"


def default_out(name, path):
    run = run_dir(path) if os.path.isdir(path) else None
    return os.path.join(run, "eval") if run else os.path.join("eval_out", model_label(name, path).replace("/", "_"))


def _count(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_sample(r):
    """A row as evaluate.py writes it: names, indices >= 0, correct 0/1, a confidence in [0, 1], and
    with a `key` what the summaries read (rows without one are never counted)."""
    conf = r.get("confidence")
    ok = (isinstance(r.get("model"), str) and isinstance(r.get("benchmark"), str) and _count(r.get("question"))
          and _count(r.get("sample")) and r.get("correct") in (0, 1) and isinstance(conf, (int, float))
          and not isinstance(conf, bool) and 0 <= conf <= 1)
    return ok and ("key" not in r or (isinstance(r["key"], str) and isinstance(r.get("q"), str)
                                      and "answer" in r and isinstance(r["answer"], (str, type(None)))
                                      and _count(r.get("length")) and isinstance(r.get("checkpoints", []), list)))


def read_samples(path):
    """Rows of samples.jsonl; a last line cut by a kill is dropped from the file with a message, any
    other line that is not a sample (is_sample) is one error naming the file and the line."""
    return files.read_jsonl(path, valid=is_sample)


def question_ids(rows):
    """A hash of each question's text and gold: a sample counts only for the question it was made for."""
    return [digest([r["problem"], r["answer"]], 12) for r in rows]


def ours(r, key, qids):
    """Whether a sample row was made with `key` for the question now at its index (qids: question_ids)."""
    return r.get("key") == key and r["question"] < len(qids) and r["q"] == qids[r["question"]]


def own_rows(samples, key, rows, n):
    """The rows of `samples` made with `key` for these rows, once per (question, sample): a copied
    line (two shards' files joined with cat) counts once, and a question edited since is sampled again."""
    qids, mine = question_ids(rows), {}
    for r in samples:
        if ours(r, key, qids) and r["sample"] < n:
            mine.setdefault((r["question"], r["sample"]), r)
    return list(mine.values())


def sample_key(ident, source, s, args, prompt, conf_kw):
    """The key of one model's samples of one benchmark: the model, the benchmark's source and every
    setting that changes a sample's draw, grade or confidence (the probe's weights included). A
    resume reuses its own key's rows only; other settings sample anew beside the old rows, which
    count again when their settings come back (a sweep over seeds can share one --out)."""
    prb = conf_kw["prb"]
    weights = prb and [[k, hashlib.sha256(v.detach().float().cpu().numpy().tobytes()).hexdigest()]
                       for k, v in prb.state_dict().items()]
    return digest(dict({k: v for k, v in conf_kw.items() if k != "prb"}, model=ident, benchmark=source,
                       n=s["n"], max_new_tokens=s["max_new_tokens"], gate=s["gate"], temperature=args.temperature,
                       top_p=args.top_p, seed=args.seed, prompt=prompt, probe=weights))


def hold(out_dir):
    """One writer per output folder: its lock is taken before anything is written there."""
    check_out(out_dir)
    key = os.path.realpath(out_dir)
    if key not in HELD:
        LOCKS.enter_context(files.locked(out_dir, "evaluation"))
        HELD.add(key)


HELD = set()
