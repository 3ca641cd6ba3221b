"""Truncation points, forced-answer prompts, Monte-Carlo labels and the scoring forward."""
import os

import pytest
import torch

import tiny
from grpo import pack, token_logprobs
from label import SUFFIX, cuts_of, forced_answer, forced_prompt, mc_labels
from probe import prefix_features
from label import cut_ends, forward_pass

FIXTURE_7B = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures", "r1_distill_qwen_7b")


def test_budgets_follow_python_round():
    assert cuts_of(8) == [2, 4, 6]
    assert cuts_of(3) == [1, 2]
    assert cuts_of(1) == [1]
    assert cuts_of(0) == []
    assert cuts_of(2) == [1, 2]          # round(0.5) == 0 is dropped, round(1.5) == 2
    assert cuts_of(10) == [2, 5, 8]      # round(2.5) == 2 (half to even), round(7.5) == 8
    assert cuts_of(4, budgets=(1.0,)) == [4]


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


def test_mc_labels_are_fractions_of_k_aligned_with_budgets():
    tok, model = tiny.tokenizer(), tiny.model(seed=1)
    prompts = [tok.encode("1+2=", add_special_tokens=False)] * 3
    responses = [tok.encode(s, add_special_tokens=False) for s in ("3 ok", "4 no way", "")]
    cuts = [cuts_of(len(r)) for r in responses]
    stats = {}
    labels = mc_labels(model, tok, prompts, responses, cuts, ["3", "3", "3"], k=4, close="eos",
                       suffix="{", seed=0, stats=stats)
    assert [len(y) for y in labels] == [len(c) for c in cuts] and labels[2] == []
    assert all(y in (0, 0.25, 0.5, 0.75, 1.0) for ys in labels for y in ys)
    n = sum(map(len, cuts))
    assert stats == {"prefixes": n, "forced_prompts": n}


def test_the_close_token_is_never_doubled():
    """The released build_forced_output_tokens skips the close token when the cut already ends on
    it: at b = T a response ends on EOS, so with close="eos" the prompt holds one EOS, not two; a
    cut right after the response's own </think> holds one </think>. Toy tokenizer ids."""
    import toy
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy.base_model())
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


@pytest.mark.parametrize("tree", [True, False])
def test_mc_labels_ask_a_cut_ending_on_the_close_without_a_second_one(tree):
    """With close="eos" the cuts T - 1 and T of a response ending on EOS are one forced prompt,
    asked once; a response that is EOS alone is asked at prompt + EOS + suffix (a prefix of 0
    response tokens). Both sampling paths give the same labels."""
    tok, model = tiny.tokenizer(), tiny.model(seed=1)
    prompts = [tok.encode("1+2=", add_special_tokens=False)] * 2
    responses = [tok.encode("3 ok", add_special_tokens=False) + [tok.eos_token_id], [tok.eos_token_id]]
    cuts = [[len(responses[0]) - 1, len(responses[0])], [1]]
    stats = {}
    ys = mc_labels(model, tok, prompts, responses, cuts, ["3", "3"], k=4, close="eos", suffix="{", seed=0,
                   stats=stats, tree=tree)
    assert stats == {"prefixes": 3, "forced_prompts": 2}
    assert ys[0][0] == ys[0][1] and ys == mc_labels(model, tok, prompts, responses, cuts, ["3", "3"], k=4,
                                                    close="eos", suffix="{", seed=0, tree=not tree)


def test_identical_forced_prompts_are_labelled_once(monkeypatch):
    import label
    from rollout import Samples
    calls = []

    def fake(model, tok, prompts, responses, cut_of, tail, k, lib, **kw):
        calls.append((cut_of, tail))
        texts = ["7}"] * k + ["8}"] * k  # first distinct prompt right, second wrong
        return Samples([[0]] * len(texts), texts[:len(cut_of) * k], [1] * len(texts), ["stop"] * len(texts), [])
    monkeypatch.setattr(label.fast, "forced_samples", fake)
    tok = tiny.tokenizer()
    ys = label.mc_labels(None, tok, [[5], [5]], [[6, 7], [6, 9]], [[1, 2], [1]], ["7", "7"], k=2, close="eos",
                         suffix="{", tree=True, decode="dynamic")
    assert calls == [([(0, 1), (0, 2)], [tok.eos_token_id, tok.convert_tokens_to_ids("{")])]
    # [5, 6, ...] is shared by both trajectories at b = 1: trajectory 1 is not sampled at all
    assert ys == [[1.0, 0.0], [1.0]]


def test_labels_count_correct_forced_answers(monkeypatch):
    """The label is the share of the K forced answers whose brace-closed text matches the gold."""
    import label
    from rollout import Samples
    texts = ["7}\n", "7}", "8}\n", "7", "7}\n", "7}\n", "7}\n", "7}\n"]
    monkeypatch.setattr(label.fast, "forced_samples", lambda *a, **k: Samples([[0]] * 8, texts, [1] * 8, ["stop"] * 8, []))
    tok = tiny.tokenizer()
    ys = label.mc_labels(None, tok, [[5]], [[6, 7, 8]], [[1, 2]], ["7"], k=4, close="eos", tree=True,
                         decode="dynamic")
    assert ys == [[0.5, 1.0]]  # "7}", "7}" right; "8}" wrong; "7" never closes the box


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_shared_prefix_prefill_samples_like_full_forced_prompts(decode):
    from label import LAST_K, Sampler, last_layer, row_generators
    LIB = (Sampler, row_generators, last_layer, LAST_K)
    """The forced answers from the prefix tree (prompt once, trajectory once, suffix per cut, K rows
    sharing a cache row while they agree) are the ones the plain path (rollout.generate on the full
    forced prompts) samples with the same seed and chunking: greedy and sampled, in float32."""
    import label
    tok, model = tiny.tokenizer(), tiny.model(seed=1)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = [enc("1+2="), enc("1+2="), enc("what is 17*3?"), enc("9-4")]
    responses = [enc("3 ok fine"), enc("3 no way"), enc("51 since"), enc("5 ok")]
    cut_of = [(i, b) for i, r in enumerate(responses) for b in cuts_of(len(r))]
    assert len(label.fast.length_groups(cut_of)) == 1  # one tree: "1+2=" is prefilled once for two trajectories
    tail = forced_prompt([], [], 0, tok, "eos", "{")
    closed = 0
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_p=0.9, seed=5)):
        for batch_size in (None, 4):
            common = dict(k=3, max_new_tokens=12, batch_size=batch_size, **kw)
            k = common.pop("k")
            got = label.fast.sample_answers(model, tok, prompts, responses, cut_of, tail, k, LIB, decode=decode,
                                            **common)
            forced = [p + r[:b] + tail for p, r, b in ((prompts[i], responses[i], b) for i, b in cut_of)]
            ref = label.generate(model, tok, forced, n=k, stop=("\n",), keyed=True, decode="dynamic", **common)
            for g, r in zip(got.ids, ref.ids, strict=True):
                depth, cut = 1, len(r)  # the forced box is open; find the token that closes it
                for m, text in enumerate(tok.batch_decode([[x] for x in r])):
                    depth -= text.count("}") - text.count("{")
                    if depth <= 0:
                        cut = m + 1
                        break
                assert g == r[:cut]
                closed += cut < len(r)
            assert [forced_answer(x) for x in got.texts] == [forced_answer(x) for x in ref.texts]
    assert closed >= 3  # some answers close their box before a newline: the early stop is exercised
    assert len({tuple(x) for x in ref.ids}) > 5  # the answers differ between prompts and samples


def test_plain_and_tree_labels_are_equal_on_the_toy_whatever_the_chunk():
    """mc_labels on the toy policy's own rollouts: the plain path (tree=False) and the default fast
    path give the same labels and counts for the same seed (in length groups, with equal forced
    prompts asked once), and so do chunks of 2, 5 and all forced prompts (each answer draws from its
    own stream: the chunk, which the early exit sizes from the memory free, changes only the speed);
    and the labels are graded. The forced answers are drawn at temperature 2: at the rollout's 0.8
    the toy's forced answer copies the path, so every label would be 0 or 1 and the equality would
    not see the K answers' draws."""
    import label
    import data
    import toy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rollout import generate
    model = AutoModelForCausalLM.from_pretrained(toy.base_model()).eval()
    tok = AutoTokenizer.from_pretrained(toy.base_model())
    rows = toy.dataset("test")[:5]
    prompts = [data.chat_prompt(tok, r["problem"], toy.INSTRUCTION) for r in rows]
    out = generate(model, tok, prompts, n=3, max_new_tokens=96, temperature=0.8, seed=0)
    responses = out.ids + [out.ids[0][:4]]  # a short one: a second length group
    prompts = [prompts[i] for i in out.prompt_index] + [prompts[0]]
    golds = [rows[i]["answer"] for i in out.prompt_index] + [rows[0]["answer"]]
    cuts = [cuts_of(len(r)) for r in responses]
    labels = {}
    for tree, chunk in ((True, 5), (False, 5), (True, 2), (True, None), (False, 2)):
        stats = {}
        ys = mc_labels(model, tok, prompts, responses, cuts, golds, k=4, seed=1, batch_size=chunk, stats=stats,
                       tree=tree, temperature=2.0)
        labels[tree, chunk] = ys, stats
    assert all(v == labels[True, 5] for v in labels.values())
    ys, stats = labels[True, 5]
    assert len(label.fast.length_groups([(i, b) for i, bs in enumerate(cuts) for b in bs])) >= 2
    assert stats["forced_prompts"] < stats["prefixes"]  # equal forced prompts were asked once
    assert len({y for y_i in ys for y in y_i}) >= 3  # graded labels, not all 0 or all 1



def test_plain_and_tree_features_are_equal_on_the_toy():
    """mc_labels(features=True) on the toy policy's own rollouts: the plain path (tree=False: one
    forward over each prompt + response, label.plain_features) gives the tree path's labels exactly
    and its features h_b within float rounding, in the same shapes and dtype; a response with no
    cuts gets an empty [0, d]. The model is left in the mode it was in."""
    import data
    import toy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from rollout import generate
    model = AutoModelForCausalLM.from_pretrained(toy.base_model()).train()
    tok = AutoTokenizer.from_pretrained(toy.base_model())
    rows = toy.dataset("test")[:3]
    prompts = [data.chat_prompt(tok, r["problem"], toy.INSTRUCTION) for r in rows]
    out = generate(model, tok, prompts, n=2, max_new_tokens=64, temperature=0.8, seed=0)
    prompts = [prompts[i] for i in out.prompt_index]
    golds = [rows[i]["answer"] for i in out.prompt_index]
    cuts = [cuts_of(len(r)) for r in out.ids[:-1]] + [[]]
    kw = dict(k=4, seed=1, batch_size=3, temperature=2.0, features=True)
    ys, feats = mc_labels(model, tok, prompts, out.ids, cuts, golds, tree=False, **kw)
    assert model.training
    tree_ys, ref = mc_labels(model, tok, prompts, out.ids, cuts, golds, **kw)
    assert ys == tree_ys and [f.shape for f in feats] == [(len(c), model.config.hidden_size) for c in cuts]
    assert sum(map(len, cuts)) >= 10 and len({y for y_i in ys for y in y_i}) >= 2
    for f, g in zip(feats, ref):
        assert f.dtype == g.dtype == torch.float32 and f.device.type == "cpu"
        assert torch.allclose(f, g, atol=1e-5), (f - g).abs().max()
    assert not torch.allclose(feats[0][0], feats[0][1])  # not one state for every cut

def test_features_are_causal_and_logprobs_match():
    """Features at budget b from the full trajectory equal those from the prefix alone; the old
    log-probs of this forward equal a separate token_logprobs computation."""
    tok, model = tiny.tokenizer(), tiny.model(seed=2)
    prompts = [tok.encode("12+3=", add_special_tokens=False), tok.encode("7=", add_special_tokens=False)]
    responses = [tok.encode("15 because", add_special_tokens=False) + [tok.eos_token_id],
                 tok.encode("seven", add_special_tokens=False)]
    cuts = [cuts_of(len(r)) for r in responses]
    batch = pack(prompts, responses, tok.pad_token_id)
    ends = cut_ends(batch["prompt_lens"], cuts)
    old_logp, feats, valid = forward_pass(model, batch, ends, temperature=0.7, chunk_size=3)
    assert valid.tolist() == [[True] * 3, [True] * 3]
    ref = token_logprobs(model, batch["input_ids"], batch["attention_mask"], 0.7)
    m = batch["loss_mask"].bool()
    assert torch.allclose(old_logp[m], ref[m], atol=1e-5)
    for i in range(2):
        for j, b in enumerate(cuts[i]):
            ids = torch.tensor([prompts[i] + responses[i][:b]])
            captured = {}
            h = model.model.layers[-1].register_forward_hook(lambda mod, a, o: captured.update(h=o[0] if isinstance(o, tuple) else o))
            model.model(input_ids=ids)
            h.remove()
            alone, _ = prefix_features(captured["h"], torch.tensor([[ids.shape[1]]]), 4)
            assert torch.allclose(feats[i, j], alone[0, 0], atol=1e-5)
    _, final, _ = forward_pass(model, batch, ends, final_norm=True, logprobs=False)
    normed = model.model(input_ids=torch.tensor([prompts[0] + responses[0][:cuts[0][0]]])).last_hidden_state
    assert torch.allclose(final[0, 0], normed[0, -1], atol=1e-5)


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
def test_features_from_the_forced_answers_prefill_equal_the_scoring_pass(decode):
    """mc_labels(features=True) reads h_b from the prefill it runs anyway, and they equal the
    separate scoring forward's (update.forward_pass) within float rounding, while its labels equal those
    without features. The batch holds what the reading has to get right: responses equal to another
    up to their longest cut (their forced prompts are all asked by that one, so they are read as an
    extra row), a cut that ends on the close token (asked one token earlier, read at b), cuts below
    LAST_K (the window reaches into the prompt), a prompt of 2 tokens (shorter than the window), a
    response with no cuts, a cut whose forced prompt another response asks though the two differ
    at the cut (read off a row of its own), and several chunks and length groups."""
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
    stats = {}
    ys, feats = mc_labels(model, tok, prompts, responses, cuts, golds, features=True, stats=stats, **kw)
    assert ys == mc_labels(model, tok, prompts, responses, cuts, golds, **kw)
    assert stats["forced_prompts"] < stats["prefixes"]  # response 1 asked nothing of its own
    batch = pack(prompts, responses, tok.pad_token_id)
    ends = cut_ends(batch["prompt_lens"], cuts)
    _, ref, valid = forward_pass(model, batch, ends, logprobs=False)
    assert [f.shape for f in feats] == [(len(c), 32) for c in cuts]
    for i, c in enumerate(cuts):
        assert torch.allclose(feats[i], ref[i, :len(c)], atol=1e-5), i
    assert not torch.allclose(feats[0][0], feats[0][1])  # not one state for every cut
