"""Evaluate models: accuracy, calibration (ECE, PCE, Brier, AUROC), reliability diagrams, and a use
of the confidence (conformal early exit).

    python evaluate.py --model runs/toy --benchmarks toy            # CPU, about a minute
    python evaluate.py --model toy --model runs/toy --benchmarks toy --confidence probe-posthoc
    python evaluate.py --model runs/toy --benchmarks toy --nproc 2  # 2 CPU workers: the same files
    python evaluate.py --model deepseek-r1-distill-qwen-7b --model runs/rlcm \\
        --benchmarks math500,aime24,aime25,amc23                    # one worker per GPU

Per model and benchmark (evaluate_model): graded samples with a confidence in --out/samples.jsonl
(resumable), metrics in --out/results.json and the table; protocol: docs/reference.md, "Evaluation".
"""
import argparse
import itertools
import json
import os
import sys

import torch
from tqdm import tqdm

import config
import data
import grade
import rollout
import toy
from evaluation import confidence
from evaluation.benchmarks import (
    HELD, LOCKS, Rounds, deal, default_out, digest, filed_label, given_samples, hold,
    load_benchmarks, model_id, model_label, own_rows, question_ids, read_responses, read_samples,
    rlcr_prompts, run_config, run_prompt, sample_key, settings, setup, share)
from evaluation.report import means, plot_reliability, report_uses, summarize, table, write_results
from harness import checkpoint, files, runlog, sandbox
from harness.checkpoint import ALIASES, check_out, resolve_model
from harness.files import UserError
from harness.parallel import MASTER, launch, teardown, worker_count

LIMITS = dict.fromkeys(("limit", "n_samples", "max_new_tokens", "batch_size", "every", "forced_k",
                        "probe_questions", "nproc"), (lambda v: v >= 1, ">= 1"))
LIMITS.update(temperature=(lambda v: v >= 0, ">= 0 (0: greedy)"), top_p=config.LIMITS["top_p"],
              seed=config.LIMITS["seed"], logit_temperature=(lambda v: v > 0, "> 0"))
GRADER = "math"   # evaluation grades with grade.is_correct: normaliser + math-verify


def evaluate_model(name, loaded, args):
    """Generate (resuming), score and summarize one model on every benchmark: (label, results)."""
    path = resolve_model(name)
    label, ident = model_label(name, path), model_id(path)
    out_dir = args.out or default_out(name, path)
    if MASTER and os.path.isdir(out_dir):   # a second writer stops before loading anything
        hold(out_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"   # trust_remote_code stays off
    model, tok = checkpoint.load_model(name, torch.bfloat16 if device == "cuda" else torch.float32)
    model = model.to(device).eval()
    prompt, run = run_prompt(path, args), run_config(path)
    own, system, form = prompt
    fractions = tuple(run.get("budgets") or (0.25, 0.5, 0.75))   # where the run's own probe is read
    for bench, rows, instruction, _ in loaded:   # refuses a too-long prompt or a failing template
        data.check_context(tok, rows, instruction if own is None else own, getattr(
            model.config, "max_position_embeddings", None), settings(bench, args)["max_new_tokens"],
            bench, say=lambda m: print(m, file=sys.stderr), system=system)
    if MASTER:   # rank 0 alone reads and writes the folder; the others get what they need from it
        hold(out_dir)   # a new folder is made only now that the model loads and the prompts fit
        label = filed_label(label, ident, out_dir)   # reads results.json: refuses a damaged one
    label = share(label)
    source = args.confidence
    think = tok.convert_tokens_to_ids("</think>")
    close_id = None if think is None or think == tok.unk_token_id else think
    # every worker makes a share of the post-hoc probe's data, rank 0 fits it once (posthoc_probe)
    got = confidence.get_probe(source, model, tok, label, path, out_dir, args, close_id, loaded,
                               prompt) if MASTER or source == "probe-posthoc" else None
    prb, report = share(got)   # a probe is on the CPU (probe.load, fit_posthoc): shared as it is
    samples = os.path.join(out_dir, "samples.jsonl")
    res = {"path": path, "model_id": ident, "confidence": source, "out": out_dir, "benchmarks": {},
           "settings": {}, "provenance": runlog.provenance(args.argv, device)}
    exits = source in ("probe", "probe-posthoc") and not args.no_early_exit
    for bench, rows, instruction, bench_source in loaded:
        s = settings(bench, args)
        instruction = instruction if own is None else own
        # no early exit on code: its forced answers at each checkpoint would be programs to run
        every = s["every"] if exits and data.kind(bench) != "code" else None
        conf_kw = dict(source=source, prb=prb, close_id=close_id, every=every, suffix=s["suffix"],
                       close=args.forced_close, fractions=fractions, forced_k=s["reanswer_k"],
                       budget=s["max_new_tokens"], reanswer=s["reanswer"],
                       logit_temperature=args.logit_temperature or run.get("temperature", 0.8))
        key = sample_key(ident, bench_source, s, args, [instruction, system, form], conf_kw)
        key = digest([key, args.given[bench]]) if args.given else key   # the texts are the samples
        generate_benchmark(model, tok, label, bench, rows, instruction, s, args, conf_kw, samples,
                           system, form, key)
        if not MASTER:
            continue
        b = summarize(own_rows(read_samples(samples), key, rows, s["n"]), seed=args.seed)
        res["benchmarks"][bench] = b
        window = " to ".join(data.lcb_window(args.lcb_release))
        release = {"release": f"{args.lcb_release} (contests {window})"} if bench == "lcb" else {}
        world = {"toy_world": toy.WORLD} if bench in data.TOY_BENCHMARKS else {}
        res["settings"][bench] = dict(
            s, confidence=source, grader=s.get("grader", GRADER), answer=form,
            temperature=args.temperature, **release, **world, top_p=args.top_p, seed=args.seed,
            questions=len(rows), instruction=instruction, system_prompt=system, key=key,
            benchmark_source=bench_source, benchmark_rows=digest(question_ids(rows)),
            bootstrap=dict(resamples=1000, unit="question", seed=args.seed))
        title = f"{label} | {bench} | {source}\nacc {b['acc']:.3f}  ECE {b['ece']:.3f}  n {b['n']}"
        png = f"reliability_{label}_{bench}.png".replace("/", "_")
        plot_reliability(b["reliability"], title, os.path.join(out_dir, png))
    if not MASTER:   # rank 0 writes the results
        return label, None
    res.update(means(res["benchmarks"]))   # the paper's Overall, and the math and OOD means
    if report is not None:
        res["posthoc_probe"] = report
    kept, res["mixed_settings"] = write_results(out_dir, label, res, lambda bench: dict(
        settings(bench, args), temperature=args.temperature, top_p=args.top_p, seed=args.seed))
    if kept:
        print(f"{os.path.join(out_dir, 'results.json')} keeps {label}'s earlier {', '.join(kept)} beside these "
              "(the same model, confidence and probe); its Overall is over all of them", file=sys.stderr)
    return label, res


def export_prompts(path, names, loaded, args):
    """--export-prompts: each row's prompt as generate_benchmark builds it (text after the chat
    template, and ids) and sampling settings, for another engine; --responses reads its samples."""
    if len(names) > 1:
        raise UserError("--export-prompts takes one --model: its template and run make the prompts")
    from transformers import AutoTokenizer
    model = resolve_model(names[0])   # a checkpoint holds its tokenizer, a LoRA one too
    tok, (own, system, _) = AutoTokenizer.from_pretrained(model), run_prompt(model, args)
    with files.replacing(path) as f:
        for bench, rows, instruction, _ in loaded:
            s = settings(bench, args)
            drawn = dict(n=s["n"], temperature=args.temperature, top_p=args.top_p, max_tokens=s["max_new_tokens"])
            for q, row in enumerate(rows):
                ids = data.row_prompt(tok, row, instruction if own is None else own, system)
                print(json.dumps(dict(benchmark=bench, question=q, prompt=tok.decode(ids),
                                      prompt_ids=ids, **drawn)), file=f)
    print(f"{path}: the prompts; sample them, then evaluate with the same flags and --responses (docs/reference.md)")


def generate_benchmark(model, tok, label, bench, rows, instruction, s, args, conf_kw, path,
                       system=None, form="box", key=None):
    """Sample, grade and score every (question, sample) of one benchmark not yet in `path` for
    `key` (sample_key), appending per call. s: the benchmark's settings; conf_kw:
    confidence.sample_confidences' arguments; form: grade.extract's ("box" or "tag")."""
    qids = question_ids(rows)
    todo = share(missing_samples(path, rows, s["n"], key) if MASTER else None)
    bar = tqdm(total=len(rows) * s["n"], initial=len(rows) * s["n"] - sum(len(m) for _, m in todo),
               desc=f"{label} {bench}", file=sys.stderr, disable=not MASTER)

    def call_rows(chunk, m, out, conf, extras, golds):   # graded while the next call generates
        answers, right = grade_call(out.texts, golds, bench, s, form)
        gold = [{} if s.get("grader") == "code" else {"gold": g} for g in golds]   # code: the tests
        return [json.dumps(dict(
            model=label, benchmark=bench, question=q, sample=js[r % m], answer=answers[r],
            correct=int(right[r]), confidence=float(conf[r]), length=out.lengths[r],
            finish=out.finish[r], source=conf_kw["source"], key=key, q=qids[q], **gold[r],
            **({} if args.no_log_text else dict(problem=rows[q]["problem"], text=out.texts[r])),
            **extras[r])) + "\n" for r, (q, js) in enumerate(c for c in chunk for _ in range(m))]

    with Rounds(path, bar) as written:
        for chunk in deal(calls(todo, s["batch"])):   # this worker's call of each round
            if chunk is None:
                written.add(None)
                continue
            m = len(chunk[0][1])
            prompts = [data.row_prompt(tok, rows[q], instruction, system) for q, _ in chunk]
            seed = args.seed * 1_000_003 + chunk[0][0] * 1009 + m
            if args.given:   # --responses: another engine's samples in place of these draws
                out = given_samples(tok, [args.given[bench][q][j] for q, js in chunk for j in js],
                                    s["max_new_tokens"])
            else:
                out = rollout.generate(model, tok, prompts, n=m, max_new_tokens=s["max_new_tokens"],
                                       temperature=args.temperature, top_p=args.top_p, seed=seed,
                                       batch_size=len(prompts), decode=args.decode)
            golds = [rows[q]["answer"] for q, _ in chunk for _ in range(m)]
            conf, extras = confidence.sample_confidences(
                model=model, tokenizer=tok, prompts=[p for p in prompts for _ in range(m)],
                responses=out.ids, texts=out.texts, golds=golds, seed=seed + 1,
                batch_size=s["score_batch"], rows=s["rows"], **conf_kw)
            written.add(call_rows, chunk, m, out, conf, extras, golds)
    bar.close()


def missing_samples(path, rows, n, key):
    """[(question, [sample indices not yet in `path` for key])] of the questions missing any."""
    done = {(r["question"], r["sample"]) for r in own_rows(read_samples(path), key, rows, n)}
    todo = [(q, [j for j in range(n) if (q, j) not in done]) for q in range(len(rows))]
    return [t for t in todo if t[1]]


def calls(todo, size):
    """The generate calls of a benchmark in order: runs of up to `size` questions of `todo` missing
    the same number of samples (workers share whole calls: docs/reference.md)."""
    runs = [list(run) for _, run in itertools.groupby(todo, key=lambda t: len(t[1]))]
    return [run[s:s + size] for run in runs for s in range(0, len(run), size)]


def grade_call(texts, golds, bench, s, form):
    """(answers, right) of one call's responses."""
    if s.get("grader") == "code":   # the programs run in a bounded pool of sandboxed children
        return [sandbox.extract_code(t) for t in texts], sandbox.grade_many(
            [grade.code_job(t, g) for t, g in zip(texts, golds)])
    answers = [grade.rlcr_answer(t) if form == "tag" else grade.extract(t, GRADER, form) for t in texts]
    if ":" in s.get("grader", ""):   # --grader FILE.py:FUNCTION reads the whole response
        return answers, [grade.is_correct(t, g, s["grader"]) for t, g in zip(texts, golds)]
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


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to evaluate")
    g.add_argument("--model", action="append", required=True,
                   help=f"alias (toy, {', '.join(ALIASES)}), HF id, model or run dir; repeatable")
    g.add_argument("--benchmarks", default="toy",
                   help="comma list: toy, math500, ..., FILE or NAME=FILE (default %(default)s)")
    g.add_argument("--limit", type=int, help="questions per benchmark (default: all)")
    g.add_argument("--lcb-release", default=data.LCB_RELEASE, help="the lcb window: vN or vA_vB (default %(default)s)")
    g.add_argument("--out", help="output dir (default RUN/eval or eval_out/<model>)")
    g.add_argument("--responses", help="grade and score a JSONL of responses made elsewhere (vLLM, an API) in "
                   "place of sampling, each cut at --max-new-tokens (docs/reference.md, \"Responses made elsewhere\")")
    g.add_argument("--export-prompts", metavar="FILE", help="write each row's prompt (text, ids) "
                   "and sampling settings as JSONL for another engine, and stop (then --responses)")
    g.add_argument("--no-log-text", action="store_true", help="leave problem and response texts "
                   "out of samples.jsonl (25 KB a 7B sample; rows with or without them are reused)")
    g.add_argument("--unconfined-code", action="store_true",
                   help="run lcb's programs without namespaces if there are none (they can escape)")
    g = p.add_argument_group("sampling")
    g.add_argument("--n-samples", type=int, help="samples per question (32 on aime/amc, else 4)")
    g.add_argument("--max-new-tokens", type=int, help="response cap in tokens (8000; toy 128)")
    g.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (%(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus top-p (%(default)s: off)")
    g.add_argument("--seed", type=int, default=0, help="seeds samples and bootstrap (%(default)s)")
    g.add_argument("--batch-size", type=int, help="questions per generation call (64 sequences; toy 256)")
    g.add_argument("--decode", choices=rollout.DECODES, help="decoding's KV cache (static on CUDA)")
    g.add_argument("--nproc", type=int, help="workers (default one per GPU, else 1): the same samples.jsonl")
    g = p.add_argument_group("confidence")
    g.add_argument("--confidence", choices=confidence.SOURCES,
                   help="where a sample's confidence comes from (default probe-posthoc)")
    g.add_argument("--logit-temperature", type=float, help="temperature of --confidence logits (default: the run's, 0.8)")
    g.add_argument("--every", type=int, help="thinking tokens between probe budgets / exit checkpoints (500; toy 8)")
    g.add_argument("--posthoc-budgets", type=int, help="post-hoc budgets per rollout: every, 2 * every, ... (16)")
    g.add_argument("--forced-k", type=int, help="forced answers per post-hoc budget (16; toy 4)")
    g.add_argument("--forced-close", choices=("think", "eos"), default="think",
                   help="token before a forced answer: </think> or EOS (default %(default)s)")
    g.add_argument("--probe-data", help="post-hoc probe questions (toy / deepscaler; toy-pooled)")
    g.add_argument("--probe-questions", type=int, help="how many (80, as released; toy-pooled 240)")
    g.add_argument("--probe-samples", type=int, help="rollouts per probe question (8, as released)")
    g.add_argument("--posthoc-tokens", choices=("sampled", "text"), default="sampled",
                   help="forced prompts: the sampled ids (default) or, as released, re-tokenized")
    g.add_argument("--no-early-exit", action="store_true", help="skip the forced answers at exit checkpoints")
    g = p.add_argument_group("prompt (default: what the run trained with, else the benchmark's)")
    g.add_argument("--instruction", help="text appended to every problem")
    g.add_argument("--system-prompt", help="system turn before the problem")
    g.add_argument("--gate", choices=("thinking", "none"), help="thinking (default; toy: none): right only with a box before </think>")
    g.add_argument("--answer", choices=("box", "tag"), help="the last \\boxed{} or <answer> (default: tag for an rlcr run)")
    g.add_argument("--grader", type=grade.grader_spec, metavar="FILE.py:FUNCTION",
                   help="your own grader (response, gold) -> bool, for every benchmark (README)")
    g.add_argument("--mode", choices=("boxed", "rlcr"), default="boxed", help="rlcr: RLCR's "
                   "prompt, the <answer> tag and --confidence verbal-forced (default %(default)s)")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.confidence is None:   # the paper's probe rows: post-hoc probe (Base, GRPO, RLCM, toy)
        args.confidence = "verbal-forced" if args.mode == "rlcr" else "probe-posthoc"
    args.argv = ["evaluate.py", *(sys.argv[1:] if argv is None else argv)]  # for the provenance
    args.given = None   # --responses' texts (read_responses), once the benchmarks are read
    return args


def main(argv=None):
    args = parse_args(argv)
    results = None   # set once every model is evaluated: then the ranks leave the group together
    try:   # what argparse cannot check, a missing model: one line, exit 2 (as argparse, train.py)
        config.check_values(vars(args), LIMITS)
        if args.grader:
            grade.user_grader(args.grader)   # imported and tried once: a broken one stops here
        data.lcb_window(args.lcb_release)
        if args.out:
            check_out(args.out, "--out", "evaluate.py")   # not a training run's or a model's folder
        for name in args.model:
            checkpoint.check_available(name)
        names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
        if not names:   # an empty list would replace a model's results with none
            raise UserError(f"--benchmarks {args.benchmarks!r} names no benchmark: pass e.g. toy or math500,aime24")
        sandbox.allow_unconfined = args.unconfined_code
        # beside the grader's folder, the project and the HF cache, a program sees none of these
        sandbox.hide += [p for p in (*(b.partition("=")[2] or b for b in names), *args.model, args.out)
                         if p and os.path.exists(p)]
        if not torch.cuda.is_available():   # the toy or a small model gains nothing from threads
            torch.set_num_threads(1)
        loaded = load_benchmarks(names, args.limit, args.lcb_release)   # before any model loads
        loaded = rlcr_prompts(loaded) if args.mode == "rlcr" else loaded
        if args.export_prompts:   # another engine samples them: nothing is generated here
            return export_prompts(args.export_prompts, args.model, loaded, args)
        args.given = read_responses(args.responses, loaded) if args.responses else None
        if any(data.kind(name) == "code" for name, *_ in loaded):
            sandbox.check()   # confinement (or --unconfined-code) is checked before any model loads
        workers = worker_count(vars(args))
        if workers > 1:   # one per GPU (or --nproc), each running this command (benchmarks.deal)
            for name in args.model:
                checkpoint.fetch(name)   # now: rank 0 would download in the group as others wait
            if code := launch(os.path.abspath(__file__), args.argv[1:], workers):
                raise SystemExit(code)
            return None
        setup()
        results = dict(evaluate_model(name, loaded, args) for name in args.model)
    except (ValueError, OSError) as e:   # UserError (a held lock), data.DataError: exit 2
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except FloatingPointError as e:   # NaN in a model or probe
        raise SystemExit(f"evaluate.py: error: {e}") from None
    except KeyboardInterrupt:   # samples are appended per batch: the same command continues
        results = None          # the line is printed below, once the progress bar has closed
    finally:
        LOCKS.close()
        HELD.clear()
        teardown(results is not None)
    if results is None:
        print("\ninterrupted: the samples so far are kept; run the same command again to continue", file=sys.stderr)
        raise SystemExit(130)
    if not MASTER:
        return None
    print(table(results), "", report_uses(results), sep="\n")
    outs = dict.fromkeys(r["out"] for r in results.values())
    print(f"\nresults: {', '.join(outs)}  (results.json, samples.jsonl, reliability_*.png)")
    return results


if __name__ == "__main__":
    main()
