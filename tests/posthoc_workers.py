"""Run by test_eval_parallel.py: the toy model's post-hoc probe fit (evaluation/confidence.py), in one
process or under torchrun as evaluate.py's workers. Writes OUT.rank{R}.json (the generate chunks,
the rollouts of each forced-answer call, rollouts scored and forced answers graded by this rank,
whether it fitted the probe), and from rank 0 the probe (OUT_probe.pt) and the data it was fitted
on (OUT.data.pt)."""
import json
import sys

import torch

import data
import rollout
import toy
from harness import checkpoint
from harness.parallel import RANK, teardown

out = sys.argv[1]
work = dict(chunks=[], forced=[], scored=0, graded=0)
generate = rollout.generate


def counted_generate(model, tok, prompts, n=1, batch_size=None, chunks=None, **kw):   # which chunks this rank ran
    count = -(-len(prompts) // (batch_size or len(prompts)))
    work["chunks"].append([count, list(range(count) if chunks is None else chunks)])
    return generate(model, tok, prompts, n, batch_size=batch_size, **({} if chunks is None else {"chunks": chunks}),
                    **kw)


rollout.generate = counted_generate
import label  # noqa: E402
forced_answers = label.forced_answers


def counted_forced(model, tok, prompts, *a, **kw):   # the rollouts this rank forced answers from
    work["forced"].append(len(prompts))
    return forced_answers(model, tok, prompts, *a, **kw)


label.forced_answers = counted_forced
from evaluation import benchmarks, confidence  # noqa: E402  (after the counters are in place)
features = confidence.features


def counted_features(model, prompts, *args):
    work["scored"] += len(prompts)
    return features(model, prompts, *args)


confidence.features = counted_features

matched = confidence.answers_match
confidence.answers_match = lambda *a: work.__setitem__("graded", work["graded"] + 1) or matched(*a)
fit = confidence.fit_posthoc


def kept_fit(x, y, g, *a, **kw):
    torch.save(dict(x=x, y=y, g=g), out + ".data.pt")
    return fit(x, y, g, *a, **kw)


confidence.fit_posthoc = kept_fit
benchmarks.setup()
torch.set_num_threads(1)
model, tok = checkpoint.load_model("toy")
model.eval()
rows = data.load_rows("toy", split="train")[:6]
protocol = dict(n=2, max_new_tokens=48, temperature=0.6, top_p=1.0, every=8, count=16, k=4,
                suffix=confidence.EVAL_SUFFIX, close="think", stop=[], copy_natural=True, lead="", gate="none",
                epochs=100, patience=30, batch=64, val_frac=0.2, seed=42)
close_id = tok.convert_tokens_to_ids("</think>")
# 12 rollouts in calls of 4 prompts (2 calls), scored 5 at a time (3 batches), forced answers from the rollouts
# that ask any (rows 8, k 4: 2 forced prompts a call)
prb, report = confidence.posthoc_probe(out + "_probe", model, tok, rows, toy.INSTRUCTION, close_id, protocol,
                                    batch_size=5, rows=8)
work["fitted"] = prb is not None and report is not None
with open(f"{out}.rank{RANK}.json", "w") as f:
    json.dump(work, f)
teardown(finished=True)  # each rank waits for the others before closing its connections
