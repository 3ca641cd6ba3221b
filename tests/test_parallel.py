"""FSDP2 on CPU (gloo, two processes): the sharded update equals the one-process update."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def run(tmp_path, world, offload=False, grads="gpu", old_torch=False, c2gspg=""):
    out = str(tmp_path / f"w{world}{'-offload-' + grads if offload else ''}{'-old' if old_torch else ''}"
                         f"{'-' + c2gspg if c2gspg else ''}.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "OMP_NUM_THREADS": "1",
           "OFFLOAD": "1" if offload else "0", "OFFLOAD_GRADS": grads, "C2GSPG": c2gspg,
           "OLD_TORCH": "1" if old_torch else "0"}
    cmd = [sys.executable, os.path.join(HERE, "fsdp_update.py"), out]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", *cmd[1:]]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.slow   # torchrun, two processes
def test_fsdp_update_equals_single_process(tmp_path):
    one, two = run(tmp_path, 1), run(tmp_path, 2)
    init = __import__("tiny").model(vocab_size=64, hidden=32, layers=2, seed=0).state_dict()
    assert one.keys() == two.keys()
    moved = max((one[k] - init[k]).abs().max().item() for k in one)
    assert moved > 1e-4  # the step did something
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5), (k, (one[k] - two[k]).abs().max())
    # the probe is fitted on the pairs pooled from both ranks: the same probe on each
    a, b = (torch.load(str(tmp_path / f"w2.pt.probe{r}"), weights_only=True) for r in (0, 1))
    torch.manual_seed(0)
    init = __import__("probe").Probe(32).state_dict()
    assert any(not torch.equal(a[k], init[k]) for k in a)  # the fit moved it
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the lean start (rank 0 reads, shards broadcast, buffers rebuilt) gives the model as saved
    for r in (0, 1):
        assert torch.load(str(tmp_path / f"w2.pt.lean{r}")) == dict(sampler=0.0, policy=0.0, buffers=0.0)


@pytest.mark.slow   # torchrun, two processes, and one process
@pytest.mark.parametrize("form", ["seq-mean", "token-mean"])
def test_fsdp_update_with_c2gspgs_term_equals_single_process(tmp_path, form):
    """C2GSPG's BCE term in grpo.update (per sequence: a mean over every rank's sequences; per
    token: weighted like the loss): two ranks give the one-process loss, term, gradient norm and
    weights, and the term moved them (the weights differ from the update without it)."""
    plain, one, two = run(tmp_path, 1), run(tmp_path, 1, c2gspg=form), run(tmp_path, 2, c2gspg=form)
    assert max((one[k] - plain[k]).abs().max().item() for k in one) > 1e-4  # the term moved them
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5), (k, (one[k] - two[k]).abs().max())
    stats = [torch.load(str(tmp_path / f"w{w}-{form}.pt.stats0")) for w in (1, 2)]
    assert stats[0]["c2gspg_bce"] > 0.1
    assert "c2gspg_bce" not in torch.load(str(tmp_path / "w1.pt.stats0"))
    for key in ("loss", "c2gspg_bce", "clip_frac", "ratio_mean"):
        assert stats[1][key] == pytest.approx(stats[0][key], rel=1e-5, abs=1e-7), key
    assert stats[1]["grad_norm"] == pytest.approx(stats[0]["grad_norm"], rel=1e-4)


@pytest.mark.slow   # two subprocesses
def test_offloaded_update_equals_single_process(tmp_path):
    """--offload on one rank: FSDP2 keeps params, grads and optimizer state on the host."""
    one, off = run(tmp_path, 1), run(tmp_path, 1, offload=True)
    assert one.keys() == off.keys()
    for k in one:
        assert torch.allclose(one[k], off[k], atol=1e-6), (k, (one[k] - off[k]).abs().max())
    assert torch.load(str(tmp_path / "w1-offload-gpu.pt.lean0")) == dict(sampler=0.0, policy=0.0, buffers=0.0)


@pytest.mark.slow   # torchrun, two processes, twice
def test_offload_reduces_gradients_once_per_step(tmp_path):
    """--offload on two ranks: the micro-batches' gradients are held unsharded and reduce-scattered
    after the last one only (--offload-grads gpu), where FSDP2 by default reduce-scatters (and, on a
    GPU, copies to the host with a blocking copy) after each; the same update either way, and the
    one-process one. Each rank runs 2 micro-batches over 3 FSDP units (2 layers and the root)."""
    one = run(tmp_path, 1)
    held, each = run(tmp_path, 2, offload=True), run(tmp_path, 2, offload=True, grads="host")
    for k in one:
        assert torch.allclose(held[k], each[k], atol=1e-6), (k, (held[k] - each[k]).abs().max())
        assert torch.allclose(held[k], one[k], atol=1e-5), (k, (held[k] - one[k]).abs().max())
    count = lambda grads, r: torch.load(str(tmp_path / f"w2-offload-{grads}.pt.scatters{r}"))  # noqa: E731
    assert [count("gpu", r) for r in (0, 1)] == [3, 3] and [count("host", r) for r in (0, 1)] == [6, 6]


@pytest.mark.slow   # torchrun, two processes
def test_offload_refreshes_the_generation_copy_with_one_gather_per_layer(tmp_path):
    """--offload on two ranks: after the step the generation copy is refreshed with one all-gather
    per decoder layer and per parameter outside them (2 layers + embedding, norm, LM head: 5), on
    the copy's device and in its dtype (parallel.gather_into), with no full_tensor() (an fp32 gloo
    gather of each host shard); bitwise what full_tensor() cast to the copy's dtype gives, in fp32
    (the CPU's copy) and bf16 (CUDA's), and the policy untouched. Shards of rows that do not split
    evenly (5 rows: 3 + 2, 1 row: 1 + none) come back whole. The bytes it allocates are the plan's
    refresh term: one buffer, the largest group's (a layer, 9,344 parameters) shard and gathered group,
    serves every group, in fp32 as on the CPU and in bf16 as on a GPU without --offload, however late
    gloo drops a collective's tensors. That the gathers run on the GPU over NCCL, and the fp32 shard a
    GPU stages on its way from the host, only a GPU can show."""
    from harness import plan
    run(tmp_path, 2, offload=True)
    config = __import__("tiny").model(vocab_size=64, hidden=32, layers=2).config
    cfg = dict(model="x", prompts_per_step=4, gen_batch=4, group_size=2, k=1, max_new_tokens=10,
               micro_tokens=64, grad_ckpt=False, chunk_size=8)
    term = {torch.float32: plan.estimate(config, cfg, 2, "cpu", offload=True, probed=False)["refresh"],
            torch.bfloat16: plan.estimate(config, cfg, 2, "cuda", probed=False)["refresh"]}
    # the largest group: a layer (9,344 parameters), its shard and the gathered group
    assert term == {torch.float32: 4 * 9344 * 1.5, torch.bfloat16: 2 * 9344 * 1.5}
    for r in (0, 1):
        refresh = torch.load(str(tmp_path / f"w2-offload-gpu.pt.refresh{r}"))
        for dtype in (torch.float32, torch.bfloat16):
            got = refresh[dtype].pop("bytes")
            assert refresh[dtype] == dict(calls=["all_gather"] * 5, equal=True), (r, dtype)
            assert got == term[dtype], (r, dtype, got)
        assert refresh["policy unchanged"] and refresh["uneven"]


@pytest.mark.slow   # torchrun, two processes, and one process
def test_two_ranks_run_on_a_torch_without_all_gather_single(tmp_path):
    """torch before 2.13 (2.11 on the GPU check's machine) has all_gather_into_tensor, not its new
    name all_gather_single: the lean start and the refresh after the step take the older name and fill
    the generation copy exactly, with one all-gather per group (2 layers, embedding, norm, LM head)."""
    one, old = run(tmp_path, 1), run(tmp_path, 2, offload=True, old_torch=True)
    for k in one:
        assert torch.allclose(old[k], one[k], atol=1e-5), (k, (old[k] - one[k]).abs().max())
    for r in (0, 1):
        lean = torch.load(str(tmp_path / f"w2-offload-gpu-old.pt.lean{r}"))
        assert lean == dict(sampler=0.0, policy=0.0, buffers=0.0)
        refresh = torch.load(str(tmp_path / f"w2-offload-gpu-old.pt.refresh{r}"))
        for dtype in (torch.float32, torch.bfloat16):
            refresh[dtype].pop("bytes")
            assert refresh[dtype] == dict(calls=["all_gather"] * 5, equal=True), (r, dtype)
        assert refresh["policy unchanged"] and refresh["uneven"]


def test_rebuild_buffers_repairs_what_to_empty_leaves_as_garbage(tmp_path):
    """A model built on the meta device and materialised with to_empty has its weights loaded from
    the state dict, but not its rotary inv_freq (a non-persistent buffer): rebuild it."""
    from transformers import AutoModelForCausalLM
    from harness.parallel import rebuild_buffers
    ref = __import__("tiny").model(vocab_size=64, hidden=32, layers=2, seed=0)
    with torch.device("meta"):
        lean = AutoModelForCausalLM.from_config(ref.config)
    lean.to_empty(device="cpu")
    lean.load_state_dict(ref.state_dict())
    for b in lean.buffers():
        b.fill_(float("nan"))  # what uninitialised memory may hold
    ids = torch.tensor([[5, 9, 3, 7, 11, 2]])
    assert not torch.allclose(lean(ids).logits, ref(ids).logits, atol=1e-2)
    rebuild_buffers(lean, "cpu")
    assert {n for n, _ in lean.named_buffers()} == {n for n, _ in ref.named_buffers()}
    for (n, b), (_, r) in zip(lean.named_buffers(), ref.named_buffers()):
        assert b.dtype == r.dtype and torch.equal(b, r), n
    assert torch.equal(lean(ids).logits, ref(ids).logits)


def test_on_policy_update_equals_the_scored_old_logprobs_in_fp32():
    """One update per batch: old log-probs = current ones detached (ratio exactly 1) gives the same
    step as old log-probs from a separate scoring pass with the same fp32 weights."""
    import copy
    import grpo
    from grpo import pack, token_logprobs
    from harness.parallel import wrap
    from label import forward_pass
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (3, 5, 4)]
    responses = [torch.randint(4, 60, (n,), generator=g).tolist() for n in (6, 2, 7)]
    batch = pack(prompts, responses, pad_id=0)
    adv = torch.tensor([1.0, -0.5, 0.3])
    cfg = dict(agg="token-mean", max_new_tokens=8, temperature=0.8, chunk_size=4, clip_low=0.2, clip_high=0.2, grad_clip=1.0)
    mbs, out = [[0, 1], [2]], {}
    for path in ("on-policy", "scored"):
        model = __import__("tiny").model(vocab_size=64, hidden=32, layers=2, seed=0)
        policy, _ = wrap(model, torch.device("cpu"), token_logprobs)
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        old = None
        if path == "scored":
            old = forward_pass(copy.deepcopy(model).eval(), batch, torch.zeros(3, 1, dtype=torch.long),
                        cfg["temperature"], cfg["chunk_size"])[0]
        stats = grpo.update(policy, opt, batch, old, adv, mbs, cfg, torch.device("cpu"))
        out[path] = (stats, {k: v.detach().clone() for k, v in model.state_dict().items()})
    (s1, w1), (s2, w2) = out["on-policy"], out["scored"]
    assert s1["ratio_mean"] == 1.0 and s1["clip_frac"] == 0.0
    assert abs(s2["ratio_mean"] - 1.0) < 1e-6 and s2["clip_frac"] == 0.0
    assert abs(s1["loss"] - s2["loss"]) < 1e-6
    init = __import__("tiny").model(vocab_size=64, hidden=32, layers=2, seed=0).state_dict()
    assert max((w1[k] - init[k]).abs().max().item() for k in w1) > 1e-3
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-6), (k, (w1[k] - w2[k]).abs().max())


@pytest.mark.parametrize("cuda, offload, expected", [(False, True, "gloo"), (True, False, "nccl"),
                                                     (True, True, "cuda:nccl,cpu:gloo")])
def test_setup_picks_a_backend_for_cpu_collectives_and_a_long_timeout(monkeypatch, cuda, offload, expected):
    """With --offload on CUDA the shards are CPU tensors whose DTensor collectives NCCL cannot serve;
    rank 0's saves (and first download) outlast NCCL's default 10-minute timeout."""
    import datetime
    from harness import parallel
    seen = {}
    monkeypatch.setattr(parallel, "WORLD", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda *a, **k: seen.update(args=a, kwargs=k))
    device = parallel.setup(offload)
    assert device.type == ("cuda" if cuda else "cpu")
    assert seen["args"] == (expected,)
    assert seen["kwargs"]["timeout"] >= datetime.timedelta(hours=1)


def test_the_one_gpu_generation_copy_is_bf16_with_fp32_rotary_frequencies():
    """wrap's generation copy on CUDA (built where the model is, so no GPU is needed): bf16 weights,
    the rotary inv_freq exactly as built in fp32; in bf16 it turns position 1000 by about 1.2 rad."""
    from grpo import token_logprobs
    from harness.parallel import wrap
    model = __import__("tiny").model(vocab_size=64, hidden=32, layers=2, seed=0)
    policy, sampler = wrap(model, torch.device("cuda"), token_logprobs)
    assert policy is model and all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in sampler.parameters())
    fresh = type(model.model.rotary_emb)(config=model.config)
    for name in ("inv_freq", "original_inv_freq"):
        b = getattr(sampler.model.rotary_emb, name)
        assert b.dtype == torch.float32 and torch.equal(b, getattr(fresh, name)), name


def test_leave_ends_a_process_that_made_a_group_at_once_with_its_output_flushed():
    """After setup's group, leave() is os._exit(0): what was printed arrives, and nothing of the
    interpreter's finalization runs (an atexit handler stands for it); without a group, nothing."""
    code = ("import atexit; from harness import parallel; atexit.register(print, 'finalized'); "
            "print('done', end=''); {}parallel.leave(); print(' went on')")
    for grouped, out in ((True, "done"), (False, "done went on\nfinalized\n")):
        res = subprocess.run([sys.executable, "-c", code.format("parallel.GROUPED.append('gloo'); " * grouped)],
                             cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=120)
        assert (res.returncode, res.stdout) == (0, out), res.stderr[-2000:]
