"""FSDP2 on CPU (gloo, two processes): the sharded update equals the one-process update."""
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def run(tmp_path, world):
    out = str(tmp_path / f"w{world}.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.join(HERE, "fsdp_update.py"), out]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", *cmd[1:]]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_fsdp_update_equals_single_process(tmp_path):
    one, two = run(tmp_path, 1), run(tmp_path, 2)
    init = __import__("tiny").model(vocab_size=64, hidden=32, layers=2, seed=0).state_dict()
    assert one.keys() == two.keys()
    moved = max((one[k] - init[k]).abs().max().item() for k in one)
    assert moved > 1e-4  # the step did something
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5), (k, (one[k] - two[k]).abs().max())


def test_two_process_training_run_writes_a_loadable_checkpoint(tmp_path):
    """The whole loop under torchrun on gloo: pooled probe fit, sharded update, full-state save."""
    import json
    from transformers import AutoModelForCausalLM
    run = str(tmp_path / "run")
    root = os.path.dirname(HERE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(root, "train.py"), "--steps", "2", "--out", run, "--prompts-per-step", "4",
           "--group-size", "4", "--max-new-tokens", "40", "--eval-n", "8", "--save-every", "1"]
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in steps if not r.get("eval")] == [1, 2]
    # one rank holds 2 prompts x 4 samples x at most 3 cuts = 24 prefixes: more means both were pooled
    assert all(r["prefixes"] > 24 for r in steps if not r.get("eval"))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(run, "checkpoints", "step_000002"))
    assert all(torch.isfinite(p).all() for p in model.parameters())
