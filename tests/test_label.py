"""Truncation points, forced-answer prompts, Monte-Carlo labels and the scoring forward."""
import os

import pytest
import torch

import label
import tiny
from grpo import pack
from label import SUFFIX, close_id, closed_cut, cut_mask, cuts_of, forced_answer, grid, mc_labels
from label import cut_ends, forward_pass

FIXTURE_7B = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures", "r1_distill_qwen_7b")


def forced_prompt(prompt, response, b, tokenizer, close="think", suffix=SUFFIX):
    """The ids mc_labels asks at cut b: `prompt + response[:b] + [CLOSE] + ids(suffix)`, CLOSE left
    out where response[:b] already ends on it (label.py's docstring)."""
    cid = close_id(tokenizer, close)
    return list(prompt) + list(response[:closed_cut(response, b, cid)]) + [cid] + \
        tokenizer.encode(suffix, add_special_tokens=False)


def test_budgets_follow_python_round():
    assert cuts_of(8) == [2, 4, 6]
    assert cuts_of(3) == [1, 2]
    assert cuts_of(1) == [1]
    assert cuts_of(0) == []
    assert cuts_of(2) == [1, 2]          # round(0.5) == 0 is dropped, round(1.5) == 2
    assert cuts_of(10) == [2, 5, 8]      # round(2.5) == 2 (half to even), round(7.5) == 8
    assert cuts_of(4, budgets=(1.0,)) == [4]


def test_grid_cut_mask_and_cut_ends_pad_with_zeros():
    labels = [[0.5, 1.0], [], [0.25]]
    assert grid(labels).tolist() == [[0.5, 1.0], [0.0, 0.0], [0.25, 0.0]]
    assert grid(labels, width=3).tolist() == [[0.5, 1.0, 0.0], [0.0, 0.0, 0.0], [0.25, 0.0, 0.0]]
    assert grid([[0.5]]).tolist() == [[0.5]] and grid([[], []]).shape == (2, 1) and grid([]).shape == (0, 1)
    feats = grid([torch.ones(2, 3), torch.full((1, 3), 2.0)])   # [n_i, d] rows -> [N, width, d]
    assert feats.shape == (2, 2, 3) and feats[1].tolist() == [[2.0] * 3, [0.0] * 3]
    assert cut_mask([[2, 4], [], [1]]).tolist() == [[True, True], [False, False], [True, False]]
    # ends = prompt length + cut, 0 where a trajectory has fewer cuts
    ends = cut_ends(torch.tensor([3, 5]), [[2, 4], [1]])
    assert ends.tolist() == [[5, 7], [6, 0]] and ends.dtype == torch.long   # indices for prefix_features
    assert cut_ends([3, 5], [[2], [1]], width=3).tolist() == [[5, 0, 0], [6, 0, 0]]
    assert cut_ends([3], [[]]).tolist() == [[0]] and cut_ends([], []).shape == (0, 1)


def test_closed_cut_and_close_id():
    import toy
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy.BASE_DIR)
    assert close_id(tok) == tok.convert_tokens_to_ids("</think>") != tok.unk_token_id
    assert close_id(tok, "eos") == tok.eos_token_id
    with pytest.raises(ValueError, match="no `</think>` token: use --forced-close eos"):
        close_id(tiny.tokenizer())   # characters only: </think> reads as <unk>
    # the prefix before CLOSE + SUFFIX: one token shorter where it ends on the close id
    assert closed_cut([7, 9, 2], 2, 2) == 2 and closed_cut([7, 2, 9], 2, 2) == 1
    assert closed_cut([2, 9], 0, 2) == 0   # an empty prefix stays empty (response[-1] is not looked at)
    assert closed_cut([9, 2], 0, 2) == 0   # not even when the response ends on the close id
    assert closed_cut([2, 9], 1, 2) == 0   # a one-token prefix that is the close id: empty


def test_forced_answer_reads_up_to_the_closing_brace():
    assert forced_answer("17}\n") == "17"
    assert forced_answer(" \\frac{1}{2}} and more}") == "\\frac{1}{2}"
    assert forced_answer("17") is None and forced_answer("{17}") is None
    assert forced_answer("}") == ""


@pytest.mark.skipif(not os.path.isdir(FIXTURE_7B), reason="shared fixtures absent")
def test_forced_ids_for_the_real_tokenizer():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(FIXTURE_7B)
    prompt, response = [151646, 151644, 16, 151645, 151648, 198], [785, 3405, 374, 220, 17]
    suffix = tok.encode(SUFFIX, add_special_tokens=False)
    assert forced_prompt(prompt, response, 3, tok) == prompt + response[:3] + [151649] + suffix
    assert forced_prompt(prompt, response, 3, tok, close="eos") == prompt + response[:3] + [151643] + suffix
    # a cut right after the response's own </think> (151649) gets no second one; EOS (151643) likewise
    closed = response[:3] + [151649, 151643]
    assert forced_prompt(prompt, closed, 4, tok) == prompt + closed[:4] + suffix
    assert forced_prompt(prompt, closed, 5, tok, close="eos") == prompt + closed + suffix
    assert tok.decode(suffix) == SUFFIX


def asked(monkeypatch):
    """A list given, per call of mc_labels, the distinct forced prompts it asks (forced_answers')."""
    import label
    calls, real = [], label.forced_answers
    monkeypatch.setattr(label, "forced_answers", lambda *a, **kw: calls.append(len(a[5])) or real(*a, **kw))
    return calls


def test_mc_labels_are_fractions_of_k_aligned_with_budgets(monkeypatch):
    tok, model = tiny.tokenizer(), tiny.model(seed=1)
    prompts = [tok.encode("1+2=", add_special_tokens=False)] * 3
    responses = [tok.encode(s, add_special_tokens=False) for s in ("3 ok", "4 no way", "")]
    cuts = [cuts_of(len(r)) for r in responses]
    calls = asked(monkeypatch)
    labels = mc_labels(model, tok, prompts, responses, cuts, ["3", "3", "3"], k=4, close="eos",
                       suffix="{", seed=0)
    assert [len(y) for y in labels] == [len(c) for c in cuts] and labels[2] == []
    assert all(y in (0, 0.25, 0.5, 0.75, 1.0) for ys in labels for y in ys)
    n = sum(map(len, cuts))
    assert calls == [n]


def test_the_close_token_is_never_doubled():
    """The released build_forced_output_tokens skips the close token when the cut already ends on
    it: at b = T a response ends on EOS, so with close="eos" the prompt holds one EOS, not two; a
    cut right after the response's own </think> holds one </think>. Toy tokenizer ids."""
    import toy
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy.BASE_DIR)
    eos, think = tok.eos_token_id, tok.convert_tokens_to_ids("</think>")
    suffix = tok.encode(SUFFIX, add_special_tokens=False)
    prompt = tok.encode("<|user|>3+5<|assistant|><think>\n", add_special_tokens=False)
    response = tok.encode("3+5=8\n</think>\\boxed{8}", add_special_tokens=False) + [eos]
    T, after = len(response), response.index(think) + 1
    assert response[T - 1] == eos and response[after - 1] == think
    assert forced_prompt(prompt, response, T, tok, close="eos") == prompt + response + suffix
    assert forced_prompt(prompt, response, after, tok) == prompt + response[:after] + suffix
    assert forced_prompt(prompt, response, after - 1, tok) == prompt + response[:after] + suffix  # the same
    assert forced_prompt(prompt, response, T, tok) == prompt + response + [think] + suffix  # not on </think>
    assert forced_prompt(prompt, response, after, tok, close="eos") == prompt + response[:after] + [eos] + suffix


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_mc_labels_ask_a_cut_ending_on_the_close_without_a_second_one(decode, monkeypatch):
    """With close="eos" the cuts T - 1 and T of a response ending on EOS are one forced prompt,
    asked once; a response that is EOS alone is asked at prompt + EOS + suffix (a prefix of 0
    response tokens). Both decode loops give the same labels."""
    tok, model = tiny.tokenizer(), tiny.model(seed=1)
    prompts = [tok.encode("1+2=", add_special_tokens=False)] * 2
    responses = [tok.encode("3 ok", add_special_tokens=False) + [tok.eos_token_id], [tok.eos_token_id]]
    cuts = [[len(responses[0]) - 1, len(responses[0])], [1]]
    calls = asked(monkeypatch)
    ys = mc_labels(model, tok, prompts, responses, cuts, ["3", "3"], k=4, close="eos", suffix="{", seed=0,
                   decode=decode)
    assert calls == [2]  # 3 cuts
    assert ys[0][0] == ys[0][1] and ys == mc_labels(model, tok, prompts, responses, cuts, ["3", "3"], k=4,
                                                    close="eos", suffix="{", seed=0, decode="dynamic")


def test_identical_forced_prompts_are_labelled_once(monkeypatch):
    import label
    calls = []

    def fake(model, tok, prompts, responses, cut_lists, cut_of, tail, k, *args, **kw):
        calls.append((cut_of, tail))
        texts = ["7}"] * k + ["8}"] * k  # first distinct prompt right, second wrong
        return texts[:len(cut_of) * k], None
    monkeypatch.setattr(label, "forced_answers", fake)
    tok = tiny.tokenizer()
    ys = label.mc_labels(None, tok, [[5], [5]], [[6, 7], [6, 9]], [[1, 2], [1]], ["7", "7"], k=2, close="eos",
                         suffix="{", decode="dynamic")
    assert calls == [([(0, 1), (0, 2)], [tok.eos_token_id, tok.convert_tokens_to_ids("{")])]
    # [5, 6, ...] is shared by both trajectories at b = 1: trajectory 1 is not sampled at all
    assert ys == [[1.0, 0.0], [1.0]]


def test_labels_count_correct_forced_answers(monkeypatch):
    """The label is the share of the K forced answers whose brace-closed text matches the gold."""
    import label
    texts = ["7}\n", "7}", "8}\n", "7", "7}\n", "7}\n", "7}\n", "7}\n"]
    monkeypatch.setattr(label, "forced_answers", lambda *a, **kw: (texts, None))
    tok = tiny.tokenizer()
    ys = label.mc_labels(None, tok, [[5]], [[6, 7, 8]], [[1, 2]], ["7"], k=4, close="eos", decode="dynamic")
    assert ys == [[0.5, 1.0]]  # "7}", "7}" right; "8}" wrong; "7" never closes the box


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_forced_answers_sample_like_generate_on_the_whole_forced_prompts(decode):
    """label.forced_answers (one forward per trajectory, a row per cut with the response past the
    cut masked out, the tail, K answers) samples what rollout.generate samples from the whole forced
    prompts with the same seed, whatever the chunk: greedy and sampled, in float32. The static loop
    also stops an answer at the brace that closes its box (the same answer, fewer steps)."""
    import label
    from rollout import generate
    tok, model = tiny.tokenizer(), tiny.model(seed=1)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = [enc("1+2="), enc("1+2="), enc("what is 17*3?"), enc("9-4")]
    responses = [enc("3 ok fine"), enc("3 no way"), enc("51 since"), enc("5 ok")]
    lists = [cuts_of(len(r)) for r in responses]
    cut_of = [(i, b) for i, bs in enumerate(lists) for b in bs]
    tail = forced_prompt([], [], 0, tok, "eos", "{")
    closed = 0
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_p=0.9, seed=5)):
        seed, sampling = kw.pop("seed", None), dict(label.FORCED, max_new_tokens=12, **kw)
        for batch_size in (None, 4):
            got, _ = label.forced_answers(model, tok, prompts, responses, lists, cut_of, tail, 3,
                                          sampling, seed, batch_size, decode)
            forced = [p + r[:b] + tail for p, r, b in ((prompts[i], responses[i], b) for i, b in cut_of)]
            ref = generate(model, tok, forced, n=3, seed=seed, batch_size=batch_size, keyed=True,
                           decode="dynamic", **sampling)
            for g, r in zip(got, ref.ids, strict=True):
                depth, cut = 1, len(r)  # the forced box is open; find the token that closes it
                for m, text in enumerate(tok.batch_decode([[x] for x in r])):
                    depth -= text.count("}") - text.count("{")
                    if depth <= 0:
                        cut = m + 1
                        break
                assert g == tok.decode(r[:cut] if decode == "static" else r, skip_special_tokens=True)
                closed += cut < len(r)
            assert [forced_answer(x) for x in got] == [forced_answer(x) for x in ref.texts]
    assert closed >= 3  # some answers close their box before a newline: the early stop is exercised
    assert len({tuple(x) for x in ref.ids}) > 5  # the answers differ between prompts and samples


def test_the_forced_answers_sample_as_released_and_the_plan_counts_their_tokens():
    """label.FORCED, the one place the forced answers' sampling is set (the released temperature
    0.8, top-p 1, 32 tokens, stop at a newline), is every labelling call's default, whatever
    --temperature says; harness/plan.py, which may not import the method, plans for the same
    answer length."""
    import inspect
    from harness import plan
    assert label.FORCED == dict(temperature=0.8, top_p=1.0, max_new_tokens=32, stop=("\n",))
    for f in (label.mc_labels, label.forced_answers):
        assert inspect.signature(f).parameters["sampling"].default is label.FORCED
    assert plan.FORCED_ANSWER == label.FORCED["max_new_tokens"]


def test_labels_are_equal_on_the_toy_whatever_the_chunk_and_the_loop(monkeypatch):
    """mc_labels on the toy policy's own rollouts: the same labels and counts for the same seed
    whichever decode loop runs and whatever the chunk (2, 5 or all forced prompts: each answer
    draws from its own stream, so the chunk, which the early exit sizes from the memory free,
    changes only the speed), with equal forced prompts asked once; and the labels are graded. The
    forced answers are drawn at temperature 2: at the rollout's 0.8 the toy's forced answer copies
    the path, so every label would be 0 or 1 and the equality would not see the K answers' draws."""
    import data
    import toy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rollout import generate
    model = AutoModelForCausalLM.from_pretrained(toy.BASE_DIR).train()
    tok = AutoTokenizer.from_pretrained(toy.BASE_DIR)
    rows = toy.dataset("test")[:5]
    prompts = [data.chat_prompt(tok, r["problem"], toy.INSTRUCTION) for r in rows]
    out = generate(model, tok, prompts, n=3, max_new_tokens=96, temperature=0.8, seed=0)
    responses = out.ids + [out.ids[0][:4]]  # a short one
    prompts = [prompts[i] for i in out.prompt_index] + [prompts[0]]
    golds = [rows[i]["answer"] for i in out.prompt_index] + [rows[0]["answer"]]
    cuts = [cuts_of(len(r)) for r in responses]
    labels, calls = {}, asked(monkeypatch)
    for decode, chunk in (("dynamic", 5), ("dynamic", 2), ("dynamic", None), ("static", 5), ("static", 2)):
        ys = mc_labels(model, tok, prompts, responses, cuts, golds, k=4, seed=1, batch_size=chunk,
                       decode=decode, sampling=dict(label.FORCED, temperature=2.0))
        labels[decode, chunk] = ys
    assert model.training  # left in the mode it was in
    assert all(v == labels["dynamic", 5] for v in labels.values())
    ys = labels["dynamic", 5]
    assert calls[0] < sum(map(len, cuts))  # equal forced prompts were asked once
    assert len({y for y_i in ys for y in y_i}) >= 3  # graded labels, not all 0 or all 1


def test_static_labels_keep_one_shape_alive_within_the_plan(monkeypatch):
    """Chunks of cuts with widely varying widths (several length buckets) each build a static shape;
    the previous one is freed first, so at most one is alive and its K/V bytes stay within the
    plan's label term (gen_batch cuts x k rows of prompt + 3/4 of the longest response + tail)."""
    from harness import plan
    from static_shapes import Shapes
    tok, model = tiny.tokenizer(), tiny.model(seed=3)
    gen = torch.Generator().manual_seed(0)
    lengths = [8, 20, 40, 70, 110, 160, 230, 300, 380]
    prompts = [tok.encode("1+2=", add_special_tokens=False)] * len(lengths)
    responses = [torch.randint(4, 60, (n,), generator=gen).tolist() for n in lengths]
    cuts = [cuts_of(n) for n in lengths]
    shapes = Shapes(monkeypatch)
    ys = mc_labels(model, tok, prompts, responses, cuts, ["3"] * len(lengths), k=4, close="eos", suffix="{",
                   seed=0, batch_size=2, decode="static")
    assert [len(y) for y in ys] == [len(c) for c in cuts]
    assert len({(s["rows"], s["length"]) for s in shapes.made}) >= 4  # several buckets are exercised
    assert max(s["alive"] for s in shapes.made) == 1
    cfg = dict(model="toy", prompts_per_step=len(lengths), gen_batch=2, group_size=1, k=4,
               max_new_tokens=max(lengths), micro_tokens=64, grad_ckpt=True, chunk_size=8)
    term = plan.estimate(model.config, cfg, 1, "cpu")["label KV cache"]
    assert max(s["alive_bytes"] for s in shapes.made) <= term
    assert max(s["bytes"] for s in shapes.made) > 0.8 * term  # and the term is no loose bound


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_features_from_the_forced_answers_prefill_equal_the_scoring_pass(decode, monkeypatch):
    """mc_labels(features=True) reads h_b from the prefill it runs anyway, and they equal the
    separate scoring forward's (label.forward_pass) within float rounding, while its labels equal those
    without features. The batch holds what the reading has to get right: responses equal to another
    up to their longest cut (their forced prompts are all asked by that one, so they are read as an
    extra row), a cut that ends on the close token (asked one token earlier, read at b), cuts below
    LAST_K (the window reaches into the prompt), a prompt of 2 tokens (shorter than the window), a
    response with no cuts, a cut whose forced prompt another response asks though the two differ
    at the cut (read off a row of its own), and several chunks."""
    tok, model = tiny.tokenizer(), tiny.model(seed=4)
    gen = torch.Generator().manual_seed(1)
    p = tok.encode("12+3=", add_special_tokens=False)
    long = torch.randint(4, 60, (40,), generator=gen).tolist()
    closing = tok.encode("15 because", add_special_tokens=False) + [tok.eos_token_id]
    prompts = [p, p, p, p, p[:2], p, p, p]
    responses = [long, list(long), long[:30], closing, tok.encode("seven", add_special_tokens=False),
                 torch.randint(4, 60, (9,), generator=gen).tolist(), [3], long[:10] + [tok.eos_token_id]]
    cuts = [cuts_of(len(r)) for r in responses[:-2]] + [[], [11]]
    cuts[3] = cuts[3] + [len(closing)]  # its last cut ends on the close (EOS): asked at T - 1, read at T
    # response 7's one cut is asked by response 0 (long[:10] + tail), but their tokens differ at
    # position 10 (EOS vs long[10]): it is read off a row of its own
    golds = ["15"] * len(prompts)
    kw = dict(k=4, close="eos", suffix="{", seed=3, batch_size=3, decode=decode)
    calls = asked(monkeypatch)
    ys, feats = mc_labels(model, tok, prompts, responses, cuts, golds, features=True, **kw)
    assert ys == mc_labels(model, tok, prompts, responses, cuts, golds, **kw)
    assert calls[0] < sum(map(len, cuts))  # response 1 asked nothing of its own
    batch = pack(prompts, responses, tok.pad_token_id)
    ends = cut_ends(batch["prompt_lens"], cuts)
    _, ref, valid = forward_pass(model, batch, ends, logprobs=False)
    assert [f.shape for f in feats] == [(len(c), 32) for c in cuts]
    for i, c in enumerate(cuts):
        assert torch.allclose(feats[i], ref[i, :len(c)], atol=1e-5), i
    assert not torch.allclose(feats[0][0], feats[0][1])  # not one state for every cut
