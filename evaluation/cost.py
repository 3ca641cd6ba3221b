"""What the pre-registered study (evaluation/study.py) will cost: the trainings and evaluations it
still has to do and their estimated CPU and wall time, from the sizes they will run with and the study's
own measured timings. `reproduce.py --study` prints it before it starts."""
import os

import data
import evaluate
import toy
from evaluation import benchmarks, comparison, records
import config
from harness import checkpoint

# Seconds on 2 CPU cores at --jobs 2 (one thread a job), measured on the study's own seeds 0-3 at
# c4fd32c (2026-12-02): a training of 45 steps x 16 x 8 rollouts of up to 72 tokens took 130-205 s, an
# evaluation of 3 x 2000 samples with its post-hoc fit (80 x 8 rollouts) 275-340 s with the matched fit
# and 210-290 s with the released one: 170 s and 280 s, the evaluation's split between the samples and
# the fit as on the earlier `sum` world, where one without a fit took 28 s and one with a fit 100.
# (An earlier estimate from seed 1 alone, 150 s and 180 s, was about 1.5x under what the study took.)
# CPUs differ by more: the machine that ran seeds 4-7 took 56-95 s and 66-153 s, about 2.5x under these.
ROLLOUT_TOKEN_S = 170 / (45 * 16 * 8 * 72)  # a training's, per rollout token (labels, probe, update included)
SAMPLE_S = 280 * 0.28 / 6000                # an evaluation's, per sample
FIT_ROLLOUT_S = 280 * 0.72 / (80 * 8)       # a post-hoc fit's, per rollout (its forced answers included)


def estimate(trainings, evaluations, jobs, cores=None):
    """(CPU seconds, wall seconds) of trainings [(steps, rollouts a step, max new tokens)] and evaluations
    [(samples, post-hoc fit rollouts)] run --jobs at a time on `cores` (default: this machine's).
    The default study, 56 trainings of 45 x 128 x 72 and 112 evaluations of 6000 + 640: 40,880 s."""
    cpu = (sum(steps * rollouts * tokens * ROLLOUT_TOKEN_S for steps, rollouts, tokens in trainings)
           + sum(samples * SAMPLE_S + fit * FIT_ROLLOUT_S for samples, fit in evaluations))
    return cpu, cpu / max(1, min(jobs, cores or os.cpu_count() or 1))


def duration(seconds):
    """3600 -> "1.0 h", 150 -> "2.5 min"."""
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"


def summary(args, work, todo, jobs):
    """One line: the trainings and evaluations of the study still to do and their estimated time
    (estimate), from the sizes they will run with."""
    trainings, evaluations = [], []
    for j in work:
        how = todo[j["name"]]
        if records.read(args, j) is not None:
            continue
        if how is not None:
            cfg = config.resolve_args(how)
            ckpt = "--resume" in how and checkpoint.latest_checkpoint(j["run"], comparison.quiet, resume=True)
            left = cfg["steps"] - (checkpoint.step_of(ckpt) if ckpt else 0)
            trainings.append((left, cfg["prompts_per_step"] * cfg["group_size"], cfg["max_new_tokens"]))
        label = comparison.model_label(j["run"]) if how is None else None
        for e in j["evals"]:
            cmd = e["cmd"] + args.eval_args
            entry = label and comparison.eval_entry(e["dir"], label, comparison.model_ident(j["run"]))
            if not entry or not comparison.made_with(entry, cmd):
                ev = evaluate.parse_args(cmd)
                questions = min(ev.limit or toy.N_TEST, toy.N_TEST)
                fit = (ev.probe_questions or benchmarks.TOY["probe_questions"]) * (ev.probe_samples or benchmarks.TOY["probe_samples"])
                evaluations.append((len(data.TOY_BENCHMARKS) * questions * (ev.n_samples or benchmarks.TOY["n"]), fit))
    cpu, wall = estimate(trainings, evaluations, jobs)
    return (f"study: {len(trainings)} of {len(work)} trainings and {len(evaluations)} of "
            f"{sum(len(j['evals']) for j in work)} evaluations to do: about {duration(cpu)} of CPU, "
            f"{duration(wall)} at --jobs {jobs} on {os.cpu_count()} cores (estimated from the study's "
            "measured timings, scaled by steps, rollouts, tokens and samples: evaluation/cost.py)")
