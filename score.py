"""The scoring forward: one no-grad pass over prompt + response with the rollout weights.

It yields the two things the RL step needs from the policy before it changes:
- old token log-probs at the sampling temperature (chunked LM head, `grpo.logprobs_from_hidden`),
  the denominators of the PPO ratio, needed only with several updates per batch (--ppo-epochs > 1;
  with one update the old log-probs are the current ones, detached, and train.py passes
  logprobs=False, so this pass never runs the LM head);
- probe features at the truncation points: the last decoder layer's output (before the final
  norm), averaged over the `last_k` = 4 positions before each budget end (`probe.prefix_features`).
  With final_norm=True it is instead the final normed state of the single last token of the
  prefix (the protocol of the released evaluation code).

The last layer's output is captured by a forward hook that immediately reduces it to the requested
positions, so no [N, L, d] stack of hidden states (`output_hidden_states`) is ever kept.
"""
import torch

from grpo import logprobs_from_hidden
from probe import prefix_features


def budget_ends(prompt_lens, budget_lists, width=None):
    """Absolute exclusive ends `len(prompt_i) + b` as a [N, B] long tensor (0 = no budget)."""
    width = width or max((len(bs) for bs in budget_lists), default=0)
    ends = torch.zeros(len(budget_lists), max(width, 1), dtype=torch.long)
    for i, bs in enumerate(budget_lists):
        for j, b in enumerate(bs):
            ends[i, j] = int(prompt_lens[i]) + b
    return ends


@torch.no_grad()
def score(model, batch, ends, temperature=1.0, chunk_size=1024, last_k=4, final_norm=False,
          logprobs=True):
    """Old log-probs and probe features from one forward.

    batch: `grpo.pack` output (input_ids / attention_mask [N, L]); ends: [N, B] absolute ends.
    Returns (old_logp [N, L-1] float32 or None, feats [N, B, d] float32, valid [N, B] bool).
    """
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ends = ends.to(ids.device)
    decoder = model.model
    captured = {}

    def keep_needed(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        captured["feats"] = prefix_features(hidden, ends, last_k)

    handle = None if final_norm else decoder.layers[-1].register_forward_hook(keep_needed)
    try:
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        if handle is not None:
            handle.remove()
    feats, valid = prefix_features(hidden, ends, 1) if final_norm else captured["feats"]
    old_logp = None
    if logprobs:
        old_logp = logprobs_from_hidden(hidden, model.lm_head, ids[:, 1:], temperature,
                                        chunk_size).float()
    return old_logp, feats, valid
