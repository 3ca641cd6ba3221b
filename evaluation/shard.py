"""Evaluation on every GPU of a node: one worker per GPU (or --nproc N on a CPU, or torchrun's
ranks), each running whole generate calls, and one samples.jsonl with the rows one process would
have written, in the same order (docs/reference.md).
"""
import copy
import dataclasses
import datetime
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

import rollout
from harness import files
from harness.parallel import MASTER, RANK, WORLD

# a rank waits at each gather for the slowest (a round, a phase of the post-hoc fit): a safe bound
TIMEOUT = datetime.timedelta(hours=24)


def setup():
    """Join the workers' group (several ranks only) and put this rank on its own GPU. The group is
    gloo on every device: the ranks exchange Python objects, never the model's tensors."""
    if WORLD == 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("gloo", rank=RANK, world_size=WORLD, timeout=TIMEOUT)


def share(obj):
    """Rank 0's `obj` on every rank (what rank 0 alone reads from the output folder)."""
    if WORLD == 1:
        return obj
    box = [obj if MASTER else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share_probe(got, device):
    """Rank 0's (probe or None, report or None) on every rank, the probe on the CPU or, where rank 0's
    is on its GPU, on this rank's `device`."""
    if WORLD == 1:
        return got
    on_gpu = MASTER and got[0] is not None and next(got[0].parameters()).device.type == "cuda"
    prb, report, on_gpu = share((got[0] and copy.deepcopy(got[0]).cpu(), got[1], on_gpu) if MASTER else None)
    return got if MASTER else (prb and prb.to(device if on_gpu else "cpu"), report)


def deal(calls):
    """This rank's call of each round (None once the calls run out): every rank sees as many rounds."""
    rounds = -(-len(calls) // WORLD)
    for r in range(rounds):
        i = r * WORLD + RANK
        yield calls[i] if i < len(calls) else None


def spread(fn, items):
    """fn(items) (a list in, one result per item out) with the items dealt to the workers, item i to
    rank i % WORLD as deal deals calls; the results merged in item order, on every rank."""
    if WORLD == 1:
        return fn(items)
    mine = range(RANK, len(items), WORLD)
    got = fn([items[i] for i in mine])
    every = [None] * WORLD
    dist.all_gather_object(every, got)
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
    every = [None] * WORLD
    dist.all_gather_object(every, out)
    # a prompt's rows come from one chunk, hence one rank: by prompt, in that rank's order
    order = sorted((p, k, r) for k, s in enumerate(every) for r, p in enumerate(s.prompt_index))
    column = lambda name: [getattr(every[k], name)[r] for _, k, r in order] if any(  # noqa: E731
        getattr(s, name) for s in every) else []
    return rollout.Samples(**{f.name: column(f.name) for f in dataclasses.fields(rollout.Samples)})


class Rounds:
    """The rows of a benchmark's rounds, appended to `path` by rank 0 in call order.

    add(fn, *args) queues this rank's round: fn(*args) -> lines (JSON rows ending in a newline) runs
    in a background thread while the caller generates the next round; then the previous round is
    gathered and written. fn None: no call in this round. Leaving the `with` block writes what is
    left, in one process also on an error or Ctrl-C (kept for the resume; one worker of several
    cannot gather alone). `bar` (a tqdm) advances by the rows written.
    """

    def __init__(self, path, bar=None):
        self.path, self.bar = path, bar
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grading")
        self.pending = []

    def add(self, fn=None, *args):
        if fn is None:
            job = Future()
            job.set_result([])
        else:
            job = self.pool.submit(fn, *args)
        self.pending.append(job)
        if len(self.pending) > 1:   # the round before this one has had this round's generation to grade
            self._write(self.pending.pop(0))

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is None or WORLD == 1:
            self.close()
        else:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def close(self):
        while self.pending:
            self._write(self.pending.pop(0))
        self.pool.shutdown()

    def _write(self, job):
        lines = job.result()
        if WORLD > 1:
            every = [None] * WORLD
            dist.all_gather_object(every, lines)
            lines = [line for rank_lines in every for line in rank_lines]
        if MASTER and lines:
            with files.appending(self.path) as f:
                f.writelines(lines)
                f.flush()
        if self.bar is not None:
            self.bar.update(len(lines))
