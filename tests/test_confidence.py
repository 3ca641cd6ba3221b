import math
import os
import time

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from evaluation import benchmarks, confidence
import probe as probe_lib
import rollout
import tiny
import rollout as sampling

# posthoc_examples' and posthoc_labels' protocol (get_probe builds it) at the released values
PROTOCOL = dict(every=500, count=16, k=16, suffix=benchmarks.EVAL_SUFFIX, close="think", stop=(), copy_natural=True,
                seed=0, lead=confidence.EVAL_LEAD, gate="thinking")
FIT = dict(epochs=100, patience=30, batch=64, val_frac=0.2, seed=42)   # fit_posthoc's, as released


class _Tok:
    pad_token_id = 0


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("text, expected", [
    ("<answer>3</answer><confidence>0.8</confidence>", (0.8, False)),
    ("<confidence>85</confidence>", (0.85, False)),
    ("<confidence> 85% </confidence>", (0.85, False)),
    ("<confidence>0.2</confidence> then <confidence>0.9</confidence>", (0.9, False)),   # the last tag
    ("<confidence>1</confidence>", (1.0, False)),
    # the released parser's edges (33d36b1: 1.0, 0.0, 0.001, 0.9): invalid, so 0.5 and counted
    ("<confidence>150</confidence>", (0.5, True)),
    ("<confidence>-0.2</confidence>", (0.5, True)),
    ("<confidence>1e-3</confidence>", (1.0, False)),           # the first number, "1"
    ("<Confidence>0.9</Confidence>", (0.5, True)),             # tags are case-sensitive
    ("<confidence>100</confidence>", (1.0, False)),
    ("<confidence>0</confidence>", (0.0, False)),
    ("<confidence>0.2 <confidence>0.9</confidence>", (0.2, False)),   # the regex's match opens at the first tag
    ("<confidence>high</confidence>", (0.5, True)),
    ("no tag at all \\boxed{3}", (0.5, True)),
])
def test_verbal_confidence(text, expected):
    assert confidence.verbal_confidence(text) == pytest.approx(expected)


def test_think_end():
    assert confidence.think_end([5, 6, 9, 7, 9], 9) == 2
    assert confidence.think_end([5, 6, 7], 9) == 3
    assert confidence.think_end([5, 6, 7], None) == 3


def test_posthoc_budgets_reuse_the_end_of_thinking():
    assert confidence.posthoc_budgets(20, 8, 4) == [8, 16, 20, 20]
    assert confidence.posthoc_budgets(16, 8, 3) == [8, 16, 16]
    assert confidence.posthoc_budgets(9000, 500) == list(range(500, 8001, 500))   # the released 16
    assert confidence.posthoc_budgets(1200, 500) == [500, 1000] + [1200] * 14


def test_logit_confidence_is_exp_mean_response_logprob_at_the_training_temperature():
    # C2GSPG's c is trained at the sampling temperature 0.8: read there by default, T = 1 on request.
    model = _tiny_model()
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]]
    for temperature, kw in ((0.8, {}), (1.0, dict(temperature=1.0))):
        got = confidence.logit_confidence(model, prompts, responses, pad_id=0, batch_size=1, **kw)
        for p, r, c in zip(prompts, responses, got):
            ids = torch.tensor([p + r])
            logits = model(ids).logits / temperature
            logp = logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
            assert c == pytest.approx(math.exp(logp[len(p) - 1:].mean().item()), rel=1e-5)


def test_features_positions():
    """Post-hoc feature at budget b = final normed state of token len(prompt) + b - 1; training feature =
    mean of the last decoder layer's (pre-norm) output over the 4 positions before that end."""
    model = _tiny_model()
    p, r = [1, 2, 3], [6, 7, 8, 9, 10]
    post = confidence.features(model, [p, [4]], [r, [5]], [[2, 5], [1]], 0, final_norm=True)
    out = model(torch.tensor([p + r]), output_hidden_states=True)
    final = out.hidden_states[-1][0]          # after the final norm
    assert torch.allclose(post[0][0], final[len(p) + 2 - 1], atol=1e-5)
    assert torch.allclose(post[0][1], final[len(p) + 5 - 1], atol=1e-5)
    assert post[1].shape == (1, 16)
    train = confidence.features(model, [p], [r], [[2]], 0, final_norm=False)
    pre = {}
    h = model.model.layers[-1].register_forward_hook(lambda m, a, o: pre.setdefault("h", o[0] if isinstance(o, tuple) else o))
    model(torch.tensor([p + r]))
    h.remove()
    end = len(p) + 2
    assert torch.allclose(train[0][0], pre["h"][0, end - 4:end].mean(0), atol=1e-5)


def test_sample_confidences_probe_reads_the_end_of_thinking():
    model = _tiny_model()
    prb = probe_lib.Probe(16, dropout=0.0)
    close = 9
    prompts, responses = [[1, 2, 3]] * 2, [[6, 7, 9, 11, 2], [6, 7, 8, 6, 7, 8, 6]]
    conf, extras = confidence.sample_confidences("probe-posthoc", model, _Tok(), prompts, responses,
                                                 ["", ""], ["1", "1"], prb=prb, close_id=close)
    feats = confidence.features(model, prompts, responses, [[2], [7]], 0, final_norm=True)
    want = probe_lib.predict(prb, torch.cat(feats)).tolist()
    assert conf == pytest.approx(want, rel=1e-5) and extras == [{}, {}]
    conf, extras = confidence.sample_confidences("verbal", None, _Tok(), prompts, responses,
                                                 ["<confidence>0.7</confidence>", "x"], ["1", "1"])
    assert conf == [0.7, 0.5] and extras == [{"verbal_missing": False}, {"verbal_missing": True}]


def test_split_groups_keeps_problems_whole():
    groups = torch.tensor([q for q in range(10) for _ in range(3)])
    tr, va = confidence.split_groups(groups, seed=1)
    assert len(va) == 6 and not set(groups[tr].tolist()) & set(groups[va].tolist())
    assert sorted(tr.tolist() + va.tolist()) == list(range(30))


def test_split_adds_validation_problems_in_the_released_generators_order():
    """Released (4_probe_training.build_group_split_indices, split_mode "prompt"): the problems in
    order of first appearance, shuffled by np.random.RandomState(42), go to validation while it holds
    fewer than int(0.2 * M) examples; validation keeps that order (it sets the loss's batches)."""
    sizes = [1, 7, 2, 16, 3, 5, 1, 9, 4, 12, 6, 2]
    first_seen = [3, 0, 7, 1, 4, 2, 9, 5, 11, 6, 10, 8]     # problem ids in order of first appearance
    groups = torch.tensor([q for q in first_seen for _ in range(sizes[q])])
    order = list(first_seen)
    np.random.RandomState(42).shuffle(order)
    target = int(0.2 * len(groups))
    want, held = [], 0
    for q in order:
        if held < target:
            want.append(q)
            held += sizes[q]
    tr, va = confidence.split_groups(groups)
    assert [g for g in dict.fromkeys(groups[va].tolist())] == want      # numpy's order, whole problems
    assert len(va) == held and len(tr) + held == len(groups)
    assert not set(groups[tr].tolist()) & set(want)


def test_the_validation_loss_is_the_released_mean_of_batch_means():
    """Released (4_probe_training.train_single_run): val_loss += BCEWithLogits per batch of 64, then /=
    the number of batches: a short last batch weighs as much as a full one."""
    torch.manual_seed(0)
    prb = probe_lib.Probe(4, 1, dropout=0.0)
    x, y = torch.randn(70, 4), (torch.rand(70) > 0.5).float()
    logits = prb(x).detach()
    per = torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none")
    released = (per[:64].mean() + per[64:].mean()) / 2
    assert confidence.val_loss(prb(x), y) == pytest.approx(float(released), rel=1e-6)
    assert abs(float(released) - float(per.mean())) > 1e-3          # not one mean over the examples


def test_a_fit_keeps_an_epoch_only_when_its_loss_is_strictly_lower(monkeypatch):
    """Released: `val_loss < best_val_loss`. Epoch 2's loss is 5e-7 below epoch 1's: kept."""
    x, y = torch.randn(40, 4), (torch.arange(40) % 2).float()
    groups = torch.arange(40) // 4
    losses = iter([1.0, 1.0 - 5e-7, 2.0, 2.0, 2.0])
    monkeypatch.setattr(confidence, "val_loss", lambda *a, **k: next(losses))
    _, rep = confidence.fit_posthoc(x, y, groups, dict(FIT, epochs=5), grid=[(1e-3, 0.5, 1e-2)])
    assert rep["best_epoch"] == 2 and rep["epochs"] == 5


class _MergeTok:
    """A tokenizer whose id 20 is "ab", which encoding never produces: a sampled [20] re-tokenizes as
    [5, 6]. BOS is id 1."""
    eos_token_id, pad_token_id, bos_token_id = 0, 0, 1
    chars = {"a": 5, "b": 6, "c": 7}

    def encode(self, text, add_special_tokens=False):
        return [self.chars[c] for c in text]

    def decode(self, ids):
        return "".join("ab" if i == 20 else {v: k for k, v in self.chars.items()}[i] for i in ids)


def forced_calls(monkeypatch, answers):
    """label.forced_answers replaced: each call's whole forced prompts and settings are recorded, and
    each forced prompt is answered with answers(k), a list of k texts."""
    import label
    calls = []

    def fake(model, tok, prompts, responses, cut_lists, cuts, tail, k, sampling, seed, batch_size,
             progress=None):
        forced = [[*prompts[i], *responses[i][:b], *tail] for i, b in cuts]
        calls.append(dict(prompts=forced, n=k, **sampling))
        return answers(k) * len(cuts), None
    monkeypatch.setattr(label, "forced_answers", fake)
    return calls


def test_posthoc_tokens_text_counts_budgets_in_the_retokenized_thinking_without_bos(monkeypatch):
    """Released (2_budget_eval: tokenizer(prompt, add_special_tokens=False) of a prompt decoded without
    its special tokens, the thinking re-tokenized from its text): --posthoc-tokens text. Default: the
    sampled ids, the prompt's BOS kept."""
    model, calls = _tiny_model(), forced_calls(monkeypatch, lambda k: ["x"] * k)
    p = dict(PROTOCOL, every=2, count=4, k=1, suffix="", close="eos", lead="")
    kw = dict(groups=[0], close_id=9, p=p)
    x, _, _, _ = confidence.posthoc_examples(model, _MergeTok(), [[1, 2, 3]], [[20, 20, 7]], ["never boxed"], ["7"], **kw)
    assert calls[-1]["prompts"] == [[1, 2, 3, 20, 20, 0], [1, 2, 3, 20, 20, 7, 0]]       # budgets 2, 3, 3, 3 of 3 ids
    x, _, _, _ = confidence.posthoc_examples(model, _MergeTok(), [[1, 2, 3]], [[20, 20, 7]], ["never boxed"], ["7"],
                                             groups=[0], close_id=9, p=dict(p, tokens="text"))
    assert calls[-1]["prompts"] == [[2, 3, 5, 6, 0], [2, 3, 5, 6, 5, 6, 0], [2, 3, 5, 6, 5, 6, 7, 0]]   # 2, 4, 5, 5 of 5
    # the feature at budget 4: prompt (BOS kept) + "abab" as re-tokenized
    want = confidence.features(model, [[1, 2, 3]], [[5, 6, 5, 6, 7]], [[4]], 0, final_norm=True)[0][0]
    assert torch.allclose(x[1], want, atol=1e-6)


class _CharTok:
    """Stands in for a tokenizer in the labelling code: ids are character codes, EOS is id 0."""
    eos_token_id, pad_token_id = 0, 0

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_posthoc_examples_budget_rule_natural_copy_and_last_box(monkeypatch):
    """16 examples per rollout; budgets past the end of thinking read the end-of-thinking feature and
    copy the natural answer's correctness when it has a box; forced answers are read from the last box
    of suffix + completion, one sampling per distinct forced prompt, no stop string."""
    model = _tiny_model()
    close = 9
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5]]
    # thinking lengths 3, 5 and 2 (no </think>: the whole response is thinking)
    responses = [[6, 7, 8, close, 11, 12], [6, 7, 8, 10, 11, close, 12], [13, 14]]
    texts = ["think \\boxed{7}", "wrong \\boxed{5}", "never boxed"]
    golds = ["7", "7", "7"]
    # first sample: a box closed then another one (the last box, 7, is read); others wrong
    calls = forced_calls(monkeypatch, lambda k: ["5} no, \\boxed{7}"] + ["3}"] * (k - 1))
    x, y, g, stats = confidence.posthoc_examples(model, _CharTok(), prompts, responses, texts, golds,
                                                 groups=[0, 0, 1], close_id=close,
                                                 p=dict(PROTOCOL, every=2, count=16, k=4, suffix="S \\boxed{", close="eos"))
    assert x.shape == (48, 16) and y.shape == (48,) and g.tolist() == [0] * 32 + [1] * 16
    # rollout 0: budget 2 < end 3 is sampled (1 of 4 right); the other 15 read the end (thinking 3)
    # and copy the natural answer (right); rollout 1: budgets 2, 4 sampled, the end (5) copied 14
    # times (wrong); rollout 2 has no box: its end (2) is sampled, all 16 budgets reuse it.
    assert y[:16].tolist() == [0.25] + [1.0] * 15
    assert y[16:32].tolist() == [0.25, 0.25] + [0.0] * 14
    assert y[32:].tolist() == [0.25] * 16
    assert stats == dict(examples=48, past_end=15 + 14 + 16, natural_copied=15 + 14)
    (call,) = calls
    # distinct forced prompts: rollouts 0 and 1 agree up to token 2; then rollout 1 at 4, rollout 2 at 2
    assert len(call["prompts"]) == 3 and call["n"] == 4
    # released: the cut thinking, "...", the close, the suffix
    assert call["prompts"][0] == [1, 2, 3, 6, 7] + [ord(c) for c in "..."] + [0] + [ord(c) for c in "S \\boxed{"]
    assert call["stop"] == ()
    assert (call["temperature"], call["top_p"], call["max_new_tokens"]) == (0.6, 0.95, 64)
    # features: every past-end budget of rollout 0 equals its end-of-thinking feature (position 3)
    end = confidence.features(model, prompts[:1], responses[:1], [[3]], 0, final_norm=True)[0][0]
    assert all(torch.allclose(x[j], end, atol=1e-6) for j in range(1, 16))
    assert not torch.allclose(x[0], end, atol=1e-4)


def _parity_graded(monkeypatch):
    """(tok, model, prompts, responses, probe): three random responses of a random tiny model, whose
    forced answers are graded by the parity of their text's length, so that checkpoints see every draw."""
    import label
    import tiny
    monkeypatch.setattr(label, "forced_answer", lambda text: text)
    monkeypatch.setattr(label, "answers_match", lambda answer, gold, grader: len(answer) % 2 == 0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 60, (n,), generator=gen).tolist() for n in (3, 5, 4)]
    responses = [torch.randint(4, 60, (n,), generator=gen).tolist() for n in (12, 17, 9)]
    return tiny.tokenizer(), tiny.model(seed=2), prompts, responses, probe_lib.Probe(32, dropout=0.0)


def test_early_exit_lines_do_not_depend_on_the_chunk(monkeypatch):
    """The early exit's forced answers are sampled in chunks of cuts sized from the memory free (on
    a GPU, plan.label_chunk); each answer draws from its own stream, so chunks of 2 and of 64 cuts
    give the same checkpoint lines. Graded here by the parity of the sampled text's length, so that
    a line sees every draw of the random model (whose answers would otherwise all be wrong)."""
    tok, model, prompts, responses, prb = _parity_graded(monkeypatch)
    lines = {}
    for rows in (2, 64):
        _, extras = confidence.sample_confidences("probe-posthoc", model, tok, prompts, responses, [""] * 3,
                                                  ["1"] * 3, prb=prb, close_id=3, every=2, suffix="{",
                                                  close="eos", seed=5, rows=rows)
        lines[rows] = [e["checkpoints"] for e in extras]
    assert lines[2] == lines[64]
    ys = [y for ls in lines[2] for _, _, y in ls]
    assert len(ys) == 5 + 8 + 4 and 0 < sum(ys) < len(ys)


def test_the_early_exit_reads_features_and_forced_answers_off_one_prefill(monkeypatch):
    """With `every`, a response's features come from the prefill its forced answers start from (no
    second forward: features() is not called): the confidences a separate forward gives, to float
    rounding, and the checkpoints' answers mc_labels gives at the checkpoints alone."""
    import label
    tok, model, prompts, responses, prb = _parity_graded(monkeypatch)
    kw = dict(prb=prb, close_id=3, suffix="{", close="eos", seed=5, fractions=(0.5,))
    for source in ("probe-posthoc", "probe"):
        separate = confidence.features
        monkeypatch.setattr(confidence, "features", lambda *a, **k: 1 / 0)   # never called with every
        conf, extras = confidence.sample_confidences(source, model, tok, prompts, responses, [""] * 3,
                                                     ["1"] * 3, every=2, **kw)
        monkeypatch.setattr(confidence, "features", separate)
        bls = [[c for c, _, _ in e["checkpoints"]] for e in extras]
        assert bls == [list(range(2, len(r), 2)) for r in responses]
        ends = [len(r) if source == "probe-posthoc" else max(label.cuts_of(len(r), (0.5,)))
                for r in responses]
        feats = separate(model, prompts, responses, [bl + [e] for bl, e in zip(bls, ends)], tok.pad_token_id,
                         source == "probe-posthoc")
        want = [probe_lib.predict(prb, f).tolist() for f in feats]
        assert conf == pytest.approx([w[-1] for w in want], rel=1e-5)
        assert [[c for _, c, _ in e["checkpoints"]] for e in extras] == \
            [pytest.approx(w[:-1], abs=2e-6) for w in want]
        posthoc = dict(label.FORCED, temperature=0.6, top_p=0.95, max_new_tokens=64)
        ys = label.mc_labels(model, tok, prompts, responses, bls, ["1"] * 3, k=1, close="eos",
                             suffix="{", seed=5, sampling=posthoc)
        assert [[y for _, _, y in e["checkpoints"]] for e in extras] == ys


def test_sample_confidences_own_probe_reads_its_last_training_budget():
    model = _tiny_model()
    prb = probe_lib.Probe(16, dropout=0.0)
    prompts, responses = [[1, 2, 3]] * 2, [[6, 7, 9, 11, 2, 3, 4, 5], [6, 7, 8, 6]]
    conf, _ = confidence.sample_confidences("probe", model, _Tok(), prompts, responses, ["", ""], ["1", "1"],
                                            prb=prb, close_id=9)
    # cuts_of(8) == [2, 4, 6], cuts_of(4) == [1, 2, 3]: read at 6 and 3, on the training feature
    feats = confidence.features(model, prompts, responses, [[6], [3]], 0, final_norm=False)
    assert conf == pytest.approx(probe_lib.predict(prb, torch.cat(feats)).tolist(), rel=1e-5)
    conf1, _ = confidence.sample_confidences("probe", model, _Tok(), prompts, responses, ["", ""], ["1", "1"],
                                             prb=prb, close_id=9, fractions=(1.0,))
    feats = confidence.features(model, prompts, responses, [[8], [4]], 0, final_norm=False)
    assert conf1 == pytest.approx(probe_lib.predict(prb, torch.cat(feats)).tolist(), rel=1e-5)


def test_bce_hand_computed():
    assert confidence.bce([0.5, 0.5], [1.0, 0.0]) == pytest.approx(math.log(2))
    assert confidence.bce([0.8], [0.25]) == pytest.approx(-(0.25 * math.log(0.8) + 0.75 * math.log(0.2)))


@pytest.fixture
def one_thread():
    # Tiny MLP steps: with two threads on a shared CPU they wait on each other (10x slower).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_fit_posthoc_learns_a_signal_and_beats_the_base_rate(one_thread):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=gen)
    y = torch.sigmoid(3 * x[:, 0]).round(decimals=1)      # soft labels that depend on one feature
    groups = torch.arange(400) // 4
    grid = [(1e-2, 0.5, 1e-3), (1e-3, 0.5, 1e-3)]
    prb, rep = confidence.fit_posthoc(x, y, groups, dict(FIT, epochs=30, patience=5), grid=grid)
    assert rep["n_train"] + rep["n_val"] == 400 and rep["n_val"] == 80
    assert rep["lr"] in (1e-2, 1e-3) and prb.hidden == 2
    assert rep["val_bce"] < rep["base_bce"] - 0.1
    with pytest.raises(ValueError, match="two problems"):
        confidence.fit_posthoc(x[:4], y[:4], groups[:4], FIT)


def test_the_settings_fitted_together_are_the_settings_fitted_one_by_one(one_thread):
    """fit_together against fit_setting, bit for bit: the released grid, a short last batch (470 train
    examples), settings stopping early (after lrs halved on a plateau) and others running on."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(600, 64, generator=gen)
    y = (torch.sigmoid(0.5 * x[:, 0] + 2 * torch.randn(600, generator=gen)) * 4).round() / 4
    groups = torch.arange(600) // 10
    p = dict(FIT, epochs=20, patience=3)
    fits = [confidence.fit_posthoc(x, y, groups, p, plateau=(0.5, 1), together=t) for t in (False, True)]
    (one, rep1), (all_, rep2) = fits
    assert rep1["n_train"] % 64 and rep1 == rep2
    assert {r["epochs"] for r in rep1["grid"]} == {11, 20}
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), all_.state_dict().values()))
    split = x[:470], y[:470], x[470:], y[470:]
    sets = [confidence.fit_together(*split, p, confidence.GRID, (0.5, 1)),
            [confidence.fit_setting(*split, p, s, (0.5, 1)) for s in confidence.GRID]]
    for (r1, s1), (r2, s2) in zip(*sets):
        assert r1 == r2 and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_verbal_forced_cuts_the_thinking_closes_it_and_averages_k_reanswers(monkeypatch):
    # The toy's forced prompt is prompt + thinking[:min(end of thinking, budget)] + </think>; the confidence
    # is the mean of the k re-answers' tags, a re-answer without one reading 0.5 and counted.
    seen = {}

    def fake_generate(model, tok, prompts, n, **kw):
        seen.update(prompts=prompts, n=n, kw=kw)
        texts = ["<confidence>0.9</confidence>", "<confidence>0.3</confidence>", "no tag",
                 "<confidence>80</confidence>", "<confidence>0.2</confidence>", "<confidence>0.2</confidence>"]
        return rollout.Samples([[1]] * 6, texts, [1] * 6, ["eos"] * 6, [0, 0, 0, 1, 1, 1])

    monkeypatch.setattr(confidence, "generate", fake_generate)
    CLOSE = 9
    prompts, responses = [[1, 2], [3]], [[5, 6, CLOSE, 7], [5, 6, 7, 8, 5]]
    model = torch.nn.Linear(1, 1)  # on the CPU: the dynamic path, prompts in the order given
    conf, missing = confidence.forced_verbal(model, None, prompts, responses, CLOSE, budget=3, k=3, seed=0,
                                             close_text=None)
    assert seen["prompts"] == [[1, 2, 5, 6, CLOSE], [3, 5, 6, 7, CLOSE]] and seen["n"] == 3
    assert seen["kw"]["temperature"] == 0.6 and seen["kw"]["top_p"] == 0.95
    assert conf == pytest.approx([(0.9 + 0.3 + 0.5) / 3, (0.8 + 0.2 + 0.2) / 3]) and missing == [1, 0]
    with pytest.raises(ValueError, match="</think>"):
        confidence.forced_verbal(None, None, prompts, responses, None, budget=3, k=3)


@pytest.mark.parametrize("text, expected", [
    # Released (2_budget_eval --rlcr): no complete <answer> tag, or a blank one, and a `\\boxed{`:
    # the boxed fallback, confidence 0.5 whatever the <confidence> tag says
    ("\\boxed{5} <confidence>0.9</confidence>", (0.5, True)),
    ("</answer> so \\boxed{5} <confidence>0.9</confidence>", (0.5, True)),   # opened by the prompt, blank
    ("<answer> $ $ </answer> \\boxed{5} <confidence>0.9</confidence>", (0.5, True)),
    ("\\boxed{5</answer> <confidence>0.9</confidence>", (0.9, False)),       # its answer is "\\boxed{5"
    ("5</answer> \\boxed{5} <confidence>0.9</confidence>", (0.9, False)),    # a complete tag: its confidence
    ("<confidence>0.9</confidence>", (0.9, False)),                          # no box: the tag, as before
    ("\\fbox{5} <confidence>0.9</confidence>", (0.9, False)),                # only `\\boxed{` triggers it
])
def test_a_reanswer_without_its_answer_tag_but_with_a_box_reads_half_as_released(text, expected):
    assert confidence.reanswer_confidence(text) == expected


@pytest.mark.skipif(not os.path.isdir(tiny.REAL_TOKENIZER), reason="shared fixtures not present")
def test_rlcr_reanswer_prompt_ids_on_the_r1_tokenizer(monkeypatch):
    # Released (2_budget_eval_rlcr): prompt ids + thinking[:budget] + the ids of
    # "...</think>\n\nI am out of time, ...\n\n<answer>", that text tokenized on its own; 1000 tokens.
    tok = tiny.real_tokenizer()
    seen = {}

    def fake_generate(model, tok, prompts, n, **kw):
        seen.update(prompts=prompts, kw=kw)
        return rollout.Samples([[1]] * n, ["17</answer><confidence>0.7</confidence>"] * n, [1] * n, ["eos"] * n, [0] * n)

    monkeypatch.setattr(confidence, "generate", fake_generate)
    think = tok.convert_tokens_to_ids("</think>")
    assert think == 151649
    prompt, response = [151646, 151644, 16, 151645, 151648, 198], [18, 10, 20, 28, 23, 198, think, 59]
    conf, missing = confidence.forced_verbal(torch.nn.Linear(1, 1), tok, [prompt], [response], think,
                                             budget=4, k=1, seed=0)
    close = seen["prompts"][0][len(prompt) + 4:]
    assert seen["prompts"][0][:len(prompt) + 4] == prompt + response[:4]
    assert len(close) == 60 and close[:6] == [1112, 151649, 271, 40, 1079, 700]   # ..., </think>, \n\n, I, am, out
    assert close[-3:] == [27, 9217, 29]                                             # <answer>
    assert tok.decode(close) == ("...</think>\n\nI am out of time, let me just output the final answer and "
                                 "confidence analysis in exactly this format:\n<answer> final answer here </answer>\n"
                                 "<analysis> confidence and uncertainty analysis here </analysis>\n<confidence> "
                                 "number between 0 and 1 </confidence>\n\n<answer>")
    assert seen["kw"]["max_new_tokens"] == 1000 and conf == [0.7] and missing == [0]
    # the thinking ends at its own </think> when that comes before the budget
    confidence.forced_verbal(torch.nn.Linear(1, 1), tok, [prompt], [response], think, budget=8000, k=1)
    assert seen["prompts"][0][len(prompt):len(prompt) + 7] == response[:6] + [1112]


def test_evaluation_reanswers_as_released():
    import evaluate
    args = evaluate.parse_args(["--model", "x"])
    assert [benchmarks.settings(b, args)["reanswer_k"] for b in ("aime24", "amc23", "math500", "toy")] == [4, 4, 1, 4]
    assert benchmarks.settings("math500", args)["reanswer"] == confidence.RLCR_REANSWER
    assert benchmarks.settings("toy", args)["reanswer"] is None


def test_verbal_forced_on_the_toy_base_reads_its_rlcr_tags():
    import data
    import toy
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = toy.BASE_DIR
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    rows = toy.dataset("test")[:8]
    prompts = [data.chat_prompt(tok, r["problem"], toy.RLCR_INSTRUCTION) for r in rows]
    out = rollout.generate(model, tok, prompts, max_new_tokens=48, temperature=0.6, seed=0)
    close = tok.convert_tokens_to_ids("</think>")
    conf, extras = confidence.sample_confidences("verbal-forced", model, tok, prompts, out.ids, out.texts,
                                                 [r["answer"] for r in rows], close_id=close, forced_k=4,
                                                 budget=128, seed=1, reanswer=None)   # the toy's close
    # the base draws its confidence from 0.1 .. 0.9 whatever the trace: means of 4 such draws
    assert all(0.1 <= c <= 0.9 for c in conf) and len(set(conf)) > 1
    assert [e["verbal_missing"] for e in extras] == [0] * 8


def test_posthoc_labels_copy_the_natural_answer_only_if_the_thinking_is_boxed(monkeypatch):
    # Both rollouts end their thinking (id 9) at 3 tokens and are right; rollout 0 boxes only after
    # </think> (R1's habit), rollout 1 inside the thinking too. Released (2_budget_eval): only
    # rollout 1's past-end budgets copy its correctness (1.0); rollout 0's are forced (1 of 4 right).
    forced_calls(monkeypatch, lambda k: ["7}"] + ["3}"] * (k - 1))
    responses = [[6, 7, 8, 9, 11], [6, 7, 8, 9, 11]]
    texts = ["3+4=7</think>\\boxed{7}", "so \\boxed{7}</think>\\boxed{7}"]
    positions, ends = [[2, 3, 3], [2, 3, 3]], [3, 3]
    p = dict(PROTOCOL, k=4, suffix="\\boxed{", close="eos")
    labels, copied = confidence.posthoc_labels(torch.nn.Linear(1, 1), _CharTok(), [[1], [1]], responses, texts, ["7", "7"], positions,
                                               ends, p)
    assert labels == [[0.25, 0.25, 0.25], [0.25, 1.0, 1.0]] and copied == 2
    # gate="none" (the toy's rule): a box anywhere in the response is copied
    labels, copied = confidence.posthoc_labels(torch.nn.Linear(1, 1), _CharTok(), [[1], [1]], responses, texts, ["7", "7"], positions,
                                               ends, dict(p, gate="none"))
    assert labels == [[0.25, 1.0, 1.0], [0.25, 1.0, 1.0]] and copied == 4


def test_posthoc_labels_decode_one_bounded_shape_at_a_time(monkeypatch):
    """Evaluation's post-hoc labels send every forced prompt through label.forced_answers, in chunks
    of `rows` rows whose widths vary widely (budgets every few hundred tokens): on the static path
    only one shape (of at most `rows` rows) is alive at a time, and, the rollouts taken shortest
    first, none is built twice."""
    import tiny
    from static_shapes import Shapes
    monkeypatch.setattr(sampling, "default_decode", lambda model: "static")
    tok, model = tiny.tokenizer(), tiny.model(seed=4)
    gen = torch.Generator().manual_seed(0)
    lengths = [30, 90, 150, 240, 330, 420]
    responses = [torch.randint(4, 60, (n,), generator=gen).tolist() for n in lengths]
    positions = [list(range(30, n + 1, 30)) for n in lengths]
    shapes = Shapes(monkeypatch)
    labels, copied = confidence.posthoc_labels(model, tok, [[5, 6]] * 6, responses, [""] * 6, ["3"] * 6,
                                               positions, lengths, dict(PROTOCOL, k=4, suffix="{", close="eos",
                                                                        copy_natural=False), rows=8)
    assert [len(y) for y in labels] == [len(p) for p in positions] and copied == 0
    assert len(shapes.made) >= 4 and max(s["rows"] for s in shapes.made) == 8
    assert max(s["alive"] for s in shapes.made) == 1
    # sampled shortest first, each shape is built once (widths only grow)
    assert len({(s["rows"], s["length"]) for s in shapes.made}) == len(shapes.made)


@pytest.mark.parametrize("lead, stop", [("", ("\n",)), ("..", ())])
def test_posthoc_forced_answers_are_generates_keyed_to_each_forced_prompt_whatever_the_rows(monkeypatch, lead, stop):
    """The post-hoc labels' forced answers come from label.forced_answers (one prefill per rollout, a
    row per cut): each distinct forced prompt's k answers are what rollout.generate samples from the
    whole prompt with draws keyed to it, so they do not depend on `rows` nor on what shares a chunk."""
    tok, model = tiny.tokenizer(), tiny.model(seed=1)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = [enc("1+2="), enc("1+2="), enc("what is 17*3?")]
    responses = [enc("3 ok fine"), enc("3 no way"), enc("51 since")]
    positions = [[2, 4, 9], [2, 5, 8], [3, 6, 8]]   # rollouts 0 and 1 agree at 2: asked once
    p = dict(PROTOCOL, k=3, suffix="{", close="eos", lead=lead, stop=stop, copy_natural=False)
    graded, real = [], confidence.boxed_answer
    monkeypatch.setattr(confidence, "boxed_answer", lambda t: graded.append(t[1:]) or real(t))
    for rows in (3, 64):
        confidence.posthoc_labels(model, tok, prompts, responses, [""] * 3, ["3"] * 3, positions, [9] * 3, p, rows)
    tail = enc(lead) + [tok.eos_token_id] + enc("{")
    forced = list(dict.fromkeys(tuple(prompts[i] + responses[i][:b] + tail) for i, bs in enumerate(positions)
                                for b in bs))
    ref = rollout.generate(model, tok, [list(f) for f in forced], n=3, max_new_tokens=64, temperature=0.6,
                           top_p=0.95, stop=stop, seed=0, keyed=True)
    assert len(forced) == 8 and graded == ref.texts * 2 and len(set(ref.texts)) > 12


def test_verbal_confidence_on_100_kb_of_repeated_tags_is_fast_and_reads_the_last_tag():
    start = time.perf_counter()
    conf = confidence.verbal_confidence("<confidence>" * 8500)   # 102 KB, no closing tag
    assert time.perf_counter() - start < 0.1   # 81f6578: 12 s for 96 KB
    assert conf == (0.5, True)
    text = "<confidence>0.7</confidence>" + "<confidence>" * 8500 + "<confidence> 0.3 </confidence> <confidence>0.9"
    assert confidence.verbal_confidence(text) == (0.3, False)   # the last complete tag
