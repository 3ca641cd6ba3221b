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
