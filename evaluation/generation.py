"""One benchmark's samples (generate_benchmark): each (question, sample) missing from samples.jsonl is
generated in calls dealt out to the workers (evaluation/shard.py), graded, given its confidence
(evaluation/confidence.py) and appended, a call at a time, so that an interrupted evaluation resumes.
"""
import json
import sys

from tqdm import tqdm

import grade
import data
import rollout
from evaluation import confidence, shard
from evaluation.samples import own_rows, ours, question_ids, read_samples
from harness import sandbox
from harness.parallel import MASTER

GRADER = "math"   # evaluation grades with grade.is_correct: normaliser + math-verify


def generate_benchmark(model, tok, label, bench, rows, instruction, s, args, conf_kw, path, system=None,
                       form="box", key=None):
    """Sample, grade and score every (question, sample) of one benchmark not yet in `path` for
    `key` (sample_key), appending per call. s: the benchmark's settings; conf_kw:
    confidence.sample_confidences' arguments; form: grade.extract's ("box" or "tag").
    """
    qids = question_ids(rows)
    todo = shard.share(missing_samples(path, label, bench, rows, s["n"], key) if MASTER else None)
    bar = tqdm(total=len(rows) * s["n"], initial=len(rows) * s["n"] - sum(len(m) for _, m in todo),
               desc=f"{label} {bench}", file=sys.stderr, disable=not MASTER)

    def call_rows(chunk, m, out, conf, extras, golds):   # in the grading thread, while the next call generates
        answers, right = grade_call(out.texts, golds, bench, s, form)

        def texts(q, r):   # so that a grade can be read, and the mechanism's readouts need no model
            return {} if args.no_log_text else dict(problem=rows[q]["problem"], text=out.texts[r])
        return [json.dumps(dict(
            model=label, benchmark=bench, question=q, sample=missing[r % m], answer=answers[r],
            correct=int(right[r]), confidence=float(conf[r]), length=out.lengths[r], finish=out.finish[r],
            source=conf_kw["source"], key=key, q=qids[q], **texts(q, r), **extras[r])) + "\n"
            for r, (q, missing) in enumerate(c for c in chunk for _ in range(m))]

    with shard.Rounds(path, bar) as written:
        for chunk in shard.deal(calls(todo, s["batch"])):   # this worker's call of each round
            if chunk is None:
                written.add(None)
                continue
            m = len(chunk[0][1])
            prompts = [data.row_prompt(tok, rows[q], instruction, system) for q, _ in chunk]
            seed = args.seed * 1_000_003 + chunk[0][0] * 1009 + m
            out = rollout.generate(model, tok, prompts, n=m, max_new_tokens=s["max_new_tokens"],
                                   temperature=args.temperature, top_p=args.top_p, seed=seed,
                                   batch_size=len(prompts), decode=args.decode)
            golds = [rows[q]["answer"] for q, _ in chunk for _ in range(m)]
            conf, extras = confidence.sample_confidences(
                model=model, tokenizer=tok, prompts=[p for p in prompts for _ in range(m)], responses=out.ids,
                texts=out.texts, golds=golds, seed=seed + 1, batch_size=s["score_batch"], rows=s["rows"],
                **conf_kw)
            written.add(call_rows, chunk, m, out, conf, extras, golds)
    bar.close()


def missing_samples(path, label, bench, rows, n, key):
    """[(question, [sample indices not yet in `path` for key])] of the questions missing any."""
    have, qids = read_samples(path), question_ids(rows)
    done = {(r["question"], r["sample"]) for r in own_rows(have, key, rows, n)}
    todo = [(q, [j for j in range(n) if (q, j) not in done]) for q in range(len(rows))]
    todo = [t for t in todo if t[1]]
    other = sum(r["model"] == label and r["benchmark"] == bench and not ours(r, key, qids) for r in have)
    if todo and other:
        print(f"{path}: {other} rows of {label} on {bench} were sampled with other settings, for other "
              "questions or by an older version: not reused", file=sys.stderr)
    return todo


def calls(todo, size):
    """The generate calls of a benchmark, in order: runs of up to `size` questions of `todo` missing the
    same number of samples. A call's samples depend on all of its questions (evaluation/shard.py), so
    workers share calls, never questions."""
    out = []
    for q, missing in todo:
        if out and len(out[-1]) < size and len(out[-1][0][1]) == len(missing):
            out[-1].append((q, missing))
        else:
            out.append([(q, missing)])
    return out


def grade_call(texts, golds, bench, s, form):
    """(answers, right) of one call's responses."""
    if s.get("grader") == "code":   # the programs run in a bounded pool of sandboxed children
        return [sandbox.extract_code(t) for t in texts], sandbox.grade_many(
            [grade.code_job(t, g) for t, g in zip(texts, golds)])
    answers = [grade.rlcr_answer(t) if form == "tag" else grade.extract(t, GRADER, form) for t in texts]
    # GPQA's natural boxed answers are graded as released (no option letter read off them);
    # its RLCR answers and LogiQA's (the project's own protocol) by their letter
    letters = form == "tag" or bench != "gpqa"
    return answers, [natural_correct(t, a, g, form, s["gate"], letters) for t, a, g in zip(texts, answers, golds)]


def natural_correct(text, answer, gold, form="box", gate="thinking", letters=True):
    """The grade of a natural response: its answer matches the gold and, with gate="thinking"
    (released: natural_eval), its thinking holds a box (grade.boxed_in_thinking); gate="none", or an
    RLCR answer (form="tag"), the answer alone. letters: grade.answers_match's."""
    if form == "box" and gate == "thinking" and not grade.boxed_in_thinking(text):
        return False
    return grade.answers_match(answer, gold, GRADER, letters=letters)
