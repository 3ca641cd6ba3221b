"""rollout.generate and its sampler on a tiny random Qwen2 and a character
tokenizer (tests/tiny.py), CPU only."""
import math

import pytest
import torch

import rollout
from tests import tiny

@pytest.fixture(scope="module")
def tok():
    return tiny.tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny.model()


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def reference_greedy(model, tok, prompt, steps):
    """Greedy without cache or padding: full forward over the growing sequence each step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1, :len(tok)]
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def test_left_padding_batch_equals_alone_and_uncached_reference(model, tok):
    prompts = [enc(tok, "1+2="), enc(tok, "what is 17*3? think."), enc(tok, "x")]
    batch = rollout.generate(model, tok, prompts, max_new_tokens=12, temperature=0, eos_ids=[])
    for i, p in enumerate(prompts):
        alone = rollout.generate(model, tok, [p], max_new_tokens=12, temperature=0, eos_ids=[])
        assert batch.ids[i] == alone.ids[0] == reference_greedy(model, tok, p, 12)
    assert batch.finish == ["length"] * 3 and batch.lengths == [12] * 3
    assert batch.prompt_index == [0, 1, 2]
    assert len({tuple(x) for x in batch.ids}) == 3  # the model really depends on its prompt


def test_position_ids_and_mask_for_left_padding(model, tok):
    # RoPE only sees position differences, so the equality test above cannot catch a constant
    # shift; pin the inputs themselves: positions = cumsum(mask) - 1 clamped at 0.
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args, kw: seen.append(
        (kw["position_ids"].tolist(), kw["attention_mask"].tolist())), with_kwargs=True)
    try:
        rollout.generate(model, tok, [[5, 6], [7, 8, 9, 10]], max_new_tokens=3, temperature=0, eos_ids=[])
    finally:
        hook.remove()
    assert seen[0] == ([[0, 0, 0, 1], [0, 1, 2, 3]], [[0, 0, 1, 1], [1, 1, 1, 1]])
    assert seen[1] == ([[2], [4]], [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert seen[2][0] == [[3], [5]] and len(seen) == 3


def test_stops_at_eos(model, tok):
    prompts = [enc(tok, "solve: 2x=8"), enc(tok, "a")]
    ref = rollout.generate(model, tok, prompts, max_new_tokens=24, temperature=0, eos_ids=[])
    r0 = ref.ids[0]
    # Pick a token whose first occurrence is well inside the reference, so stopping is visible.
    k = next(k for k in range(3, 20) if r0[k] not in r0[:k])

    got = rollout.generate(model, tok, prompts, max_new_tokens=24, temperature=0, eos_ids=[r0[k]])
    assert got.ids[0] == r0[:k + 1] and got.finish[0] == "eos" and got.lengths[0] == k + 1
    j = next((j for j, x in enumerate(ref.ids[1]) if x == r0[k]), None)  # the other row stops on its own
    assert got.ids[1] == ref.ids[1][:24 if j is None else j + 1]
    assert got.finish[1] == ("length" if j is None else "eos")


def test_same_seed_same_samples_and_tiny_top_p_is_greedy(model, tok):
    prompts = [enc(tok, "roll"), enc(tok, "the dice, please")]
    kw = dict(n=2, max_new_tokens=10, temperature=1.0, eos_ids=[])
    a = rollout.generate(model, tok, prompts, seed=123, **kw)
    b = rollout.generate(model, tok, prompts, seed=123, **kw)
    c = rollout.generate(model, tok, prompts, seed=124, **kw)
    assert a.ids == b.ids and a.texts == b.texts
    assert a.ids != c.ids
    greedy = rollout.generate(model, tok, prompts, n=2, max_new_tokens=10, temperature=0, eos_ids=[])
    nucleus = rollout.generate(model, tok, prompts, top_p=1e-6, seed=5, **kw)
    assert nucleus.ids == greedy.ids


def test_n_samples_prefill_once_per_chunk(model, tok):
    calls = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    prompts = [enc(tok, "abc"), enc(tok, "hello there"), enc(tok, "9-4")]
    try:
        greedy1 = rollout.generate(model, tok, prompts, n=1, max_new_tokens=6, temperature=0, eos_ids=[])
        calls.clear()
        greedy3 = rollout.generate(model, tok, prompts, n=3, max_new_tokens=6, temperature=0, eos_ids=[])
        # prefill [3 prompts, 11 tokens] once, then 5 decode steps of one token over 3 cache rows: a
        # prompt's 3 samples share one while they agree (greedy: always), not 9
        assert calls == [(3, 11)] + [(3, 1)] * 5
        calls.clear()
        sampled = rollout.generate(model, tok, prompts, n=3, max_new_tokens=6, temperature=1.0,
                                   eos_ids=[], seed=0, batch_size=2)
        second = calls.index((1, 3))   # the second chunk's prefill
        assert calls[0] == (2, 11) and second == 6 and len(calls) == 12
        assert all(1 <= r <= 6 and w == 1 for r, w in calls[1:second])   # rows fork as samples differ
        assert all(1 <= r <= 3 and w == 1 for r, w in calls[second + 1:])
    finally:
        hook.remove()
    assert greedy3.ids == [ids for ids in greedy1.ids for _ in range(3)]
    assert greedy3.prompt_index == sampled.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # After the repeat the n rows sample independently.
    assert len({tuple(x) for x in sampled.ids[:3]}) > 1


def test_finished_rows_stop_the_loop(model, tok):
    calls = []
    hook = model.register_forward_pre_hook(lambda *a, **k: calls.append(1))
    try:
        ref = rollout.generate(model, tok, [enc(tok, "q")], max_new_tokens=8, temperature=0, eos_ids=[])
        calls.clear()
        got = rollout.generate(model, tok, [enc(tok, "q")], n=2, max_new_tokens=50, temperature=0,
                               eos_ids=[ref.ids[0][0]])
    finally:
        hook.remove()
    assert got.ids == [ref.ids[0][:1]] * 2 and got.finish == ["eos", "eos"]
    assert len(calls) == 1  # prefill only: both rows finished on the first token


def test_ids_beyond_the_tokenizer_are_never_sampled(tok):
    model = tiny.model(seed=1)
    with torch.no_grad():
        model.lm_head.weight[:len(tok)] = 0
        model.lm_head.weight[len(tok):] *= 30  # these logits would dominate without the mask
        assert int(model(input_ids=torch.tensor([[5, 6]])).logits[0, -1].argmax()) >= len(tok)
    out = rollout.generate(model, tok, [enc(tok, "ab")], n=4, max_new_tokens=5, seed=0, eos_ids=[])
    assert all(0 <= i < len(tok) for ids in out.ids for i in ids)


def test_real_vocabulary_is_masked():
    import transformers
    tok = tiny.real_tokenizer()
    if tok is None:
        pytest.skip("shared fixture r1_distill_qwen_7b not present")
    assert len(tok) < 152064
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=152064, hidden_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight[:len(tok)] = 0
        model.lm_head.weight[len(tok):].normal_(0, 10)
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    out = rollout.generate(model, tok, [prompt], n=3, max_new_tokens=3, seed=0)
    assert all(i < len(tok) for ids in out.ids for i in ids)
    assert rollout.default_eos_ids(model, tok) == [151643]


def test_no_prompts_give_no_samples(model, tok):
    assert rollout.generate(model, tok, []).ids == []


# The static KV cache path (harness/staticcache.py) against the dynamic one: on CPU the static decode step
# runs eagerly, so the same samples must come out, token for token, in float32.
SETTINGS = [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_p=0.9, seed=4)]


def assert_same_scores(a, b):
    """Log-probs per id and entropy sums of two Samples agree up to float rounding (the decode paths
    compute the same logits through differently shaped attention)."""
    assert [len(x) for x in a.logprobs] == a.lengths == [len(x) for x in b.logprobs]
    flat = lambda s: torch.tensor([x for xs in s.logprobs for x in xs])  # noqa: E731
    assert torch.allclose(flat(a), flat(b), atol=1e-5)
    assert torch.allclose(torch.tensor(a.entropy_sum), torch.tensor(b.entropy_sum), atol=1e-4)


@pytest.mark.parametrize("kw", SETTINGS, ids=["greedy", "sampled", "top-p"])
def test_static_and_dynamic_decode_give_the_same_samples(model, tok, kw):
    prompts = [enc(tok, "1+2="), enc(tok, "what is 17*3? think."), enc(tok, "x"), enc(tok, "hello there")]
    common = dict(n=3, max_new_tokens=20, batch_size=3, scores=True, **kw)
    free = rollout.generate(model, tok, prompts, eos_ids=[], decode="dynamic", **common)
    static = rollout.generate(model, tok, prompts, eos_ids=[], decode="static", **common)
    assert free.ids == static.ids
    assert_same_scores(free, static)
    # EOS and one-byte stop strings end rows at different steps; finished rows stay in the static
    # batch, masked, and are dropped from the dynamic one.
    eos = free.ids[0][5]
    text = tok.decode(free.ids[7], skip_special_tokens=True)
    seen = set()
    for stop in ([text[8]], [text[6]]):
        a = rollout.generate(model, tok, prompts, eos_ids=[eos], stop=stop, decode="dynamic", **common)
        b = rollout.generate(model, tok, prompts, eos_ids=[eos], stop=stop, decode="static", **common)
        assert a.ids == b.ids and a.finish == b.finish and a.lengths == b.lengths and a.texts == b.texts
        assert_same_scores(a, b)
        assert min(a.lengths) < max(a.lengths)
        seen |= set(a.finish)
        for ids, fin, full in zip(a.ids, a.finish, free.ids):  # a prefix of the free-running sample
            assert ids == full[:len(ids)] and (fin == "length") == (len(ids) == 20)
    assert {"eos", "stop"} <= seen


@pytest.mark.parametrize("kw", SETTINGS, ids=["greedy", "sampled", "top-p"])
def test_static_decode_over_the_live_length_gives_the_same_samples_across_buckets(model, tok, kw):
    """A long decode crosses live-length buckets (64, 128 and the 192-position buffer): each step
    attends over the bucket of the positions written so far, and the samples stay the dynamic ones."""
    from harness.staticcache import live_length
    prompts = [enc(tok, "1+2="), enc(tok, "what is 17*3? think.")]
    common = dict(n=2, max_new_tokens=140, scores=True, eos_ids=[], **kw)
    widths = []
    hook = model.register_forward_pre_hook(lambda mod, args, k: widths.append(
        k["attention_mask"]["full_attention"].shape[-1]) if isinstance(k["attention_mask"], dict) else None,
        with_kwargs=True)
    try:
        static = rollout.generate(model, tok, prompts, decode="static", **common)
    finally:
        hook.remove()
    free = rollout.generate(model, tok, prompts, decode="dynamic", **common)
    assert free.ids == static.ids and static.lengths == [140] * 4
    assert_same_scores(free, static)
    W = 20  # the longer prompt; buffers of bucket(20 + 139, 64) = 192 positions
    assert widths == [live_length(W + t + 1, 192) for t in range(139)]
    assert [widths.count(w) for w in (64, 128, 192)] == [64 - W, 64, W + 139 - 128]


def test_static_buffers_and_steps_are_kept_for_the_next_call_of_the_same_shape(model, tok, monkeypatch):
    """Two identical rollouts (two RL steps): the second allocates no buffers and captures no step
    (captures counted on the CPU, where a capture is the eager step's entry), and samples the same."""
    from harness import staticcache
    from static_shapes import Shapes
    captures = []
    capture = staticcache._Shape.capture
    monkeypatch.setattr(staticcache._Shape, "capture", lambda self, m, n: captures.append(n) or capture(self, m, n))
    shapes = Shapes(monkeypatch)
    fresh = tiny.model(seed=5)  # no decoder kept from other tests
    kw = dict(n=2, max_new_tokens=100, temperature=1.0, seed=7, eos_ids=[], decode="static")
    first = rollout.generate(fresh, tok, [enc(tok, "abc"), enc(tok, "x")], **kw)
    second = rollout.generate(fresh, tok, [enc(tok, "abc"), enc(tok, "x")], **kw)
    assert len(shapes.made) == 1 and second.ids == first.ids
    assert captures == [64, 128]  # the first call's, one per live length
    # another shape replaces the kept one: one alive at a time, its steps captured anew
    rollout.generate(fresh, tok, [enc(tok, "abc")] * 3, **kw)
    assert [(s["rows"], s["alive"]) for s in shapes.made] == [(4, 1), (6, 1)] and captures[2:] == [64, 128]


def test_one_byte_stop_string_stops_where_the_text_first_holds_it(model, tok):
    prompts = [enc(tok, "solve: 2x=8"), enc(tok, "a")]
    ref = rollout.generate(model, tok, prompts, max_new_tokens=24, temperature=0, eos_ids=[])
    s = tok.decode(ref.ids[0], skip_special_tokens=True)[4]
    for decode in rollout.DECODES:
        got = rollout.generate(model, tok, prompts, max_new_tokens=24, temperature=0, eos_ids=[], stop=s,
                               decode=decode)
        for i in range(2):
            j = next((j for j in range(24) if s in tok.decode(ref.ids[i][:j + 1])), None)
            assert got.ids[i] == ref.ids[i][:24 if j is None else j + 1]
            assert got.finish[i] == ("length" if j is None else "stop")
        assert got.finish[0] == "stop" and got.lengths[0] <= 5
    for stop in (["ab"], ["é"], [5]):   # may span tokens, two bytes, a token id: refused, not ignored
        with pytest.raises(ValueError, match="one byte"):
            rollout.generate(model, tok, prompts, max_new_tokens=2, stop=stop)


def test_static_path_masks_the_vocabulary_and_keeps_finished_rows_in_place(tok):
    model = tiny.model(seed=1)
    with torch.no_grad():
        model.lm_head.weight[:len(tok)] = 0
        model.lm_head.weight[len(tok):] *= 30  # these logits would dominate without the mask
    calls = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kw: calls.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        out = rollout.generate(model, tok, [enc(tok, "ab"), enc(tok, "xyz")], n=3, max_new_tokens=6, seed=0,
                               eos_ids=[], decode="static")
    finally:
        hook.remove()
    assert all(0 <= i < len(tok) for ids in out.ids for i in ids)
    # prefill [2 prompts, 3 tokens], then every step feeds all 6 rows into the same static buffers.
    assert calls == [(2, 3)] + [(6, 1)] * 5


def test_bucketed_shapes():
    from harness.staticcache import bucket
    assert [bucket(x, 1) for x in (1, 7, 8, 9, 64, 65, 100)] == [1, 7, 8, 9, 64, 72, 104]
    assert bucket(70, 64) == 128 and bucket(8792, 64) == 9216
    from harness.staticcache import live_length  # 2^k or 1.5 x 2^k, at least 64, at most the buffer
    assert [live_length(n, 1000) for n in (1, 64, 65, 129, 193, 257, 385, 700, 999)] == \
        [64, 64, 128, 192, 256, 384, 512, 768, 1000]
    assert rollout.default_decode(tiny.model()) == "dynamic"


@pytest.mark.parametrize("temperature", [0.8, 0])
def test_scores_are_the_full_distributions_log_prob_and_entropy(tok, temperature):
    """Against an uncached forward over prompt + sample: the log-prob of each sampled id and the
    entropy under softmax(logits / temperature) over the tokenizer's ids, not the top-p-restricted
    distribution it was drawn from (temperature 0 is scored at 1)."""
    model = tiny.model(seed=2)  # 300 embedding rows, 61 tokenizer ids: the mask matters here
    prompts = [enc(tok, "1+2="), enc(tok, "what is 17*3?")]
    kw = dict(n=2, max_new_tokens=10, temperature=temperature, top_p=0.7, seed=1)
    eos = rollout.generate(model, tok, prompts, eos_ids=[], **kw).ids[0][4]
    for decode in rollout.DECODES:
        out = rollout.generate(model, tok, prompts, eos_ids=[eos], decode=decode, scores=True, **kw)
        assert min(out.lengths) < max(out.lengths)  # the alignment is checked on ragged rows
        for ids, logp, entropy, i in zip(out.ids, out.logprobs, out.entropy_sum, out.prompt_index):
            p = prompts[i]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1:-1, :len(tok)]
            ref = (logits / (temperature or 1.0)).log_softmax(-1)
            assert torch.allclose(torch.tensor(logp), ref.gather(-1, torch.tensor(ids)[:, None])[:, 0], atol=1e-5)
            assert entropy == pytest.approx(-(ref.exp() * ref).sum().item(), abs=1e-4)


def test_token_scores_of_a_hand_made_row():
    """logits (2, 0, -1, -inf) at temperature 0.5: z = (4, 0, -2), the masked id has p = 0."""
    logits = torch.tensor([[2.0, 0.0, -1.0, float("-inf")]])
    for temperature, t in ((0.5, 0.5), (0, 1.0)):
        z = [2 / t, 0.0, -1 / t]
        lse = math.log(sum(math.exp(x) for x in z))
        p = [math.exp(x - lse) for x in z]
        logp, entropy = rollout.token_scores(logits, torch.tensor([1]), temperature)
        assert logp.item() == pytest.approx(z[1] - lse, abs=1e-6)
        assert entropy.item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-6)
