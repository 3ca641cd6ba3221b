"""The pre-registered study's records (evaluation/study.py): one path-free file per finished variant
and seed, OUT/records/VARIANT-seedS.json, with the numbers its table reads, the commit it ran at and
the trained model's hash. reproduce.py writes one when a job's training and evaluations are done and
skips a job whose record was made with the same arguments and warm start (by content), so a record
copied into another machine's OUT/records/ stands for its job there: a study longer than one sitting
runs a few seeds at a time, its records carried along, and its table is written from all of them.
"""
import json
import os

import data
from evaluation import comparison, mechanism
from evaluation.report import clean
from harness import files, runlog
from harness.files import UserError


def numbers(job):
    """What the table reads of one finished job: dict(train, eval, eval-released: {part: {key: x}},
    readouts: {part: {key: x}}), from its run and evaluation folders."""
    label, ident = comparison.model_label(job["run"]), comparison.model_ident(job["run"])
    got = dict(train=comparison.training_stats(job["run"]))
    for e in job["evals"]:
        entry = comparison.eval_entry(e["dir"], label, ident)
        if entry is None:
            raise UserError(f"{e['dir']}/results.json holds no complete toy results for {label}: run the command again")
        benches = {b: {k: entry["benchmarks"][b][k] for _, k in comparison.KEYS} for b in data.TOY_BENCHMARKS}
        got[e["folder"]] = dict(benches, Overall=comparison.overall(benches))
        if e["folder"] == "eval":   # the matched fit's (study.MATCHED)
            got["readouts"] = mechanism.readouts(mechanism.of_evaluation(e["dir"], entry))
    return got


def _portable(words):
    """A command's words with the values of --out and --model (this machine's paths) left out."""
    return [w for i, w in enumerate(words) if i == 0 or words[i - 1] not in ("--out", "--model")]


def made_with(args, job):
    """What a record must have been made with to stand for this job on any machine: the variant and
    seed, the train.py and evaluate.py arguments without paths, and the warm start by content."""
    base = job["train"][job["train"].index("--model") + 1]
    return dict(variant=job["variant"], seed=job["seed"], base=files.identity(base),
                train=_portable(job["train"] + args.train_args),
                evals=[_portable(e["cmd"] + args.eval_args) for e in job["evals"]])


def path(args, job):
    return os.path.join(args.out, "records", f"{job['variant']}-seed{job['seed']}.json")


def read(args, job):
    """The job's record (dict: made_with, numbers, git_commit, date, model) when OUT/records holds one
    made with this job's settings, else None: the job is run (or found done in its folders) again."""
    where = path(args, job)
    try:
        with open(where, encoding="utf-8") as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: not a study record ({files.first_line(e)}): remove it to run the job again") from None
    return rec if isinstance(rec, dict) and rec.get("made_with") == json.loads(json.dumps(made_with(args, job))) else None


def write(args, job):
    """Record a finished job's numbers in OUT/records (a few KB, no path): copied into another
    machine's OUT/records, it stands for the job there, so a study can be run over several machines
    or sessions and its table written from all of their records."""
    prov = runlog.provenance(["reproduce.py"], device="cpu")
    os.makedirs(os.path.dirname(path(args, job)), exist_ok=True)
    files.write_json(path(args, job), clean(dict(
        made_with=made_with(args, job), numbers=numbers(job), git_commit=prov["git_commit"], date=prov["date"],
        model=comparison.model_ident(job["run"]).partition("#")[2])))
