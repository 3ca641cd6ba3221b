"""Run by test_lora.py: one LoRA policy update on a fixed batch, in 1 process or under torchrun.

As tests/fsdp_update.py, with an adapter on the tiny model: each rank takes every WORLD-th sequence,
and the sharded update of the adapter must equal the one-process update on the whole batch. Sharded,
the generation copy is the merged one: refreshed after the step, its log-probs against the adapted
policy's, in fp32 and in bf16. Then the lean start with an adapter (rank 0 adapts the toy, the
others get their shards) must give the adapted model rank 0 built.
"""
import copy as copy_lib
import sys

import torch

import grpo
import tiny
import train
from grpo import pack, token_logprobs
from label import cut_mask, grid
from harness import lora
from harness.checkpoint import load_model, load_sharded, with_adapter
from harness.parallel import MASTER, RANK, WORLD, full_state, leave, refresh_sampler, setup, teardown, wrap

GATHER = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
CFG = dict(lora_rank=4, lora_alpha=8.0, lora_targets="all-linear", model="toy")
device = setup()
model = lora.add_adapter(tiny.model(vocab_size=64, hidden=32, layers=2, seed=0), CFG, "tiny")
with torch.no_grad():  # lora_B starts at zero, which leaves lora_A without a gradient in the first step
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.normal_(0, 0.1)
model.train()
frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
policy, sampler = wrap(model, device, token_logprobs)
opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
prompts, responses, adv = tiny.fixed_rollouts()
mine = list(range(RANK, 4, WORLD))
batch = pack([prompts[i] for i in mine], [responses[i] for i in mine], pad_id=0)
cfg = dict(agg="token-mean", max_new_tokens=8, temperature=0.8, chunk_size=4, clip_low=0.2,
           clip_high=0.2, grad_clip=1e9)
stats = grpo.update(policy, opt, batch, None, adv[mine], [[j] for j in range(len(mine))], cfg, device)
state, opt_state = full_state(policy, opt)
if torch.distributed.is_initialized():  # the merged copy after the step, against the adapted policy itself
    from peft.tuners.lora import LoraLayer
    ids = torch.randint(3, 64, (4, 24), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    merged = dict(plain=not any(isinstance(m, LoraLayer) for m in sampler.modules()))
    for dtype in (torch.float32, torch.bfloat16):  # the copy's dtype on CPU, then on CUDA
        for p in sampler.parameters():
            p.data = p.data.to(dtype)
        refresh_sampler(sampler, policy)
        with torch.no_grad():
            err = (token_logprobs(sampler, ids, mask) - policy(ids, mask)).abs()
            merged[str(dtype)] = (err.max().item(), err.mean().item())
            policy.reshard()  # the root's forward leaves its weights gathered
            if dtype == torch.float32:  # the adapter moved the merged weights off the base
                weights = dict(sampler.named_parameters())
                merged["moved"] = min((weights[n.replace(".base_layer.", ".")] - p.full_tensor()).abs().max().item()
                                      for n, p in model.named_parameters() if n.endswith(".base_layer.weight"))
    # the copy several ranks sampled from before: the adapted model, unmerged, cast to bf16
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    unmerged = lora.add_adapter(tiny.model(vocab_size=64, hidden=32, layers=2, seed=0), CFG, "tiny")
    unmerged.load_state_dict(full)
    with torch.no_grad():
        err = (token_logprobs(copy_lib.deepcopy(unmerged).to(torch.bfloat16), ids, mask) - policy(ids, mask)).abs()
        merged["unmerged bf16"] = (err.max().item(), err.mean().item())
        policy.reshard()
    # the copy one GPU merges (lora.merged_copy) from the same adapter on the same base, bf16 there
    for n, p in unmerged.named_parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    one_gpu = dict(lora.merged_copy(unmerged).named_parameters())
    merged["one GPU's"] = all(torch.equal(p, one_gpu[n]) for n, p in sampler.named_parameters())
    merged["base"] = all(torch.equal(p.full_tensor(), frozen[n]) for n, p in model.named_parameters()
                         if not p.requires_grad)
    torch.save(merged, f"{sys.argv[1]}.merged{RANK}")

if torch.distributed.is_initialized():
    torch.manual_seed(5)
    ref = with_adapter(load_model("toy")[0], CFG)
    # every rank seeded alike, as train.run does; then rank 0 draws the adapter's init twice (its
    # model and the meta one), the others once: rank 0's adapter is broadcast, and the probe built
    # next (train.new_probe, no reseeding here) and its fit (dropout) must be the same on every rank
    torch.manual_seed(5)
    lean, sampler, lm, _ = load_sharded("toy", device, token_logprobs, adapt=lambda m, meta: with_adapter(m, CFG))
    probe, probe_opt = train.new_probe(dict(seed=3, probe_hidden=None, probe_lr=1e-2), lm.config.hidden_size)
    init = {k: v.clone() for k, v in probe.state_dict().items()}
    feats = torch.randn(2, 3, lm.config.hidden_size, generator=torch.Generator().manual_seed(100 + RANK))
    labels = [[1.0, 0.5, 0.0], [0.25, 1.0]] if RANK == 0 else [[0.0, 0.0, 1.0], [0.75, 0.5]]
    train.fit_probe(probe, probe_opt, feats[cut_mask(labels)], grid(labels)[cut_mask(labels)],
                    dict(CFG, reward="rlcm", probe_passes=4, corner="zero"), seed=3)
    torch.save(dict(init=init, fitted=probe.state_dict()), f"{sys.argv[1]}.probe{RANK}")
    # a refresh after a step gathers the adapter and the adapted linears' frozen W, which its merge
    # overwrites (elements gathered, padding included: every dimension splits evenly here); the other
    # frozen weights were copied once, at the start
    gathered, gather = [], getattr(torch.distributed, GATHER)
    setattr(torch.distributed, GATHER, lambda out, *a, **kw: gathered.append(out.numel()) or gather(out, *a, **kw))
    refresh_sampler(sampler, lean)
    setattr(torch.distributed, GATHER, gather)
    ids = torch.tensor([[5, 9, 3, 7, 11, 2, 40]])
    with torch.no_grad():
        mine = dict(lm.named_parameters())
        diff = dict(sampler=(sampler(ids).logits - ref(ids).logits).abs().max().item(),
                    gathered=sum(gathered) == sum(p.numel() for n, p in lm.named_parameters()
                                                  if p.requires_grad or n.endswith(".base_layer.weight")) > 0,
                    policy=max((mine[n].full_tensor() - p).abs().max().item() for n, p in ref.named_parameters()),
                    trainable=sorted(n for n, p in lm.named_parameters() if p.requires_grad)
                    == sorted(n for n, p in ref.named_parameters() if p.requires_grad))
    torch.save(diff, f"{sys.argv[1]}.lean{RANK}")
if MASTER:
    torch.save(dict(model=state, steps=[s["step"] for s in opt_state["state"].values()]), sys.argv[1])
teardown(finished=True)  # each rank waits for the others before closing its connections
leave()  # no interpreter finalization (harness.parallel.leave)
