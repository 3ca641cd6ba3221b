"""The toy world's mechanism, read off evaluation samples without a model: does the policy flag its own
slips (`?` after a wrong line, docs/toy-world.md), and does its end-of-thinking confidence tell right
from wrong beyond the flags it wrote?

    readouts(of_evaluation(EVAL, entry))   # {benchmark: {flag_wrong, flag_right, auroc_unflagged, ...},
                                           #  "Overall": their means}; entry: EVAL/results.json's model
"""
import math
import os
import re

import metrics
import toy
from evaluation.samples import read_samples

LINE = re.compile(r"^(\d+)([+-]\d+)=(\d+)(\??)$")   # a thinking line, "8+7=14?": `?` flags a slip
READOUTS = ("flag_wrong", "flag_right", "auroc_unflagged")   # the per-model numbers, with their counts


def parse(problem, text):
    """Complete thinking lines of `text` checked against `problem`: a list of (error, flagged), where
    error is None for a right line and "total" for a wrong total (or a line that does not follow the
    written trace, which ends the reading).
    "3+5+7+2", "3+5=8\\n8+7=14?\\n14+2=16\\n16" -> [(None, False), ("total", True), (None, False)]."""
    terms, out = toy.terms_of(problem), []
    body = text.split("</think>")[0]
    prev = terms[0]
    for i, line in enumerate(body.split("\n")[:-1]):   # the last piece is not a complete line
        m = LINE.match(line)
        if not m or i + 1 >= len(terms) or int(m[1]) != prev or int(m[2]) != terms[i + 1]:
            out.append(("total", False))
            break
        total = int(m[3])
        out.append(("total" if total != prev + terms[i + 1] else None, m[4] == "?"))
        prev = total
    return out


def flagged(text):
    """Whether the thinking writes a `?` anywhere."""
    return "?" in text.split("</think>")[0]


def readouts(samples):
    """Per benchmark of `samples` (rows of samples.jsonl with problem, text, correct, confidence):
      flag_wrong       share of wrong lines (parse: error "total") followed by `?`; wrong_lines their count
      flag_right       share of right lines followed by `?`; right_lines their count
      auroc_unflagged  AUROC of the sample's confidence (--no-early-exit: the end of thinking's) as a
                       predictor of correctness, over the samples whose thinking writes no `?`; unflagged
                       their count
    None where there is nothing to count (or one class); "Overall": each number's unweighted mean over
    the benchmarks that have it, as evaluate.py's Overall."""
    out = {}
    for bench in dict.fromkeys(r["benchmark"] for r in samples):
        rows = [r for r in samples if r["benchmark"] == bench]
        lines = [line for r in rows for line in parse(r["problem"], r["text"])]
        wrong, right = [f for e, f in lines if e == "total"], [f for e, f in lines if e is None]
        quiet = [r for r in rows if not flagged(r["text"])]
        auc = metrics.auroc([r["confidence"] for r in quiet], [r["correct"] for r in quiet]) if quiet else math.nan
        out[bench] = dict(flag_wrong=sum(wrong) / len(wrong) if wrong else None, wrong_lines=len(wrong),
                          flag_right=sum(right) / len(right) if right else None, right_lines=len(right),
                          auroc_unflagged=None if math.isnan(auc) else auc, unflagged=len(quiet))
    means = {k: [b[k] for b in out.values() if b[k] is not None] for k in READOUTS}
    out["Overall"] = {k: sum(v) / len(v) if v else None for k, v in means.items()}
    return out


def of_evaluation(eval_dir, entry):
    """The samples behind one model's results.json entry (evaluate.py) in EVAL/samples.jsonl: the rows
    made with each benchmark's recorded key (its model, settings and probe), within its questions and
    samples, once each; rows of a version that kept no text are left out."""
    settings, rows = entry["settings"], {}
    for r in read_samples(os.path.join(eval_dir, "samples.jsonl")):
        s = settings.get(r["benchmark"])
        if s and r.get("key") == s["key"] and r["question"] < s["questions"] and r["sample"] < s["n"] and "text" in r:
            rows.setdefault((r["benchmark"], r["question"], r["sample"]), r)
    return list(rows.values())
