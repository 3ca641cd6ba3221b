"""The toy world: tokenizer mechanics, task, committed base policy, and forced-answer labels that
carry signal, all through the same rollout / data / label code as the real model. CPU, offline."""
import collections
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import config
from harness.checkpoint import resolve_model
from evaluation import confidence
import grade
import label
from test_label import forced_prompt
import data
import rollout
import toy

TEXTS = ["3+5=8\n8+7=15\n15+2=17\n</think>\\boxed{17}", toy.SUFFIX, "<think>\n9+9=18\n</think>",
         "  two  spaces, tab\tand é∑ unicode\n\n"]


@pytest.fixture(scope="module")
def tok():
    return toy.tokenizer()


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_tokenizer_round_trips_and_forced_suffix_is_two_tokens(tok):
    for text in TEXTS:
        assert tok.decode(enc(tok, text)) == text
    assert len(enc(tok, "3+5=8\n")) == 6  # one token per character
    suffix = enc(tok, toy.SUFFIX)
    assert len(suffix) == 2 and tok.decode(suffix) == toy.SUFFIX == label.SUFFIX
    think, close, boxed = (enc(tok, t) for t in ("<think>", "</think>", "\\boxed{"))
    assert len(think) == len(close) == len(boxed) == 1
    # </think> is not special (kept when skipping specials, like R1); EOS is.
    ids = enc(tok, "1</think>2") + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "1</think>2"
    assert tok.decode(ids) == "1</think>2<|eos|>"
    assert enc(tok, "7") == tok("7")["input_ids"]  # encode adds no BOS (R1 under transformers 5)


def test_chat_prompt_has_one_bos_and_ends_inside_the_thinking(tok):
    ids = data.chat_prompt(tok, "3+5+7", toy.INSTRUCTION)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "<|bos|><|user|>3+5+7<|assistant|><think>\n"


def test_forced_prompt_layout(tok):
    prompt = data.chat_prompt(tok, "3+5+7", toy.INSTRUCTION)
    response = enc(tok, "3+5=8\n8+7=15\n</think>\\boxed{15}") + [tok.eos_token_id]
    head = "<|bos|><|user|>3+5+7<|assistant|><think>\n"
    think = forced_prompt(prompt, response, 6, tok)
    assert tok.decode(think) == head + "3+5=8\n</think>" + toy.SUFFIX
    assert tok.decode(forced_prompt(prompt, response, 8, tok, close="eos")) == \
        head + "3+5=8\n8+<|eos|>" + toy.SUFFIX


def test_warm_start_examples_use_the_inference_layout(tok):
    # Training sequences must look exactly like rollouts and mc_labels' forced prompts.
    rng = random.Random(1)
    prompt = data.chat_prompt(tok, "3+5+7+2", toy.INSTRUCTION)
    ids, mask = toy.example(tok, "3+5+7+2", rng, forced=False)
    assert ids[:len(prompt)] == prompt and ids[-1] == tok.eos_token_id
    assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    for _ in range(20):
        ids, mask = toy.example(tok, "3+5+7+2", rng, forced=True)
        answer = tok.decode(ids).rsplit("\\boxed{", 1)[1]
        implied = answer[:-2]   # the sum the path implies ("14+2"), or its last total
        assert answer.endswith("}\n") and 0 <= (int(implied) if implied.isdigit() else grade.integer_sum(implied)) <= 40
        heads = [forced_prompt(prompt, r, b, tok, close) for close in ("think", "eos")
                 for r in [ids[len(prompt):]] for b in range(1, len(r))]
        assert any(ids[:len(h)] == h and len(ids) - len(h) == len(answer) for h in heads)
        assert mask[-len(answer):] == [toy.WARM["w_forced"]] * len(answer)


def test_rlcr_examples_carry_the_instruction_the_tags_and_a_random_confidence(tok):
    # The RLCR prompt picks the format; the confidence is drawn whatever the trace (no calibration).
    rng, seen = random.Random(3), collections.Counter()
    prompt = data.chat_prompt(tok, "5+5+5+5+5", toy.RLCR_INSTRUCTION)
    for _ in range(2000):   # two carries: about a quarter of the traces are right
        ids, mask = toy.example(tok, "5+5+5+5+5", rng, forced=False)
        if ids[:len(prompt)] != prompt:
            assert "<answer>" not in tok.decode(ids)   # the plain prompt keeps the box
            continue
        text = tok.decode(ids[len(prompt):], skip_special_tokens=True)
        think, tail = text.split("</think>")
        total = think.split("=")[-1].strip().rstrip("?")   # a noticed slip's `?` is not part of the total
        ok = int(total) == 25
        assert grade.answer_tag(text) == total and "\\boxed" not in text
        conf, missing = confidence.verbal_confidence(text)
        assert not missing and conf in [float(c) for c in toy.CONFIDENCES]
        seen[ok, conf] += 1
        assert len(ids) - len(prompt) <= config.TOY["max_new_tokens"]   # fits the rollout budget
    n = sum(seen.values())
    assert 0.1 * 2000 < n < 0.3 * 2000   # p_rlcr of the plain examples
    for ok in (True, False):   # right and wrong traces alike draw every confidence
        assert {c for (o, c) in seen if o == ok} == {float(c) for c in toy.CONFIDENCES}
    assert len(tok) <= toy.MODEL["vocab_size"] and len(enc(tok, "<answer>1</answer>")) == 3


def test_saved_tokenizer_is_the_same_after_autotokenizer(tok, tmp_path):
    # AutoTokenizer rebuilds any qwen2 checkpoint's tokenizer as Qwen2Tokenizer (byte-level
    # pre-tokenizer): a plain character vocabulary would silently lose "\n" on reload.
    toy.build_model(tok).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert enc(loaded, text) == enc(tok, text) and loaded.decode(enc(loaded, text)) == text
    assert data.chat_prompt(loaded, "4+4+4") == data.chat_prompt(tok, "4+4+4")
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 0)


def test_dataset_is_deterministic_disjoint_and_graded_right():
    train, test = toy.dataset("train"), toy.dataset("test")
    assert test == toy.dataset("test") and len(test) == toy.N_TEST and len(train) == toy.N_TRAIN
    assert toy.N_TEST >= 500  # the held-out check: standard error <= 0.022 at any accuracy
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    for row in train[:500] + test:
        terms = [int(t) for t in row["problem"].split("+")]
        assert 4 <= len(terms) <= 6 and all(1 <= t <= 9 for t in terms)
        assert row["answer"] == str(sum(terms))
    assert {len(r["problem"].split("+")) for r in test} == {4, 5, 6}


def test_trace_slips_go_on_from_the_written_total():
    rng = random.Random(0)
    # every total slips at p 1: off by 1 or 2 from the previous (wrong) total plus the term
    always = dict(toy.WARM, p_slip=1.0, p_slip_carry=1.0, p_flag_wrong=0.0)
    for _ in range(20):
        lines, totals = toy.trace([3, 5, 7, 2], rng, always)
        steps = [t - prev - term for prev, term, t in zip(totals, [5, 7, 2], totals[1:])]
        assert all(abs(d) in (1, 2) for d in steps)
        assert lines == [f"{a}+{b}={c}\n" for a, b, c in zip(totals, [5, 7, 2], totals[1:])]


def test_model_toy_without_its_base_says_how_to_rebuild_it(tmp_path, monkeypatch):
    from harness.files import UserError
    from harness import checkpoint
    assert checkpoint.TOY_DIR == toy.BASE_DIR   # the machinery names the folder without importing toy
    monkeypatch.setattr(checkpoint, "TOY_DIR", str(tmp_path / "toy_base"))
    with pytest.raises(UserError, match=r"toy_base is missing; rebuild it with python toy.py$"):
        resolve_model("toy")


@pytest.fixture(scope="module")
def base():
    path = toy.BASE_DIR
    assert path == toy.BASE_DIR == resolve_model("toy"), "the committed toy_base/ is missing: run `python toy.py`"
    model = AutoModelForCausalLM.from_pretrained(path)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def test_committed_base_model_loads(base, tok):
    model, loaded = base
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    assert 0.7e6 < sum(p.numel() for p in model.parameters()) < 1.0e6
    assert model.config.vocab_size >= len(loaded) == len(tok)
    assert data.chat_prompt(loaded, "1+2+3") == data.chat_prompt(tok, "1+2+3")


@pytest.fixture(scope="module")
def rollouts(base):
    """One sample per test problem (the first 200) at temperature 0.8 (the RL rollout setting)."""
    model, tok = base
    rows = toy.dataset("test")[:200]
    prompts = [data.chat_prompt(tok, r["problem"], toy.INSTRUCTION) for r in rows]
    golds = [r["answer"] for r in rows]
    out = rollout.generate(model, tok, prompts, max_new_tokens=96, temperature=0.8, seed=0)
    correct = [grade.is_correct(t, g) for t, g in zip(out.texts, golds)]
    return prompts, golds, out, correct


def test_base_policy_is_neither_hopeless_nor_perfect(base, rollouts):
    model, tok = base
    prompts, golds, out, correct = rollouts
    assert set(out.finish) == {"eos"}
    acc = sum(correct) / len(correct)
    greedy = rollout.generate(model, tok, prompts, max_new_tokens=96, temperature=0)
    greedy_acc = sum(grade.is_correct(t, g) for t, g in zip(greedy.texts, golds)) / len(golds)
    print(f"\ntoy base policy: sampled accuracy (T=0.8) {acc:.3f}, greedy accuracy {greedy_acc:.3f}")
    assert 0.3 < acc < 0.7
    # The policy can add: greedy decoding avoids the slips that sampling makes, so there is
    # accuracy for RL to gain at the sampling temperature.
    assert greedy_acc >= 0.9


def test_forced_answer_labels_carry_signal(base, rollouts):
    model, tok = base
    prompts, golds, out, correct = rollouts
    budgets = [label.cuts_of(n) for n in out.lengths]
    labels = label.mc_labels(model, tok, prompts, out.ids, budgets, golds, k=4, seed=0)
    flat = [y for ys in labels for y in ys]
    graded = sum(0 < y < 1 for y in flat) / len(flat)
    print(f"\nY_b distribution {sorted(collections.Counter(flat).items())}; in (0,1): {graded:.3f}")
    means = {}
    for j, f in enumerate((0.25, 0.5, 0.75)):
        for ok in (True, False):
            ys = [y[j] for y, c in zip(labels, correct) if c == ok and len(y) == 3]
            means[f, ok] = sum(ys) / len(ys)
            print(f"mean Y at {f:.0%}, trajectories that end {'correct' if ok else 'wrong'}: "
                  f"{means[f, ok]:.3f} (n={len(ys)})")
    # A forced answer copies the path, so it is (nearly) always right or always wrong: the labels say
    # whether the path so far is right, and differ most between right and wrong trajectories late.
    assert len(flat) >= 300 and graded <= 0.05
    assert means[0.25, True] - means[0.25, False] >= 0.2 and means[0.75, True] - means[0.75, False] >= 0.5
