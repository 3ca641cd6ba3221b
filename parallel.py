"""One node of GPUs: process setup, FSDP2 sharding, collectives, and the generation copy.

`torchrun --nproc_per_node N train.py ...` sets RANK / WORLD_SIZE / LOCAL_RANK; without them
everything here is the identity and the code runs as one process (CPU or one GPU). On CPU the same
path runs with the gloo backend (tests use two processes).

Layout on N GPUs (DESIGN.md, "Scale"): the trained policy is sharded with FSDP2 (`fully_shard` per
decoder layer, then the root; bf16 compute, fp32 gradient reduction); each rank keeps a plain
bf16 copy of the full weights for generation, labelling and scoring, refreshed after every
optimizer step; whole prompt groups stay on one rank.
"""
import copy
import os

import torch
import torch.distributed as dist

from grpo import token_logprobs

RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
MASTER = RANK == 0


def setup():
    """Init the process group under torchrun and return this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if WORLD > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()


def all_sum(values, device):
    """Sum a list of floats over ranks (identity in one process)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if WORLD > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_gather(obj):
    """List of every rank's `obj` (picklable), in rank order."""
    if WORLD == 1:
        return [obj]
    out = [None] * WORLD
    dist.all_gather_object(out, obj)
    return out


class LogprobModel(torch.nn.Module):
    """The policy as one module whose forward is the chunked token log-prob computation.

    FSDP2 gathers a module's own parameters around its forward: with the whole computation
    (decoder + chunked LM head) inside the root forward, the LM head runs chunk by chunk on
    gathered weights and its gradient is reduced once.
    """

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, temperature=1.0, chunk_size=1024):
        # a fresh tensor, not a view: FSDP2 hooks the output for the backward all-gather
        return token_logprobs(self.lm, input_ids, attention_mask, temperature, chunk_size).clone()


def wrap(lm, device):
    """(trainable module, generation copy). One process on CPU: both are the same fp32 model."""
    sampler = lm
    if device.type == "cuda" or WORLD > 1:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        sampler = copy.deepcopy(lm).to(dtype).eval().requires_grad_(False)
    policy = LogprobModel(lm)
    if WORLD > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if device.type == "cuda" else MixedPrecisionPolicy()
        for layer in lm.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(policy, mp_policy=mp)
    return policy, sampler


@torch.no_grad()
def refresh_sampler(sampler, policy):
    """Copy the trained (possibly sharded) weights into the generation copy."""
    if sampler is policy.lm:
        return
    params = dict(sampler.named_parameters())
    for name, p in policy.lm.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name].copy_(full.to(params[name].dtype))


def full_state(policy, opt):
    """(model state dict, optimizer state dict) as full CPU tensors on rank 0 (None elsewhere)."""
    if WORLD == 1:
        return policy.lm.state_dict(), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(policy.lm, options=opts)
    opt_sd = get_optimizer_state_dict(policy, opt, options=opts)
    return (model_sd, opt_sd) if MASTER else (None, None)


def load_optimizer(policy, opt, state):
    if WORLD == 1:
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(policy, opt, state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
