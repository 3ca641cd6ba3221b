"""Monte-Carlo labels for reasoning prefixes: truncate, force an answer K times, count.

    b      = min(T, round(f * T))   for f in (0.25, 0.5, 0.75)    (T: response tokens, EOS included)
    forced = prompt + response[:b] + CLOSE + SUFFIX                (CLOSE: `</think>` or EOS)
    Y_b    = (1/K) * sum_k 1[answer_k == gold]    (grade.answers_match)

`mc_labels` is the algorithm. `forced_answers` samples them: one forward over each trajectory
(the probe's features h_b are read there), its row copied once per cut with the response past b
masked out, CLOSE + SUFFIX appended, K answers sampled: what rollout.generate samples from the
whole forced prompts, without prefilling a trajectory once per cut (tests/test_label.py). The
trajectories go in chunks of similar length, about batch_size cuts each, so short ones carry no
padding of long ones."""
from contextlib import nullcontext

import torch
from tqdm import tqdm

from grade import answers_match, forced_answer
from grpo import logprobs_from_hidden
from probe import LAST_K, last_layer, prefix_features
from rollout import Sampler, row_generators
from harness import staticcache
SUFFIX = "\nIf I were to output the final answer now, it would be \\boxed{"
# How the forced answers are sampled, whatever --temperature says: the released values (the
# forced-output agent loop, docs/reference.md's Map); harness/plan.py plans for these 32 tokens
FORCED = dict(temperature=0.8, top_p=1.0, max_new_tokens=32, stop=("\n",))


def cuts_of(length, budgets=(0.25, 0.5, 0.75)):
    """The cuts (token counts) the budgets (fractions) give: cuts_of(8) == [2, 4, 6], cuts_of(3) ==
    [1, 2], cuts_of(0) == []."""
    return sorted({b for b in (min(length, round(f * length)) for f in budgets) if b > 0})


def grid(lists, width=None):
    """N per-trajectory lists aligned with their cuts (floats, or [n_i, d] tensors) -> a zero-padded
    [N, width] (or [N, width, d]) float32 tensor, width = the longest list (at least 1)."""
    width = width or max(1, max((len(x) for x in lists), default=0))
    tensors = [torch.as_tensor(x, dtype=torch.float32) for x in lists]
    out = torch.zeros(len(lists), width, *(tensors[0].shape[1:] if tensors else ()))
    for i, x in enumerate(tensors):
        out[i, :len(x)] = x
    return out


def cut_mask(cut_lists):
    """[N, B] bool, True at the cuts of each list: where grid(...) of lists aligned with them is real."""
    return grid([[1] * len(bs) for bs in cut_lists]) > 0


def close_id(tokenizer, close="think"):
    """Token id inserted between the prefix and the suffix: `</think>` or the EOS token."""
    if close == "eos":
        return tokenizer.eos_token_id
    tid = tokenizer.convert_tokens_to_ids("</think>")
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError("the tokenizer has no `</think>` token: use --forced-close eos")
    return tid


def closed_cut(response, b, close):
    """b, or b - 1 where response[:b] ends on the close id: the prefix before CLOSE + SUFFIX, so
    that the close token is never doubled."""
    return b - 1 if b > 0 and response[b - 1] == close else b


def mc_labels(model, tokenizer, prompts, responses, cut_lists, golds, k=4, sampling=FORCED,
              close="think", suffix=SUFFIX, seed=None, batch_size=None, grader="math", decode=None,
              features=False, final_norm=False):
    """Y_b for every (trajectory, cut b) (module docstring) -> N lists of floats in [0, 1], aligned
    with cut_lists. prompts, responses: N lists of token ids; cut_lists: N lists of cuts b.
    features=True: (labels, feats), feats N [len(cuts), d] (forced_answers; final_norm: the post-hoc's)."""
    # 1. The forced prompt after every cut. Equal ones (samples of a problem that agree up to the
    #    cut, common for short prefixes) estimate the same probability: each is asked once.
    tail = [close_id(tokenizer, close)] + tokenizer.encode(suffix, add_special_tokens=False)
    index, asked, where = {}, [], []  # asked[j]: the (trajectory, b) of distinct forced prompt j
    for i, (p, r, bs) in enumerate(zip(prompts, responses, cut_lists)):
        where.append([])  # the j of each of trajectory i's cuts
        for b in bs:
            b = closed_cut(r, b, tail[0])  # a cut ending on CLOSE is asked without a second one
            j = index.setdefault((*p, *r[:b], *tail), len(asked))  # the forced prompt's ids
            if j == len(asked):
                asked.append((i, b))
            where[-1].append(j)
    # 2. K answers to each: texts[j*k:(j+1)*k] for forced prompt j.
    texts, feats = forced_answers(model, tokenizer, prompts, responses, cut_lists, asked, tail, k,
                                  sampling, seed, batch_size, decode, final_norm=final_norm)
    # 3. Y_b = the share of them that match the gold; a box that never closes is wrong.
    y = [sum(answers_match(forced_answer(t), golds[i], grader) for t in texts[j * k:(j + 1) * k])
         / k for j, (i, _) in enumerate(asked)]
    labels = [[y[j] for j in js] for js in where]
    return (labels, feats) if features else labels


@torch.no_grad()
def forced_answers(model, tokenizer, prompts, responses, cut_lists, asked, tail, k, sampling=FORCED,
                   seed=None, batch_size=None, decode=None, progress=None, final_norm=False):
    """The K answers to each forced prompt asked[j] = (i, b), texts[j*k:(j+1)*k], and the features
    at each trajectory's cuts, feats N [len(cut_lists[i]), d] (module docstring) -> (texts, feats).
    sampling: FORCED's keys. final_norm: the post-hoc probe's feature. progress: a bar's label."""
    sampler = Sampler(model, tokenizer, **sampling, decode=decode,  # CUDA: a stopped one also stops
                      close_depth=1 if sampling["stop"] else None)  # at its box's closing brace
    if sampler.static is not None:  # the rollout's buffers must not sit under the labels' prefills
        staticcache.release(model)
    trajs = sorted((i for i, bs in enumerate(cut_lists) if bs), key=lambda i: max(cut_lists[i]))
    per = max(1, (batch_size or len(asked)) // max([1, *map(len, cut_lists)]))  # per chunk
    texts, feats = [None] * (len(asked) * k), [torch.zeros(0, model.config.hidden_size)] * len(prompts)
    was_training = model.training
    model.eval()
    chunks = [trajs[at:at + per] for at in range(0, len(trajs), per)]
    for chunk in tqdm(chunks, desc=progress, disable=not progress):
        seqs = [list(prompts[i]) + list(responses[i][:max(cut_lists[i])]) for i in chunk]
        width, got = max(map(len, seqs)), []
        with last_layer(model, got.append):
            pre = sampler.prefill(seqs)  # left-padded: row m's token t sits at column pads[m] + t
        pads = [width - len(s) for s in seqs]
        for m, i in enumerate(chunk):  # h_b off its own columns (a window may reach the prompt)
            ends = [[len(prompts[i]) + b for b in cut_lists[i]]]
            h = got[0][m:m + 1, pads[m]:]
            h, last = (model.model.norm(h), 1) if final_norm else (h, LAST_K)
            feats[i] = prefix_features(h, ends, last)[0][0].cpu()
        row = {i: m for m, i in enumerate(chunk)}  # (row, j, prefix length) of each prompt asked
        asks = [(row[i], j, len(prompts[i]) + b) for j, (i, b) in enumerate(asked) if i in row]
        for at in range(0, len(asks), batch_size or len(asks)):  # at most batch_size cuts at once
            part = asks[at:at + (batch_size or len(asks))]
            if at:  # batch_size below a trajectory's cuts: its prefill again for the next ones
                pre = sampler.prefill(seqs)
            idx = torch.tensor([m for m, _, _ in part], device=sampler.device)
            pre.cache.batch_select_indices(idx)  # a copy of trajectory m's row for each cut it asks
            cut = torch.tensor([pads[m] + end for m, _, end in part], device=idx.device)
            pre.mask = pre.mask[idx] * (torch.arange(width, device=idx.device) < cut[:, None])
            pre = sampler.prefill([list(tail)] * len(part), after=pre)
            forced = [seqs[m][:end] + list(tail) for m, _, end in part]
            ids, length, _ = sampler.sample(pre, k, row_generators(seed, forced, k, sampler.device))
            out = tokenizer.batch_decode([r[:n] for r, n in zip(ids.tolist(), length.tolist())],
                                         skip_special_tokens=True)
            for r, (_, j, _) in enumerate(part):
                texts[j * k:(j + 1) * k] = out[r * k:(r + 1) * k]
    model.train(was_training)
    if sampler.static is not None:  # the update needs the memory the labels' buffers hold
        staticcache.release(model)
    return texts, feats


def cut_ends(prompt_lens, cut_lists, width=None):
    """Absolute exclusive ends `len(prompt_i) + b` as a [N, B] long tensor (0 = no budget)."""
    width = width or max((len(bs) for bs in cut_lists), default=0)
    ends = torch.zeros(len(cut_lists), max(width, 1), dtype=torch.long)
    for i, bs in enumerate(cut_lists):
        ends[i, :len(bs)] = torch.tensor(bs, dtype=torch.long) + int(prompt_lens[i])
    return ends


@torch.no_grad()
def forward_pass(model, batch, ends=None, temperature=1.0, chunk_size=1024, last_k=LAST_K,
                 final_norm=False, logprobs=True):
    """Old log-probs and probe features from one forward.

    batch: `grpo.pack` output (input_ids / attention_mask [N, L]); ends: [N, B] absolute ends, or
    None for no features. Returns (old_logp [N, L-1] float32 or None, feats [N, B, d] float32 and
    valid [N, B] bool, or None and None). final_norm: the post-hoc probe's feature, the final normed
    state of the last token before each end, in place of probe.prefix_features' training one.
    """
    ids, mask = batch["input_ids"], batch["attention_mask"]
    captured = {}
    keep = nullcontext() if ends is None or final_norm else last_layer(
        model, lambda hidden: captured.setdefault("feats", prefix_features(hidden, ends.to(ids.device), last_k)))
    with keep:
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # no K/V kept
    feats, valid = captured.get("feats", (None, None))
    if final_norm and ends is not None:
        feats, valid = prefix_features(hidden, ends.to(ids.device), 1)
    old_logp = None
    if logprobs:
        old_logp = logprobs_from_hidden(hidden, model.lm_head, ids[:, 1:], temperature,
                                        chunk_size).float()
    return old_logp, feats, valid
