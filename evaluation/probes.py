"""Which probe a model's confidence reads (get_probe): the run's own probe.pt, or the post-hoc probe
(evaluation/posthoc.py) fitted on questions no evaluated benchmark holds, with the protocol of
evaluate.py's flags, and cached in its --out.
"""
import os
import sys

import data
import probe as probe_lib
import toy
from evaluation import posthoc
from evaluation.benchmarks import REAL, TOY, run_config, settings
from evaluation.samples import digest, model_id
from harness import checkpoint
from harness.files import UserError

TOY_SOURCES = [f"{name}:test" for name in data.TOY_BENCHMARKS]   # the post-hoc probe fits on toy train
TOY_FITS = ("toy", "toy-pooled")   # --probe-data for the toy world (toy_fit_rows)


def default_confidence(name):
    """The paper's probe rows use the post-hoc probe (Base, GRPO and RLCM alike): the default for
    every model, the toy world included."""
    return "probe-posthoc"


def get_probe(source, model, tok, label, path, out_dir, args, close_id, loaded=(), prompt=(None, None)):
    """(probe or None, post-hoc report or None) for a confidence source; post-hoc probes are cached in
    OUT, one file per model (its label and a hash of model_id)."""
    if source == "probe":
        if not os.path.isfile(os.path.join(path, "probe.pt")):
            raise UserError(f"{label} has no probe.pt: use --confidence probe-posthoc, logits or verbal")
        with checkpoint.reading(os.path.join(path, "probe.pt")):
            return probe_lib.load(os.path.join(path, "probe.pt"))[0], None
    if source != "probe-posthoc":
        return None, None
    # fit data: the toy's train split, or the RL set (released: lead_80), less any evaluated problem
    toy_only = all(source in TOY_SOURCES for *_, source in loaded)
    src = args.probe_data or ("toy" if toy_only else "deepscaler")
    is_toy = src in TOY_FITS
    w = TOY if is_toy else REAL
    s = settings("toy" if is_toy else src, args)
    if is_toy:
        pool, instruction = toy_fit_rows(src), toy.INSTRUCTION
    else:
        pool, instruction = data.load_rows(src, lcb_release=args.lcb_release), data.instruction_for(src)
    instruction = instruction if prompt[0] is None else prompt[0]
    seen = {r["problem"] for _, rows, _, _ in loaded for r in rows}
    # toy-pooled: the released fit's size from each benchmark (80 x 3), so each is fitted on as many as `toy` alone is
    size = w["probe_questions"] * (len(data.TOY_BENCHMARKS) if src == "toy-pooled" else 1)
    rows = [r for r in pool if r["problem"] not in seen][:args.probe_questions or size]
    if not rows:
        raise UserError(f"--probe-data {src}: all its {len(pool)} questions are in the evaluated benchmarks, so "
                        "no fit questions are left: pass other --probe-data")
    # the toy's forced answers stop at the newline that ends its answer, before the boxes it writes after
    protocol = dict(n=args.probe_samples or w["probe_samples"], max_new_tokens=s["max_new_tokens"],
                    temperature=args.temperature, top_p=args.top_p, every=s["every"],
                    count=args.posthoc_budgets or w["posthoc_budgets"], k=s["forced_k"], suffix=s["suffix"],
                    close=args.forced_close, stop=["\n"] if is_toy else [], copy_natural=True,
                    lead="" if is_toy else posthoc.EVAL_LEAD, gate=s["gate"], epochs=100, patience=30, batch=64,
                    val_frac=0.2, seed=42, fit=args.posthoc_fit,
                    **({"grader": "code"} if s.get("grader") == "code" else {}),
                    **({"tokens": "text"} if args.posthoc_tokens == "text" else {}))
    print(f"post-hoc probe for {label}: {len(rows)} {src} questions ...", file=sys.stderr)
    prb, report = posthoc.posthoc_probe(
        os.path.join(out_dir, f"posthoc_probe_{label}_{digest(model_id(path), 8)}".replace("/", "_")), model, tok,
        rows, instruction, close_id, protocol, batch_size=s["score_batch"], rows=s["rows"], system=prompt[1])
    return prb, report and dict(report, data=src)   # (None, None) on a worker other than rank 0


def toy_fit_rows(src):
    """The post-hoc probe's toy fit questions: `toy`, RL's train split (as released), or `toy-pooled`,
    the train splits of every toy benchmark in turn, so ECE measures what the state says about
    correctness rather than the gap between the fit set's accuracy and a benchmark's."""
    if src == "toy":
        return data.load_rows("toy", split="train")
    splits = [data.load_rows(name, split="train") for name in data.TOY_BENCHMARKS]
    return [row for turn in zip(*splits) for row in turn]


def run_fractions(path):
    """The truncation fractions a run trained its probe at (its config.json), else the default."""
    return tuple(run_config(path).get("budgets") or (0.25, 0.5, 0.75))
