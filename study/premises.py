"""Can RLCM's mechanism act in a toy world at all? Its premises, measured before any comparison.

    python -m study.premises                         # (i) and (ii) on the committed toy_base/
    python -m study.premises --run runs/toy          # and (iii) from RLCM runs' logs (repeatable)
    python -m study.premises --model RUN --parts i   # the mechanism after RL

Each line prints the measured number beside its threshold and PASS or FAIL; what each premise is
and why it matters: docs/toy-world.md.
"""
import argparse
import json
import os
import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

if not __package__:   # run as a file (python study/premises.py), Python puts study/ on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import label  # noqa: E402
import metrics  # noqa: E402
import prompts as prompts_lib  # noqa: E402
import toy  # noqa: E402
from evaluation.confidence import features, think_end  # noqa: E402
from study.mechanism import LINE, flagged, parse  # noqa: E402
from grade import is_correct  # noqa: E402
from harness.checkpoint import resolve_model  # noqa: E402
from rollout import generate  # noqa: E402


def on_path(problem, text):
    """Whether the last complete thinking line's total is the true sum of the terms so far (or no
    line is complete): two slips that cancel put a trace back on the path."""
    terms, body = toy.terms_of(problem), text.split("</think>")[0]
    lines = body.split("\n")[:-1]
    if not lines:
        return True
    m = LINE.match(lines[-1])
    return bool(m) and len(lines) < len(terms) and int(m[3]) == sum(terms[:len(lines) + 1])


def logistic(x_tr, y_tr, x_te, groups_tr, seed):
    """Probabilities on x_te from an L2 logistic regression on standardised x_tr, the L2 weight
    picked on a 25 % grouped validation split of the training problems."""
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd

    def fit(x, y, l2):
        w = torch.zeros(x.shape[1] + 1, requires_grad=True)
        opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")
        xb = torch.cat([x, torch.ones(len(x), 1)], 1)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(xb @ w, y) + l2 * (w[:-1] ** 2).sum()
            loss.backward()
            return loss
        opt.step(closure)
        return lambda z: torch.sigmoid(torch.cat([z, torch.ones(len(z), 1)], 1) @ w).detach()

    uniq = sorted(set(groups_tr))
    val = set(random.Random(seed).sample(uniq, max(1, len(uniq) // 4)))
    va = torch.tensor([g in val for g in groups_tr])
    best = min((1e-3, 1e-2, 1e-1), key=lambda l2: _bce(fit(x_tr[~va], y_tr[~va], l2)(x_tr[va]), y_tr[va]))
    return fit(x_tr, y_tr, best)(x_te)


def _bce(p, y):
    return torch.nn.functional.binary_cross_entropy(p.clamp(1e-6, 1 - 1e-6), y).item()


def held_out_auroc(x, y, groups, keep=None, splits=3):
    """Mean AUROC over `splits` random 70/30 splits by group (problem); keep: a mask of the test
    rows scored (all by default). None where a test part holds one class only."""
    x, y = x.float(), torch.tensor(y, dtype=torch.float32)
    uniq, out = sorted(set(groups)), []
    for s in range(splits):
        test = set(random.Random(s).sample(uniq, int(0.3 * len(uniq))))
        te = torch.tensor([g in test for g in groups])
        tr, te_keep = ~te, te if keep is None else te & torch.tensor(keep)
        if y[tr].min() == y[tr].max() or y[te_keep].min() == y[te_keep].max():
            continue
        p = logistic(x[tr], y[tr], x[te_keep], [g for g, t in zip(groups, tr.tolist()) if t], s)
        out.append(metrics.auroc(p.tolist(), y[te_keep].bool().tolist()))
    return sum(out) / len(out) if out else None


def line_end_probe(model, tok, world, n, seed=0):
    """(i) Teacher-forced traces with the world's slips: the last layer's (final-normed) state at the
    last digit of each line's total, probed for "this total is wrong"."""
    rng, w = random.Random(seed), toy.WORLDS[world]
    rows = toy.dataset("train", "toy")
    xs, ys, groups = [], [], []
    for q in range(n):
        problem = rng.choice(rows)["problem"]
        terms = toy.terms_of(problem)
        lines, totals = toy.trace(terms, rng, w)
        prompt = prompts_lib.chat_prompt(tok, problem, "")
        ids = prompt + tok.encode("".join(lines), add_special_tokens=False)
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        at = len(prompt)
        for i, line in enumerate(lines):
            head = f"{totals[i]}{terms[i + 1]:+d}={totals[i + 1]}"
            xs.append(hidden[at + len(head) - 1])
            ys.append(float(totals[i + 1] != totals[i] + terms[i + 1]))
            groups.append(q)
            at += len(line)
    return held_out_auroc(torch.stack(xs), ys, groups), sum(ys) / len(ys)


def surface_features(problems, ids, ends, texts):
    """Per sample: terms, response and thinking length in tokens, lines. The lengths leave out the `?`
    written (one token each), which is the legible signal itself, not a surface feature."""
    flags = [t.split("</think>")[0].count("?") for t in texts]
    return torch.tensor([[len(toy.terms_of(p)), len(r) - q, e - q, t.count("\n")]
                         for p, r, e, t, q in zip(problems, ids, ends, texts, flags)], dtype=torch.float32)


def end_of_thinking(model, tok, n, samples, seed=0):
    """(i) Per benchmark: accuracy, AUROC of the end-of-thinking probe, of surface features, and
    of the probe on trajectories with no flag written (fitted on all); the sampled rates of a flag
    after a wrong and after a right line (the mechanism's readout)."""
    close = tok.convert_tokens_to_ids("</think>")
    out = {}
    for name in toy.BENCHMARKS:
        rows = toy.dataset("test", name)[:n]
        asked = [prompts_lib.chat_prompt(tok, r["problem"], "") for r in rows]
        s = generate(model, tok, asked, n=samples, max_new_tokens=160, temperature=0.6, seed=seed, batch_size=64)
        prompts = [asked[i] for i in s.prompt_index]
        ends = [think_end(r, close) for r in s.ids]
        feats = torch.stack([f[0] for f in features(model, prompts, s.ids, [[e] for e in ends],
                                                    tok.pad_token_id, final_norm=True, batch_size=64)])
        correct = [float(is_correct(t, rows[i]["answer"])) for t, i in zip(s.texts, s.prompt_index)]
        surface = surface_features([rows[i]["problem"] for i in s.prompt_index], s.ids, ends, s.texts)
        unflagged = [not flagged(t) for t in s.texts]
        lines = [line for t, i in zip(s.texts, s.prompt_index) for line in parse(rows[i]["problem"], t)]
        wrong, right = [f for e, f in lines if e == "total"], [f for e, f in lines if e is None]
        out[name] = dict(accuracy=sum(correct) / len(correct),
                         flag_wrong=sum(wrong) / max(len(wrong), 1), flag_right=sum(right) / max(len(right), 1),
                         probe=held_out_auroc(feats, correct, s.prompt_index),
                         surface=held_out_auroc(surface, correct, s.prompt_index),
                         flag_only=held_out_auroc(torch.tensor([[float(not u)] for u in unflagged]), correct,
                                                  s.prompt_index),
                         probe_unflagged=held_out_auroc(feats, correct, s.prompt_index, keep=unflagged),
                         flagged=1 - sum(unflagged) / len(unflagged))
    return out


def forced_labels(model, tok, n, samples, seed=0):
    """(ii) Mean Y_b at cuts with no visible error before them (per cut: 25/50/75 %), off the path
    after a wrong total and back on it after slips that cancel; the share of trajectories with a Y=1
    and a Y=0 cut."""
    rows = toy.dataset("train", "toy")[:n]
    asked = [prompts_lib.chat_prompt(tok, r["problem"], "") for r in rows]
    s = generate(model, tok, asked, n=samples, max_new_tokens=160, temperature=0.8, seed=seed, batch_size=64)
    prompts = [asked[i] for i in s.prompt_index]
    cuts = [label.cuts_of(len(r)) for r in s.ids]
    golds = [rows[i]["answer"] for i in s.prompt_index]
    ys = label.mc_labels(model, tok, prompts, s.ids, cuts, golds, k=4, temperature=0.8, seed=seed)
    clean, slipped, recovered, both = [[], [], []], [], [], 0
    for r, bs, y, i in zip(s.ids, cuts, ys, s.prompt_index):
        both += any(v == 1 for v in y) and any(v == 0 for v in y)
        for j, (b, v) in enumerate(zip(bs, y)):
            text = tok.decode(r[:b], skip_special_tokens=True)
            errors = [e for e, _ in parse(rows[i]["problem"], text)]
            if "total" in errors and on_path(rows[i]["problem"], text):
                recovered.append(v)
            elif "total" in errors:
                slipped.append(v)
            else:
                clean[min(j, 2)].append(v)
    mean = lambda v: sum(v) / len(v) if v else None
    return dict(clean=[mean(c) for c in clean], clean_n=[len(c) for c in clean], slipped=mean(slipped),
                slipped_n=len(slipped),
                recovered=mean(recovered), recovered_n=len(recovered),
                signal=both / len(s.ids))


def run_stats(run):
    """(iii) From a run's metrics.jsonl: mean signal share and calibration share of |advantage| over
    its steps, and the first and last held-out accuracy."""
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r for r in rows if not r.get("eval")]
    evals = [r["eval_accuracy"] for r in rows if r.get("eval")]
    mean = lambda key: sum(r.get(key, 0.0) for r in steps) / max(len(steps), 1)
    return dict(signal=mean("signal_frac"), calib_share=mean("calib_adv_share"),
                acc_first=evals[0] if evals else None, acc_last=evals[-1] if evals else None)


def premise(name, value, op, threshold):
    """Print one premise's line (value, threshold, PASS or FAIL); True if it holds."""
    ok = value is not None and (value >= threshold if op == ">=" else value <= threshold)
    shown = "n/a" if value is None else f"{value:.3f}"
    print(f"{name:<72} {shown:>6}  {op} {threshold:<5} {'PASS' if ok else 'FAIL'}")
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a warm start or a trained run (default: the committed toy_base/)")
    p.add_argument("--world", default=toy.WORLD, choices=sorted(toy.WORLDS),
                   help="whose slips the teacher-forced traces of (i) have (default: the world's)")
    p.add_argument("--run", action="append", default=[], help="an RLCM run folder for (iii); repeat for several")
    p.add_argument("--n", type=int, default=300, help="questions per benchmark (i) and of RL's distribution (ii)")
    p.add_argument("--parts", default="i,ii,iii", help="which premises to measure (default: i,ii,iii)")
    p.add_argument("--json", help="also write every number to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)   # as the toy world runs (train.py): small matrices, one core is fastest
    torch.manual_seed(0)
    parts = set(args.parts.split(","))
    path = resolve_model(args.model or "toy")   # a run folder reads its latest checkpoint
    if parts - {"iii"}:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_kernels=False)
        tok = AutoTokenizer.from_pretrained(path)
    out, ok = {}, []
    if "i" in parts:
        with torch.no_grad():
            out["line_end"], wrong = line_end_probe(model, tok, args.world, 2 * args.n)
        ok.append(premise(f"(i)   line-end probe finds a wrong total (teacher-forced, {wrong:.0%} wrong)",
                          out["line_end"], ">=", 0.9))
        out["end"] = end_of_thinking(model, tok, args.n, 4)
    for name, r in out.get("end", {}).items():
        ok.append(premise(f"(i)   {name}: end-of-thinking probe AUROC (acc {r['accuracy']:.3f}, "
                          f"surface {r['surface'] or 0:.3f})", r["probe"], ">=", 0.65))
        ok.append(premise(f"(i)   {name}: end-of-thinking probe - surface features",
                          None if r["probe"] is None or r["surface"] is None else r["probe"] - r["surface"],
                          ">=", 0.0))
        print(f"      {name}: P(flag | wrong line) {r['flag_wrong']:.3f}, P(flag | right line) {r['flag_right']:.3f}; "
              f"{r['flagged']:.3f} of samples flag a line; probe AUROC on the others "
              f"{r['probe_unflagged'] if r['probe_unflagged'] is not None else float('nan'):.3f}; "
              f"AUROC of whether a `?` was written {r['flag_only'] if r['flag_only'] is not None else float('nan'):.3f}")
    if "ii" in parts:
        out["labels"] = lab = forced_labels(model, tok, args.n, 8)
        for j, (v, n) in enumerate(zip(lab["clean"], lab["clean_n"])):
            ok.append(premise(f"(ii)  mean Y_b before any error, cut {j + 1} of 3 ({n} cuts)", v, ">=", 0.8))
        ok.append(premise(f"(ii)  mean Y_b off the path, after a wrong total ({lab['slipped_n']} cuts)",
                          lab["slipped"], "<=", 0.1))
        shown = lambda v: "n/a" if v is None else f"{v:.3f}"
        print(f"      back on the path after slips that cancel: {shown(lab['recovered'])} ({lab['recovered_n']} "
              f"cuts); trajectories with a Y=1 and a Y=0 cut at T 0.8: {lab['signal']:.3f}")
    out["runs"] = {}
    for run in args.run:
        r, name = run_stats(run), os.path.basename(run.rstrip("/"))
        out["runs"][run] = r
        ok.append(premise(f"(iii) {name}: signal share", r["signal"], ">=", 0.25))
        ok.append(premise(f"(iii) {name}: calibration share of |advantage|", r["calib_share"], ">=", 0.15))
        ok.append(premise(f"(iii) {name}: held-out accuracy last - first",
                          None if r["acc_last"] is None else r["acc_last"] - r["acc_first"], ">=", 0.0))
    if not args.run and "iii" in parts:
        print("(iii) not measured: pass --run RUN (an RLCM run on this world)")
    print(f"premises: {sum(ok)} of {len(ok)} hold")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(ok) and ("iii" not in parts or args.run) else 1


if __name__ == "__main__":
    raise SystemExit(main())
