"""Run by test_lora.py: one LoRA policy update on a fixed batch, in 1 process or under torchrun.

As tests/fsdp_update.py, with an adapter on the tiny model: each rank takes every WORLD-th sequence,
and the sharded update of the adapter must equal the one-process update on the whole batch. Then
the lean start with an adapter (rank 0 adapts the toy, the others get their shards) must give the
adapted model rank 0 built.
"""
import sys

import torch

import step
import tiny
import train
from grpo import pack
from label import cut_mask, grid
from harness import lora
from harness.parallel import MASTER, RANK, WORLD, full_state, load_sharded, refresh_sampler, setup, teardown, wrap

CFG = dict(lora_rank=4, lora_alpha=8.0, lora_targets="all-linear", model="toy")
device = setup()
model = lora.add_adapter(tiny.model(vocab_size=64, hidden=32, layers=2, seed=0), CFG, "tiny")
with torch.no_grad():  # lora_B starts at zero, which leaves lora_A without a gradient in the first step
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.normal_(0, 0.1)
model.train()
policy, _ = wrap(model, device)
opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
prompts, responses, adv = tiny.fixed_rollouts()
mine = list(range(RANK, 4, WORLD))
batch = pack([prompts[i] for i in mine], [responses[i] for i in mine], pad_id=0)
cfg = dict(agg="token-mean", max_new_tokens=8, temperature=0.8, chunk_size=4, clip_low=0.2,
           clip_high=0.2, grad_clip=1e9)
stats = step.update(policy, opt, sched, batch, None, adv[mine], [[j] for j in range(len(mine))], cfg, device)
state, opt_state = full_state(policy, opt)

if torch.distributed.is_initialized():
    from harness.models import load_model
    torch.manual_seed(5)
    ref = lora.with_adapter(load_model("toy")[0], CFG)
    # every rank seeded alike, as train.run does; then rank 0 draws the adapter's init twice (its
    # model and the meta one), the others once: rank 0's adapter is broadcast, and the probe built
    # next (train.new_probe, no reseeding here) and its fit (dropout) must be the same on every rank
    torch.manual_seed(5)
    lean, sampler, lm, _ = load_sharded("toy", device, adapt=lambda m, meta: lora.with_adapter(m, CFG))
    probe, probe_opt = train.new_probe(dict(seed=3, probe_hidden=None, probe_lr=1e-2), lm.config.hidden_size)
    init = {k: v.clone() for k, v in probe.state_dict().items()}
    feats = torch.randn(2, 3, lm.config.hidden_size, generator=torch.Generator().manual_seed(100 + RANK))
    labels = [[1.0, 0.5, 0.0], [0.25, 1.0]] if RANK == 0 else [[0.0, 0.0, 1.0], [0.75, 0.5]]
    step.probe_margin(probe, probe_opt, feats, grid(labels), cut_mask(labels),
                      dict(CFG, reward="rlcm", probe_passes=4, probe_batch=2, corner="zero"), seed=3)
    torch.save(dict(init=init, fitted=probe.state_dict()), f"{sys.argv[1]}.probe{RANK}")
    # a refresh after a step gathers the adapter alone (elements gathered, padding included: every
    # adapter dimension splits evenly here): the frozen base was copied once, at the start
    gathered, gather = [], torch.distributed.all_gather_single
    torch.distributed.all_gather_single = lambda out, *a, **kw: gathered.append(out.numel()) or gather(out, *a, **kw)
    refresh_sampler(sampler, lean)
    torch.distributed.all_gather_single = gather
    ids = torch.tensor([[5, 9, 3, 7, 11, 2, 40]])
    with torch.no_grad():
        mine = dict(lm.named_parameters())
        diff = dict(sampler=(sampler(ids).logits - ref(ids).logits).abs().max().item(),
                    gathered=sum(gathered) == sum(p.numel() for p in lm.parameters() if p.requires_grad) > 0,
                    policy=max((mine[n].full_tensor() - p).abs().max().item() for n, p in ref.named_parameters()),
                    trainable=sorted(n for n, p in lm.named_parameters() if p.requires_grad)
                    == sorted(n for n, p in ref.named_parameters() if p.requires_grad))
    torch.save(diff, f"{sys.argv[1]}.lean{RANK}")
if MASTER:
    torch.save(dict(model=state, steps=[s["step"] for s in opt_state["state"].values()]), sys.argv[1])
teardown()
