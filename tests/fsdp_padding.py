"""Run by test_update.py: one FSDP2 update where the ranks have different numbers of micro-batches
(rank 0 one, rank 1 three), so rank 0 runs two 2-token padding micro-batches; in 1 process or under
torchrun. Writes the updated weights and the sampler-gap stats (the sampler's log-probs are the
trainer's shifted by a known delta per sequence) to argv[1] from rank 0."""
import sys

import torch

import tiny
import grpo
from grpo import pack, token_logprobs
from harness.parallel import MASTER, RANK, WORLD, full_state, leave, setup, teardown, wrap

device = setup()
model = tiny.model(vocab_size=64, hidden=32, layers=2, seed=0).train()
prompts, responses, adv = tiny.fixed_rollouts()
deltas = [0.1, -0.2, 0.05, 0.3]
with torch.no_grad():
    full = pack(prompts, responses, pad_id=0)
    logp = token_logprobs(model, full["input_ids"], full["attention_mask"], 0.8)
sampler = [(logp[i][full["loss_mask"][i] > 0] - d).tolist() for i, d in enumerate(deltas)]
mine = [[0], [1, 2, 3]][RANK] if WORLD == 2 else [0, 1, 2, 3]
shapes = []  # what this rank's decoder forwards: rank 0 pads with two (1, 2) micro-batches
model.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                      with_kwargs=True)
policy, _ = wrap(model, device, token_logprobs)
opt = torch.optim.SGD(policy.parameters(), lr=0.5)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
batch = pack([prompts[i] for i in mine], [responses[i] for i in mine], 0, [sampler[i] for i in mine])
adv = adv[mine]
cfg = dict(agg="token-mean", reward="rlcm", max_new_tokens=8, temperature=0.8, chunk_size=4, clip_low=0.2,
           clip_high=0.2, grad_clip=1e9)
mbs = [[j] for j in range(len(mine))] if WORLD == 2 else [[0], [1], [2], [3]]
stats = grpo.update(policy, opt, batch, None, adv, mbs, cfg, device)
state, _ = full_state(policy, opt)
if MASTER:
    torch.save(dict(state={k: v.detach().cpu() for k, v in state.items()}, stats=stats, shapes=shapes), sys.argv[1])
teardown(finished=True)  # each rank waits for the others before closing its connections
leave()  # no interpreter finalization (harness.parallel.leave)
