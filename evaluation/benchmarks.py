"""The benchmarks an evaluation reads and how each is sampled (load_benchmarks, settings); what
identifies a model's samples in samples.jsonl (sample_key, own_rows, hold); and the workers of an
evaluation on every GPU of a node (setup, deal, Rounds), writing what one process would write."""
import dataclasses
import datetime
import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack

import torch
import torch.distributed as dist

import data
import grade
import label as label_lib
import rollout
import toy
from evaluation.report import read_results
from harness import files
from harness.files import UserError
from harness.parallel import MASTER, RANK, WORLD, all_gather
from harness.checkpoint import ALIASES, check_out, read_config

BIG_N = {"aime24": 32, "aime25": 32, "amc23": 32}   # samples per question; 4 elsewhere
# Per-world defaults (docs/reference.md, "Evaluation"); every: thinking tokens between budgets;
# rows: sequences per generation call; score_batch: sequences per scoring forward.
REAL = dict(n=4, max_new_tokens=8000, every=500, forced_k=16, probe_questions=80, probe_samples=8,
            posthoc_budgets=16, rows=64, score_batch=8)
TOY = dict(n=4, max_new_tokens=128, every=8, forced_k=4, probe_questions=80, probe_samples=8,
           posthoc_budgets=16, rows=256, score_batch=256)
# The released forced answer, after the cut thinking and `</think>` (checkpoints, post-hoc labels).
EVAL_SUFFIX = "\n\nIf I were to give the final answer now, the final answer would be \\boxed{"
# RLCR's released forced re-answer (2_budget_eval_rlcr), after the thinking cut at the budget.
RLCR_REANSWER = ("...</think>\n\nI am out of time, let me just output the final answer and confidence "
                 "analysis in exactly this format:\n" + data.RLCR_FORMAT + "\n\n<answer>")
# Code benchmarks (released 2_budget_eval, LiveCodeBench): the forced answer is a whole program
# after "..." + `</think>` + CODE_SUFFIX, graded by running it (grade's "code").
CODE_SUFFIX = "\n\nHere is my final Python solution:\n"
LOCKS = ExitStack()  # the lock of every output folder written, held until evaluate.main() ends
HELD = set()         # their real paths


def settings(bench, args):
    """Per-benchmark sampling and confidence settings: world defaults, overridden by flags."""
    toy_world = bench in data.TOY_BENCHMARKS
    w = TOY if toy_world else REAL
    code = data.kind(bench) == "code"
    s = dict(n=BIG_N.get(bench, w["n"]), max_new_tokens=w["max_new_tokens"], every=w["every"],
             forced_k=w["forced_k"], suffix=label_lib.SUFFIX if toy_world else EVAL_SUFFIX,
             score_batch=w["score_batch"], rows=w["rows"])
    if code:   # the forced answer is a program (CODE_SUFFIX), graded by running it
        s.update(suffix=CODE_SUFFIX, grader="code")
    if getattr(args, "grader", None):   # --grader FILE.py:FUNCTION: every answer, forced ones too
        s["grader"] = args.grader
    given = (args.given or {}).get(bench)   # --responses: as many samples as the file holds
    flags = dict(n=len(given[0]) if given else args.n_samples, max_new_tokens=args.max_new_tokens,
                 every=args.every, forced_k=args.forced_k)
    s.update({k: v for k, v in flags.items() if v is not None})
    # verbal-forced (RLCR's released reading): its re-answer text (the toy: `</think>` alone) and
    # n_forced re-answers, 4 on the 32-sample benchmarks and 1 elsewhere in the released configs.
    s["reanswer"] = None if toy_world else RLCR_REANSWER
    s["reanswer_k"] = args.forced_k or (w["forced_k"] if toy_world else 4 if bench in BIG_N else 1)
    s["batch"] = args.batch_size or max(1, w["rows"] // s["n"])
    # The toy boxes after `</think>` by construction: the released gate would grade every answer
    # wrong. Code has no box to gate on: the program of the last fenced block after thinking is run.
    s["gate"] = args.gate or ("none" if toy_world or code else "thinking")
    return s


def load_benchmarks(specs, limit=None, lcb_release=data.LCB_RELEASE):
    """[(name, rows, instruction, source)]. A name stands for one source: a file whose stem is taken
    (by a toy benchmark, or an earlier one: b1/q.jsonl, b2/q.jsonl) is named by the path given."""
    owner, out = {name: f"{name}:test" for name in data.TOY_BENCHMARKS}, []
    for spec in specs:
        name, rows, instruction, source = load_benchmark(spec, limit, lcb_release)
        if owner.setdefault(name, source) != source:
            name = spec
        out.append((name, rows, instruction, source))
    return out


def load_benchmark(spec, limit=None, lcb_release=data.LCB_RELEASE):
    """(name, rows [{problem, answer}], instruction, source) for a toy benchmark (its test split), a
    known name (data.BENCHMARKS), a local .json/.jsonl/.parquet file, NAME=FILE (a local copy of a
    known benchmark, named and sampled like it), or an HF dataset id (owner/name). source: what it
    reads, "toy:test", a hub name or id, a file's real path; lcb's with its window ("lcb:v4_v5")."""
    stem = os.path.splitext(os.path.basename(spec))[0]
    is_file = spec.lower().endswith((".json", ".jsonl", ".parquet"))
    if "=" not in spec and stem in data.BENCHMARKS and is_file:   # DIR/gpqa.jsonl: read as gpqa
        spec = f"{stem}={spec}"
    name, _, path = spec.partition("=")
    where = path or name
    source = where if where in data.BENCHMARKS or not os.path.isfile(where) else os.path.realpath(where)
    source = f"{source}:{lcb_release}" if name == "lcb" else source
    source = f"{where}:test" if where in data.TOY_BENCHMARKS else source
    known = ", ".join(data.TOY_BENCHMARKS + tuple(data.BENCHMARKS))
    if name in data.TOY_BENCHMARKS and not path:
        return name, data.load_rows(name, split="test", limit=limit), toy.INSTRUCTION, source
    if path and name not in data.BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r} in {spec!r}; known: {known}")
    if is_file and not path:
        return stem, data.load_rows(name, limit=limit), data.INSTRUCTION, source
    if path or name in data.BENCHMARKS or "/" in name:
        return name, data.load_rows(where, limit=limit, like=name if path else None,
                                    lcb_release=lcb_release), data.instruction_for(name), source
    raise UserError(f"unknown benchmark {name!r}; known: {known}; or a local .json/.jsonl/.parquet "
                    "file, NAME=FILE, or an HF dataset id (owner/name)")


def run_prompt(path, args):
    """(instruction, system prompt, answer form) for a model: the flags, else what its run trained
    with (its config.json; an RLCR run answers in <answer> tags), else (None, None, "box")."""
    cfg = run_config(path)
    pick = lambda flag, key: flag if flag is not None else cfg.get(key)  # noqa: E731
    form = args.answer or ("tag" if args.mode == "rlcr" else grade.answer_form(cfg.get("reward")))
    # --mode rlcr: each benchmark's RLCR prompt (rlcr_prompts), not the run's
    instruction = args.instruction if args.mode == "rlcr" else pick(args.instruction, "instruction")
    return instruction, pick(args.system_prompt, "system_prompt"), form


def rlcr_prompts(loaded):
    """--mode rlcr (the released evaluation's, for RLCR and C2GSPG): every benchmark asks in RLCR's
    format (data.RLCR_INSTRUCTION; the toy's: toy.RLCR_INSTRUCTION); LiveCodeBench is refused."""
    if any(data.kind(bench) == "code" for bench, *_ in loaded):
        raise UserError("--mode rlcr: lcb has no RLCR-format evaluation here (its answer is a "
                        "program; the release ships livecodebench_lite_rlcr.parquet but no config "
                        "or grader for it): evaluate it without --mode rlcr")
    for bench, rows, *_ in loaded:   # a released chat list is the whole prompt: RLCR's is not added
        if rows and "messages" in rows[0] and "<confidence>" not in rows[0]["problem"]:
            raise UserError(f"--mode rlcr: {bench}'s prompts are a verl file's, as released, and do not ask for "
                            "RLCR's format: pass the release's _rlcr parquet of it, or drop --mode rlcr")
    return [(b, rows, toy.RLCR_INSTRUCTION if b in data.TOY_BENCHMARKS else data.RLCR_INSTRUCTION, src)
            for b, rows, _, src in loaded]


def run_config(path):
    """The config.json of a run (RUN, or RUN/checkpoints/step_*), else {} (a base model)."""
    run = run_dir(path) or (path if os.path.isdir(os.path.join(path, "checkpoints")) else None)
    found = run and os.path.isfile(os.path.join(run, "config.json"))
    return read_config(run, flag="--model") if found else {}


def run_dir(path):
    """RUN for RUN/checkpoints/step_*, else None."""
    parent = os.path.dirname(os.path.abspath(path))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None


def model_label(name, path):
    """Short stable name in samples.jsonl and tables: 'toy', alias, 'run/step_000010', dir name."""
    if name == "toy" or name in ALIASES or not os.path.isdir(path):
        return name
    run = run_dir(path)
    base = os.path.basename(os.path.abspath(path))
    return f"{os.path.basename(run)}/{base}" if run else base


def model_id(path):
    """"FOLDER#HASH", its resolved folder and content (harness/files.identity: a run trained
    again in place is another model); else its hub id."""
    return f"{os.path.realpath(path)}#{files.identity(path)}" if os.path.isdir(path) else path


def digest(obj, size=16):
    """A short hash of a JSON value: the keys of samples, their questions, post-hoc probe files."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:size]


def filed_label(label, ident, out_dir):
    """label, or label@HASH where OUT's results.json files another model under it."""
    entry, folder = read_results(out_dir).get(label), ident.partition("#")[0]
    if entry is None or entry.get("model_id") == ident:
        return label
    if str(entry.get("model_id")).partition("#")[0] == folder:
        print(f"{os.path.join(out_dir, 'results.json')}: the entry of {label} is of the model that "
              f"was in {folder} before (trained again or replaced since): it is evaluated again "
              "and replaced", file=sys.stderr)
        return label
    return f"{label}@{digest(ident, 8)}"


def default_out(name, path):
    run = run_dir(path) if os.path.isdir(path) else None
    return os.path.join(run, "eval") if run else os.path.join("eval_out", model_label(name, path).replace("/", "_"))


def _count(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_sample(r):
    """A row as evaluate.py writes it: names, indices >= 0, correct 0/1, a confidence in [0, 1],
    and with a `key` what the summaries read (rows without one are never counted)."""
    conf = r.get("confidence")
    ok = (isinstance(r.get("model"), str) and isinstance(r.get("benchmark"), str)
          and _count(r.get("question")) and _count(r.get("sample")) and r.get("correct") in (0, 1)
          and isinstance(conf, (int, float)) and not isinstance(conf, bool) and 0 <= conf <= 1)
    return ok and ("key" not in r or (isinstance(r["key"], str) and isinstance(r.get("q"), str)
                   and "answer" in r and isinstance(r["answer"], (str, type(None)))
                   and _count(r.get("length")) and isinstance(r.get("checkpoints", []), list)))


def read_samples(path):
    """Rows of samples.jsonl; a last line cut by a kill is dropped from the file with a message,
    any other line that is not a sample (is_sample) is one error naming the file and the line."""
    return files.read_jsonl(path, valid=is_sample)


def read_responses(path, loaded):
    """{benchmark: [[response text, ...] of each question]} of a --responses file, a question's in
    the file's order; its format: docs/reference.md, "Responses made elsewhere"."""
    given = {bench: [[] for _ in rows] for bench, rows, *_ in loaded}
    index = {bench: {r["problem"]: q for q, r in enumerate(rows)} for bench, rows, *_ in loaded}
    for i, r in enumerate(data.read_file(path), 1):   # JSON lines, a JSON list or parquet
        if not (isinstance(r, dict) and all(isinstance(r.get(k), str) for k in ("benchmark", "response"))
                and (isinstance(r.get("problem"), str) if "problem" in r else _count(r.get("question")))):
            raise UserError(f"{path}: row {i} is not a response: write "
                            '{"benchmark": ..., "problem": ... (or "question": its index), "response": ...}')
        bench = r["benchmark"]
        if bench not in given:
            raise UserError(f"{path}: row {i}: benchmark {bench!r} is not in --benchmarks "
                            f"{','.join(given)}: add it there")
        q = index[bench].get(r["problem"]) if "problem" in r else r["question"]
        if q is None or q >= len(given[bench]):
            raise UserError(f"{path}: row {i}: no question {r.get('problem', q)!r} among {bench}'s "
                            f"{len(given[bench])}: respond to those (--limit N: the first N)")
        given[bench][q].append(r["response"])
    for bench, texts in given.items():
        n = [len(t) for t in texts]
        if min(n) != max(n) or not n[0]:
            raise UserError(f"{path}: {bench}'s questions have {min(n)} to {max(n)} responses (question "
                            f"{n.index(min(n))}: {min(n)}): give each question the same number, at least one")
    return given


def given_samples(tokenizer, texts, cap):
    """rollout.Samples of responses made elsewhere, tokenized as is; EOS ends each under `cap`
    tokens, a longer one is cut at `cap` as if sampled here (finish "length", graded as cut)."""
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    texts = [t if len(i) <= cap else tokenizer.decode(i[:cap], skip_special_tokens=True) for t, i in zip(texts, ids)]
    finish = ["length" if len(i) >= cap else "eos" for i in ids]
    ids = [i[:cap] + [tokenizer.eos_token_id] * (f == "eos") for i, f in zip(ids, finish)]
    return rollout.Samples(ids, texts, [len(i) for i in ids], finish, [])


def question_ids(rows):
    """A hash of each question's text and gold: a sample counts only for the question it was for."""
    return [digest([r["problem"], r["answer"]], 12) for r in rows]


def own_rows(samples, key, rows, n):
    """The rows of `samples` made with `key` for these rows, once per (question, sample): a copied
    line (two shards' files joined with cat) counts once; an edited question is sampled again."""
    qids, mine = question_ids(rows), {}
    for r in samples:
        q = r["question"]
        if r.get("key") == key and q < len(qids) and r["q"] == qids[q] and r["sample"] < n:
            mine.setdefault((q, r["sample"]), r)
    return list(mine.values())


def sample_key(ident, source, s, args, prompt, conf_kw):
    """The key of one model's samples of one benchmark: a digest of the model, the benchmark's
    source and each setting changing a sample's draw, grade or confidence (docs/reference.md)."""
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


def setup():
    """Join the workers' group (several ranks only) and put this rank on its own GPU. The group is
    gloo on every device: the ranks exchange Python objects, never the model's tensors."""
    if WORLD == 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # a rank waits at each gather for the slowest (a round, a phase of the post-hoc fit)
    dist.init_process_group("gloo", rank=RANK, world_size=WORLD, timeout=datetime.timedelta(hours=24))


def share(obj):
    """Rank 0's `obj` on every rank (what rank 0 alone reads from the output folder)."""
    if WORLD == 1:
        return obj
    box = [obj if MASTER else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def deal(calls):
    """This rank's call of each round (None once the calls run out): every rank gets as many."""
    for i in range(RANK, -(-len(calls) // WORLD) * WORLD, WORLD):   # round r: call r * WORLD + RANK
        yield calls[i] if i < len(calls) else None


def spread(fn, items):
    """fn(items) (a list in, one result per item out) with the items dealt to the workers, item i to
    rank i % WORLD as deal deals calls; the results merged in item order, on every rank."""
    if WORLD == 1:
        return fn(items)
    every = all_gather(fn(items[RANK::WORLD]))
    return [every[i % WORLD][i // WORLD] for i in range(len(items))]


def generate_dealt(model, tokenizer, prompts, n=1, batch_size=None, progress=None, **kw):
    """rollout.generate's Samples of every prompt on every rank, chunk i sampled whole by rank
    i % WORLD with its own generator: one process's samples. progress: rank 0's bar's label."""
    if WORLD == 1:
        return rollout.generate(model, tokenizer, prompts, n, batch_size=batch_size, progress=progress, **kw)
    count = -(-len(prompts) // (batch_size or max(len(prompts), 1)))
    mine = range(RANK, count, WORLD)
    out = rollout.generate(model, tokenizer, prompts, n, batch_size=batch_size, chunks=mine,
                           progress=MASTER and progress and f"{progress} (worker 0: {len(mine)} of {count} calls)", **kw)
    every = all_gather(out)
    # a prompt's rows come from one chunk, hence one rank: by prompt, in that rank's order
    order = sorted((p, k, r) for k, s in enumerate(every) for r, p in enumerate(s.prompt_index))
    column = lambda name: [getattr(every[k], name)[r] for _, k, r in order] if any(  # noqa: E731
        getattr(s, name) for s in every) else []
    return rollout.Samples(**{f.name: column(f.name) for f in dataclasses.fields(rollout.Samples)})


class Rounds(AbstractContextManager):
    """The rows of a benchmark's rounds, appended to `path` by rank 0 in call order. add(fn, *args):
    this rank's round, fn(*args) -> lines, run in a thread while the next round generates (fn None:
    no call). Leaving the block writes what is left, in one process also on an error (to resume)."""

    def __init__(self, path, bar=None):
        self.path, self.bar, self.pending = path, bar, []
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grading")

    def add(self, fn=None, *args):
        self.pending.append(self.pool.submit(fn or list, *args))   # list(): no call, no rows
        if len(self.pending) > 1:   # the previous round was graded during this round's generation
            self._write(self.pending.pop(0))

    def __exit__(self, kind, *_):   # several ranks on an error: no gather, one may be gone
        done = kind is None or WORLD == 1
        while done and self.pending:
            self._write(self.pending.pop(0))
        self.pool.shutdown(wait=done, cancel_futures=not done)

    def _write(self, job):
        lines = [line for rank_lines in all_gather(job.result()) for line in rank_lines]
        if MASTER and lines:
            with files.appending(self.path) as f:
                f.writelines(lines)
                f.flush()
        if self.bar is not None:
            self.bar.update(len(lines))
