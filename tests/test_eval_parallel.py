"""`evaluate.py --nproc N`: workers run whole generate calls, rank 0 writes the samples one process
writes, byte for byte, and grading runs while the next call generates, its rows kept in call order."""
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import evaluate
from evaluation import benchmarks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONHASHSEED": "0"}
# Three calls per benchmark (5 questions, 2 per call): two workers get two calls and one, and a round
# in which rank 1 has none. The post-hoc probe is fitted (small) so that its sharing is exercised.
SMALL = ["--model", "toy", "--benchmarks", "toy,toy-long", "--limit", "5", "--n-samples", "2",
         "--max-new-tokens", "48", "--batch-size", "2", "--probe-questions", "6", "--probe-samples", "2"]


def test_calls_are_one_process_batches_and_every_rank_sees_every_round(monkeypatch):
    todo = [(0, [0, 1]), (1, [0, 1]), (2, [0, 1]), (3, [1]), (4, [1]), (5, [0, 1])]
    calls = evaluate.calls(todo, 2)
    # runs of up to 2 questions missing the same number of samples, as one process makes them
    assert [[q for q, _ in c] for c in calls] == [[0, 1], [2], [3, 4], [5]]
    monkeypatch.setattr(benchmarks, "WORLD", 3)
    dealt = []
    for rank in range(3):
        monkeypatch.setattr(benchmarks, "RANK", rank)
        dealt.append(list(benchmarks.deal(calls)))
    assert [len(d) for d in dealt] == [2, 2, 2]   # as many rounds on every rank (each round gathers)
    in_order = [d[r] for r in range(2) for d in dealt]   # round r, rank k: call r * WORLD + k
    assert in_order == calls + [None, None]


def test_a_chunk_of_generate_samples_as_in_the_whole_call():
    """rollout.generate(chunks=...), what the post-hoc fit deals to each worker: the chosen chunks'
    rows are the whole call's, whichever chunks run and in whatever order."""
    import rollout
    import tiny
    tok, model = tiny.tokenizer(), tiny.model(seed=3)
    prompts = [tok.encode(p) for p in ("1+1=", "2*3=", "7-5=", "9/3=", "4+4=")]
    kw = dict(n=2, max_new_tokens=6, temperature=1.0, seed=11, batch_size=2)
    whole = rollout.generate(model, tok, prompts, **kw)
    part = rollout.generate(model, tok, prompts, chunks=[2, 0], **kw)   # chunk 2: prompt 4; chunk 0: prompts 0, 1
    assert part.prompt_index == [4, 4, 0, 0, 1, 1]
    assert part.ids == [whole.ids[r] for r in (8, 9, 0, 1, 2, 3)]
    assert len(set(map(tuple, whole.ids))) > 5   # sampled, not one greedy answer


def test_grading_overlaps_the_next_call_and_rows_stay_in_call_order(tmp_path):
    path = str(tmp_path / "samples.jsonl")
    generating = [threading.Event() for _ in range(4)]
    overlapped = []

    def grade(k):   # call k's grading: waits (bounded) for call k + 1's generation to start
        overlapped.append(generating[k + 1].wait(5) if k < 3 else True)
        time.sleep(0.05 * (3 - k))   # earlier calls grade slower: order must not follow finishing time
        return [json.dumps({"call": k, "row": i}) + "\n" for i in range(2)]

    with benchmarks.Rounds(path) as written:
        for k in range(4):
            generating[k].set()   # "generate call k"
            written.add(grade, k)
            rows = open(path).read().splitlines() if os.path.exists(path) else []
            assert [json.loads(r)["call"] for r in rows] == [c for c in range(k) for _ in range(2)]  # one behind
        written.add(None)   # a round with no call of this rank adds nothing
    rows = [json.loads(r) for r in open(path).read().splitlines()]
    assert [(r["call"], r["row"]) for r in rows] == [(k, i) for k in range(4) for i in range(2)]
    assert overlapped == [True] * 4


def test_a_stopped_process_keeps_every_call_it_generated(tmp_path):
    path = str(tmp_path / "samples.jsonl")
    with pytest.raises(KeyboardInterrupt):
        with benchmarks.Rounds(path) as written:
            for k in range(2):
                written.add(lambda k=k: [json.dumps({"call": k}) + "\n"])
            raise KeyboardInterrupt   # Ctrl-C while call 2 generates: calls 0 and 1 are still written
    assert [json.loads(r)["call"] for r in open(path).read().splitlines()] == [0, 1]


def _evaluate(out, *extra):
    done = subprocess.run([sys.executable, "evaluate.py", *SMALL, "--out", str(out), *extra], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, "results.json")) as f:
        return done, json.load(f)


@pytest.mark.slow   # three processes: one evaluation, then the same on two workers
def test_two_workers_write_the_samples_and_numbers_of_one_process(tmp_path):
    one, res1 = _evaluate(tmp_path / "one")
    two, res2 = _evaluate(tmp_path / "two", "--nproc", "2")
    a = (tmp_path / "one" / "samples.jsonl").read_bytes()
    b = (tmp_path / "two" / "samples.jsonl").read_bytes()
    assert len(a.splitlines()) == 2 * 5 * 2 and a == b
    r1, r2 = res1["toy"], res2["toy"]
    for key in ("benchmarks", "overall", "math", "settings", "posthoc_probe", "model_id"):
        assert r1[key] == r2[key], key
    # rank 0 prints the table and its folder; the other worker prints nothing
    assert one.stdout.replace(str(tmp_path / "one"), "OUT") == two.stdout.replace(str(tmp_path / "two"), "OUT")


@pytest.mark.slow   # the launcher and two workers
def test_a_user_error_in_a_worker_is_its_one_line(tmp_path):
    done = subprocess.run([sys.executable, "evaluate.py", "--model", "toy", "--benchmarks", "toy", "--limit", "2",
                           "--nproc", "2", "--probe-data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    assert done.stderr.count("missing.jsonl") == 1 and "worker 0 of 2 failed" not in done.stderr, done.stderr[-2000:]


def _posthoc(tmp_path, world):
    out = str(tmp_path / f"w{world}")
    cmd = [os.path.join(ROOT, "tests", "posthoc_workers.py"), out]
    cmd = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
                             if world > 1 else []), *cmd]
    env = {**ENV, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    work = [json.load(open(f"{out}.rank{r}.json")) for r in range(world)]
    return work, open(out + "_probe.pt", "rb").read(), torch.load(out + ".data.pt", weights_only=True)


@pytest.mark.slow   # the post-hoc fit in one process, then under torchrun as two workers
def test_two_workers_share_the_posthoc_fit_and_fit_the_probe_of_one_process(tmp_path):
    """evaluate.py's workers each make a share of the post-hoc probe's data, dealt as the benchmarks'
    calls are (chunk i to rank i % 2): the rollouts' generate chunks, the rollouts whose forced answers
    a rank draws, the feature batches and the gradings. Merged in order, they are one process's data,
    and rank 0 fits the same probe from them, byte for byte."""
    (one,), probe1, data1 = _posthoc(tmp_path, 1)
    two, probe2, data2 = _posthoc(tmp_path, 2)
    # one process: 2 rollout calls (6 prompts, 4 a call); then one forced-answer call over the 7
    # rollouts that ask any, rollout i on rank i % 2
    assert [count for count, _ in one["chunks"]] == [2]
    assert (one["forced"], two[0]["forced"], two[1]["forced"]) == ([7], [4], [3])
    assert all(ran == list(range(count)) for count, ran in one["chunks"])
    for (count, _), rank0, rank1 in zip(one["chunks"], two[0]["chunks"], two[1]["chunks"]):
        assert rank0 == [count, list(range(0, count, 2))] and rank1 == [count, list(range(1, count, 2))]
    # 12 rollouts scored in batches of 5 (0-4 and 10-11 on rank 0, 5-9 on rank 1); the 72 forced
    # answers (18 prompts x 4) graded half each
    assert (one["scored"], two[0]["scored"], two[1]["scored"]) == (12, 7, 5)
    assert (one["graded"], two[0]["graded"], two[1]["graded"]) == (72, 36, 36)
    assert (one["fitted"], two[0]["fitted"], two[1]["fitted"]) == (True, True, False)   # rank 0 fits
    assert data1.keys() == data2.keys() == {"x", "y", "g"} and len(data1["y"]) == 12 * 16
    assert all(torch.equal(data1[k], data2[k]) for k in data1)
    assert 0 < float(data1["y"].mean()) < 1
    assert probe1 == probe2
