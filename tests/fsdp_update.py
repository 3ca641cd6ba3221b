"""Run by test_parallel.py: one policy update on a fixed batch, in 1 process or under torchrun,
then (sharded) the refresh of the generation copy, then one probe fit on features that differ per rank.

Each rank takes every WORLD-th sequence; with FSDP2 the update must equal the one-process update
on the whole batch (the loss is a token-mean over all ranks' tokens), with C2GSPG's term too
(C2GSPG=form). The probe is fitted on the
pairs pooled from all ranks, so every rank must end with the same probe.
"""
import os
import sys

import torch

import baselines
import probe as probe_lib
import tiny
import grpo
import train
from grpo import pack, token_logprobs
from label import cut_mask, grid
from live_bytes import LiveBytes
from harness.parallel import (MASTER, RANK, WORLD, full_state, gather_into, leave, refresh_sampler, setup,
                              sharded, teardown, wrap)

offload = os.environ.get("OFFLOAD") == "1"  # FSDP2 with CPUOffloadPolicy, also as one rank
if os.environ.get("OLD_TORCH") == "1":
    # torch before 2.13 (the GPU check's machine has 2.11) names all_gather_single all_gather_into_tensor;
    # its own FSDP2 calls that older name, so FSDP2's view of torch.distributed keeps the new one here
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    class Torch211FSDP:
        def __getattr__(self, name):
            new = name == "all_gather_single"
            return getattr(torch.distributed.distributed_c10d if new else torch.distributed, name)
    _fsdp_collectives.dist = Torch211FSDP()
    del torch.distributed.all_gather_single
GATHER = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
grads = os.environ.get("OFFLOAD_GRADS", "gpu")  # --offload-grads
device = setup(offload)
model = tiny.model(vocab_size=64, hidden=32, layers=2, seed=0).train()
policy, sampler = wrap(model, device, token_logprobs, offload)
opt = torch.optim.SGD(policy.parameters(), lr=0.5)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
prompts, responses, adv = tiny.fixed_rollouts()
mine = list(range(RANK, 4, WORLD))
batch = pack([prompts[i] for i in mine], [responses[i] for i in mine], pad_id=0)
old = torch.full(batch["loss_mask"].shape, -4.0)
cfg = dict(agg="token-mean", reward="rlcm", max_new_tokens=8, temperature=0.8, chunk_size=4, clip_low=0.2,
           clip_high=0.2, grad_clip=1e9, probe_passes=4, corner="zero", offload=offload,
           offload_grads=grads)
mbs = [[j] for j in range(len(mine))]  # one sequence per micro-batch: accumulation is exercised
scatters = []  # FSDP2's reduce-scatters of gradients in the update (one per FSDP unit each time)
counted = torch.distributed.reduce_scatter_single
torch.distributed.reduce_scatter_single = lambda *a, **kw: scatters.append(1) or counted(*a, **kw)
form = os.environ.get("C2GSPG", "")  # C2GSPG's loss term (baselines.c2gspg_loss) in the update
extra = baselines.c2gspg_loss(torch.tensor([1.0, 0.0, 0.0, 1.0])[mine], form) if form else None
stats = grpo.update(policy, opt, batch, old, adv[mine], mbs, cfg, device, extra)
torch.save(stats, f"{sys.argv[1]}.stats{RANK}")
torch.distributed.reduce_scatter_single = counted
torch.save(len(scatters), f"{sys.argv[1]}.scatters{RANK}")
state, _ = full_state(policy, opt)

if sharded(policy):  # the refresh of the generation copy after the step, against today's full_tensor() per parameter
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    calls, full_tensor, gather = [], DTensor.full_tensor, getattr(torch.distributed, GATHER)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    refresh = {}
    for dtype in (torch.float32, torch.bfloat16):  # the copy's dtype on CPU and on CUDA
        for p in sampler.parameters():
            p.data = torch.full_like(p.data, float("nan"), dtype=dtype)
        DTensor.full_tensor = lambda self, *a, **kw: calls.append("full_tensor") or full_tensor(self, *a, **kw)
        setattr(torch.distributed, GATHER, lambda *a, **kw: calls.append("all_gather") or gather(*a, **kw))
        with LiveBytes(known=[*sampler.parameters(), *(p.to_local() for p in model.parameters())]) as live:
            refresh_sampler(sampler, policy)
        DTensor.full_tensor = full_tensor
        setattr(torch.distributed, GATHER, gather)
        copy = dict(sampler.named_parameters())
        refresh[dtype] = dict(calls=calls[:], equal=all(torch.equal(copy[n], p.full_tensor().to(dtype))
                                                        for n, p in model.named_parameters()), bytes=live.peak)
        calls.clear()
    refresh["policy unchanged"] = all(torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters())
    # rows that do not split evenly: 5 rows on 2 ranks are 3 + 2, 1 row is 1 + none (torch.chunk)
    full = [torch.arange(15.0).view(5, 3), torch.arange(4.0).view(1, 4), torch.arange(7.0)]
    dst = [torch.zeros_like(t) for t in full]
    mesh = next(iter(model.parameters())).device_mesh
    gather_into([(d, distribute_tensor(t, mesh, [Shard(0)])) for d, t in zip(dst, full)])
    refresh["uneven"] = all(torch.equal(d, t) for d, t in zip(dst, full))
    torch.save(refresh, f"{sys.argv[1]}.refresh{RANK}")

torch.manual_seed(0)  # the same initial probe on every rank, as train.run builds it
probe = probe_lib.Probe(32)
probe_opt = probe_lib.make_optimizer(probe)
feats = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(100 + RANK))
labels = [[1.0, 0.5, 0.0], [0.25, 1.0]] if RANK == 0 else [[0.0, 0.0, 1.0], [0.75, 0.5]]
train.fit_probe(probe, probe_opt, feats[cut_mask(labels)], grid(labels)[cut_mask(labels)], cfg, seed=3)
torch.save(probe.state_dict(), f"{sys.argv[1]}.probe{RANK}")

if torch.distributed.is_initialized():  # the lean start: rank 0 reads the toy, the others get shards
    from harness.checkpoint import load_model, load_sharded
    ref, _ = load_model("toy")
    lean, sampler, lm, _ = load_sharded("toy", device, token_logprobs, offload)
    ids = torch.tensor([[5, 9, 3, 7, 11, 2, 40]])
    with torch.no_grad():
        diffs = dict(sampler=(sampler(ids).logits - ref(ids).logits).abs().max().item())
        mine = dict(lm.named_parameters(remove_duplicate=False))
        diffs["policy"] = max((mine[n].full_tensor().cpu() - p).abs().max().item()
                              for n, p in ref.named_parameters(remove_duplicate=False))
        diffs["buffers"] = max((b.cpu() - dict(ref.named_buffers())[n]).abs().max().item()
                               for n, b in list(lm.named_buffers()) + list(sampler.named_buffers()))
    torch.save(diffs, f"{sys.argv[1]}.lean{RANK}")
if MASTER:
    torch.save({k: v.detach().cpu() for k, v in state.items()}, sys.argv[1])
    print("loss", stats["loss"])
teardown(finished=True)  # each rank waits for the others before closing its connections
leave()  # no interpreter finalization (harness.parallel.leave)
