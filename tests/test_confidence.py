import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import confidence
import probe as probe_lib


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
    ("<confidence>150</confidence>", (1.0, False)),                                     # clipped
    ("<confidence>high</confidence>", (0.5, True)),
    ("no tag at all \\boxed{3}", (0.5, True)),
])
def test_verbal_confidence(text, expected):
    assert confidence.verbal_confidence(text) == pytest.approx(expected)


def test_think_end():
    assert confidence.think_end([5, 6, 9, 7, 9], 9) == 2
    assert confidence.think_end([5, 6, 7], 9) == 3
    assert confidence.think_end([5, 6, 7], None) == 3


def test_posthoc_budgets_include_the_end_of_thinking():
    assert confidence.posthoc_budgets(20, 8) == [8, 16, 20]
    assert confidence.posthoc_budgets(16, 8) == [8, 16]
    assert confidence.posthoc_budgets(5, 8) == [5]
    assert confidence.posthoc_budgets(0, 8) == []


def test_logit_confidence_is_exp_mean_response_logprob():
    model = _tiny_model()
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]]
    got = confidence.logit_confidence(model, prompts, responses, pad_id=0, batch_size=1)
    for p, r, c in zip(prompts, responses, got):
        ids = torch.tensor([p + r])
        logp = model(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
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
    with pytest.raises(ValueError, match="needs a probe"):
        confidence.sample_confidences("probe", model, _Tok(), prompts, responses, ["", ""], ["1", "1"])


def test_split_groups_keeps_problems_whole():
    groups = torch.tensor([q for q in range(10) for _ in range(3)])
    tr, va = confidence.split_groups(groups, seed=1)
    assert int(va.sum()) == 6 and not set(groups[tr].tolist()) & set(groups[va].tolist())


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
    prb, rep = confidence.fit_posthoc(x, y, groups, grid=grid, max_epochs=30, patience=5)
    assert rep["n_train"] + rep["n_val"] == 400 and rep["n_val"] == 80
    assert rep["lr"] in (1e-2, 1e-3) and prb.hidden == 2
    assert rep["val_bce"] < rep["base_bce"] - 0.1
    with pytest.raises(ValueError, match="two problems"):
        confidence.fit_posthoc(x[:4], y[:4], groups[:4])
