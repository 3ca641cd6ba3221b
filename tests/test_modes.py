"""The --reward modes (baselines.py): worked numbers, the unanimous-group drop, C2GSPG's loss term, the
settings each mode implies, and two toy steps of every mode."""
import json
import math
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from evaluation import confidence
import config
import grade
import grpo
import label
import baselines
import data
import toy
import train

SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "64", "--eval-n", "8",
         "--eval-every", "0", "--gen-batch", "64", "--save-every", "0"]
# what each mode must log per step, beyond the common fields
COMPONENTS = {"rlcm": {"margin"}, "grpo": set(), "final-margin": {"margin"},
              "process-brier": {"brier", "dropped"}, "final-brier": {"brier", "dropped"},
              "rlcr": {"verbal_conf", "verbal_missing", "rlcr_brier"}, "c2gspg": {"seq_conf"}}
NO_LABELS = ("grpo", "rlcr", "c2gspg")


def cfg_for(mode, **kw):
    return {**dict(reward=mode, group_size=4, lam=0.1, corner="zero", drop_unanimous=False), **kw}


@pytest.mark.parametrize("text, conf, missing", [
    ("<answer>7</answer><analysis>ok</analysis><confidence>85</confidence>", 0.85, False),
    ("<answer>7</answer><confidence>0.3</confidence>", 0.3, False),
    ("<answer>7</answer> and no confidence", 0.5, True),
    ("<confidence>0.9</confidence> ... <confidence>20</confidence>", 0.2, False),  # the last tag
])
def test_rlcr_confidence_and_reward(text, conf, missing):
    correct = torch.tensor([1.0, 0.0, 0.0, 0.0])
    texts = [text, "<confidence>1</confidence>", "<confidence>0</confidence>", "none"]
    R, adv, parts = baselines.reward_and_advantages(cfg_for("rlcr"), correct, None, texts, None)
    assert parts["verbal_conf"][0].item() == pytest.approx(conf)
    assert parts["verbal_missing"].tolist() == [float(missing), 0.0, 0.0, 1.0]  # counted per trajectory
    # correct - (correct - conf)^2 with 0/1 correctness: a right answer at 0.85 -> 1 - 0.0225
    assert R.tolist() == pytest.approx([1 - (1 - conf) ** 2, -1.0, 0.0, -0.25])
    assert adv.tolist() == pytest.approx(grpo.group_advantages(R, 4).tolist())


def test_rlcr_grades_the_last_answer_tag_not_the_box():
    assert grade.answer_tag("<answer> 3 </answer> then <answer>17</answer>") == "17"
    assert grade.answer_tag("<answer>17") is None and grade.answer_tag("17</answer>") is None
    assert grade.answer_tag("\\boxed{17}") is None
    texts = ["<answer>17</answer>", "\\boxed{17}", "<answer>16</answer>\\boxed{17}", "<answer>\\frac{34}{2}</answer>"]
    assert baselines.correctness(texts, ["17"] * 4, "math", "rlcr").tolist() == [1.0, 0.0, 0.0, 1.0]
    assert baselines.correctness(texts, ["17"] * 4, "math", "grpo").tolist() == [0.0, 1.0, 1.0, 0.0]


def test_c2gspg_advantages_by_hand():
    # mean r = 0.5; A = (r - 0.5) / (1 - c): 0.5/0.5, -0.5/0.1, -0.5/0.8, 0.5/0.01
    correct = torch.tensor([1.0, 0.0, 0.0, 1.0])
    c = torch.tensor([0.5, 0.9, 0.2, 0.99])
    R, adv, parts = baselines.reward_and_advantages(cfg_for("c2gspg"), correct, None, [""] * 4, c)
    assert adv.tolist() == pytest.approx([1.0, -5.0, -0.625, 50.0], rel=1e-5)
    assert R.tolist() == [1.0, 0.0, 0.0, 1.0] and parts["seq_conf"] is c


def test_c2gspg_advantages():
    adv = baselines.c2gspg_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.5, 0.2, 0.9, 1.0]), 4)
    # mean 0.75 -> centred (0.25, -0.75, 0.25, 0.25), divided by max(1 - c, 1e-6)
    assert adv.tolist() == pytest.approx([0.5, -0.9375, 2.5, 0.25 / 1e-6], rel=1e-4)
    assert baselines.c2gspg_advantages(torch.ones(2), torch.tensor([0.3, 0.6]), 2).tolist() == [0.0, 0.0]
    # two groups of 2, each centred on its own mean (0.5, then 1): (0.5 / 0.5, -0.5 / 0.8, 0, 0); 0/1 ints
    # and a float64 c give float32 advantages
    adv = baselines.c2gspg_advantages([1, 0, 1, 1], torch.tensor([0.5, 0.2, 0.9, 0.5], dtype=torch.float64), 2)
    assert adv.tolist() == pytest.approx([1.0, -0.625, 0.0, 0.0]) and adv.dtype == torch.float32


def test_rlcr_reward():
    correct = torch.tensor([True, False, True])
    conf = torch.tensor([0.8, 0.8, 0.0])
    assert baselines.rlcr_reward(correct, conf).tolist() == pytest.approx([1 - 0.04, -0.64, 0.0])


def test_evaluation_reads_verbal_confidence_with_rlcrs_parser():
    assert confidence.verbal_confidence is baselines.verbal_confidence


def test_process_brier_worked_number():
    C, Y = torch.tensor([[0.9, 0.5, 0.1]]), torch.tensor([[1.0, 0.5, 0.0]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    assert baselines.calibration_term(C, Y, valid, cfg_for("process-brier")).item() == pytest.approx(-0.0067, abs=5e-5)
    assert baselines.calibration_term(C, Y, valid, cfg_for("rlcm")).item() == pytest.approx(0.8)
    # final-margin with budget 1.0: only one side -> +C or -C
    one = torch.ones(1, 1, dtype=torch.bool)
    fm = cfg_for("final-margin", corner="final-margin")
    assert baselines.calibration_term(torch.tensor([[0.2]]), torch.tensor([[0.0]]), one, fm).item() == pytest.approx(-0.2)
    mc = cfg_for("rlcm", corner="margin-corner")   # the released corner rule: 1 - mean C
    assert baselines.calibration_term(torch.tensor([[0.2]]), torch.tensor([[0.0]]), one, mc).item() == pytest.approx(0.8)
    assert baselines.calibration_term(torch.tensor([[0.2]]), torch.tensor([[0.0]]), one, cfg_for("rlcm")).item() == 0.0
    # a padded prefix (valid False, C = Y = 0) counts nowhere: Brier -0.01 / 1 (not / 2); the margin
    # has no unsolvable side, so 0 (not 0.9 - 0)
    C, Y, valid = torch.tensor([[0.9, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[True, False]])
    assert baselines.calibration_term(C, Y, valid, cfg_for("process-brier")).item() == pytest.approx(-0.01)
    assert baselines.calibration_term(C, Y, valid, cfg_for("rlcm")).item() == 0.0


def test_brier_modes_give_unanimous_groups_reward_zero():
    """Group 1 all right, group 2 mixed, group 3 all wrong. As released, the unanimous groups'
    rewards are set to 0, so their advantages are 0 (they stay in the update), although the Brier
    term made their rewards differ; group 2 keeps its rewards and z-scores them."""
    assert baselines.unanimous(torch.tensor([1, 1, 0, 0, 0, 0]), 3).tolist() == [False] * 3 + [True] * 3
    correct = torch.tensor([1.0, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0])
    calib = -torch.linspace(0.0, 0.5, 12)
    signed = 2 * correct - 1 + 0.1 * calib   # lam 0.1, the released (the toy's default is 1)
    for mode in ("process-brier", "final-brier"):
        cfg = config.resolve_args(["--reward", mode, "--group-size", "4", "--lam", "0.1", "--out", "unused"])
        assert cfg["drop_unanimous"] is True
        R, adv, parts = baselines.reward_and_advantages(cfg, correct, calib, [""] * 12, None)
        assert R.tolist() == pytest.approx([0.0] * 4 + signed[4:8].tolist() + [0.0] * 4)
        assert adv[:4].tolist() == [0.0] * 4 and adv[8:].tolist() == [0.0] * 4
        assert adv[4:8].tolist() == pytest.approx(grpo.group_advantages(signed[4:8], 4).tolist())
        assert parts["dropped"].tolist() == [1.0] * 4 + [0.0] * 4 + [1.0] * 4
        assert torch.equal(parts["brier"], calib)
    cfg = config.resolve_args(["--reward", "process-brier", "--no-drop-unanimous", "--group-size", "4", "--lam", "0.1"])
    R, adv, _ = baselines.reward_and_advantages(cfg, correct, calib, [""] * 12, None)
    assert R.tolist() == pytest.approx(signed.tolist()) and (adv[:4] != 0).all()


def test_the_filter_is_off_when_every_group_is_unanimous():
    """Released: with every group of the step unanimous, no group is filtered that step, so the
    Brier term still trains (here: advantages +-0.7071 from -0.1 vs -0.3 in each group of two). Under
    several ranks the step's verdict decides (all_unanimous), not this rank's groups."""
    correct = torch.tensor([1.0, 1, 0, 0])
    calib = torch.tensor([-0.1, -0.3, -0.1, -0.3])
    cfg = cfg_for("final-brier", group_size=2, drop_unanimous=True)
    R, adv, parts = baselines.reward_and_advantages(cfg, correct, calib, [""] * 4, None)
    assert R.tolist() == pytest.approx([0.99, 0.97, -1.01, -1.03])
    assert adv.tolist() == pytest.approx([0.7071, -0.7071, 0.7071, -0.7071], abs=1e-4)  # std of 2: 0.01414
    assert parts["dropped"].tolist() == [0.0] * 4
    R, adv, parts = baselines.reward_and_advantages(cfg, correct, calib, [""] * 4, None, all_unanimous=False)
    assert R.tolist() == [0.0] * 4 and adv.tolist() == [0.0] * 4 and parts["dropped"].tolist() == [1.0] * 4
    mixed = torch.tensor([1.0, 0, 0, 0])
    R, adv, parts = baselines.reward_and_advantages(cfg, mixed, calib, [""] * 4, None, all_unanimous=True)
    assert parts["dropped"].tolist() == [0.0] * 4 and (adv != 0).all()


def tiny_policy():
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32))
    return lm


class Capture:
    def __init__(self, params):
        self.params, self.grads = list(params), None

    def step(self):
        self.grads = [p.grad.clone() if p.grad is not None else None for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


UPD = dict(agg="token-mean", temperature=1.0, chunk_size=8, clip_low=0.2, clip_high=0.2, grad_clip=1e9,
           max_new_tokens=8)
SCHED = type("Sched", (), {"step": lambda self: None})()


def test_c2gspg_bce_forms_on_the_issues_worked_case():
    """Four responses, all right, of 1000, 8000, 7000 and 500 tokens at confidences 0.9, 0.15, 0.2,
    0.95: BCE = -log c = (0.105, 1.897, 1.609, 0.051). The mean over sequences is 0.916; the
    released form, each token carrying its sequence's BCE under the token-mean, weighs the long
    ones: (0.105 * 1000 + 1.897 * 8000 + 1.609 * 7000 + 0.051 * 500) / 16500 = 1.611."""
    lengths, conf = (1000, 8000, 7000, 500), (0.9, 0.15, 0.2, 0.95)
    mask = torch.zeros(4, 8000)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    logp = torch.tensor(conf).log()[:, None] * mask   # exp(mean log-prob) = c
    correct = torch.ones(4)
    rows = [0, 1, 2, 3]
    _, coef, seq = baselines.c2gspg_loss(correct, "seq-mean")
    assert coef == 0.1 and seq(logp, mask, rows).tolist() == pytest.approx([0.105, 1.897, 1.609, 0.051], abs=5e-4)
    assert seq(logp, mask, rows).mean().item() == pytest.approx(0.916, abs=5e-4)
    _, _, tok = baselines.c2gspg_loss(correct, "token-mean")
    assert grpo.aggregate(tok(logp, mask, rows), mask).item() == pytest.approx(1.611, abs=5e-4)


@pytest.mark.parametrize("form", ["off", "seq-mean", "token-mean"])
def test_c2gspg_loss_has_the_confidence_bce_only_with_the_flag(tmp_path, form):
    """With zero advantages only 0.1 * BCE(c_theta, r) can move the policy. The default (off, the
    released run) adds nothing; seq-mean logs the mean BCE of c_theta = exp(mean response log-prob)
    computed here by hand, token-mean the mean weighted by response tokens (3, 2, 4), and both send
    a gradient. Micro-batches [0, 1], [2]: the weights hold across them."""
    assert config.resolve_args(["--reward", "c2gspg", "--out", str(tmp_path)])["c2gspg_bce"] == "off"
    prompts, responses = [[3, 4], [5], [6, 7]], [[9, 10, 1], [11, 1], [12, 13, 14, 1]]
    b = grpo.pack(prompts, responses, 0)
    correct = torch.tensor([1.0, 0.0, 1.0])
    policy = tiny_policy()
    with torch.no_grad():
        logp = grpo.token_logprobs(policy, b["input_ids"], b["attention_mask"])
    n = b["loss_mask"].sum(1).tolist()
    assert n == [3, 2, 4]
    c = [math.exp(sum(logp[i][j].item() for j in range(logp.shape[1]) if b["loss_mask"][i][j]) / n[i])
         for i in range(3)]
    bce = [-(r * math.log(x) + (1 - r) * math.log(1 - x)) for r, x in zip(correct.tolist(), c)]
    opt = Capture(policy.parameters())
    cfg = dict(UPD, reward="c2gspg", c2gspg_bce=form)
    stats = grpo.update(policy, opt, b, None, torch.zeros(3), [[0, 1], [2]], cfg, torch.device("cpu"),
                        baselines.extra_loss(cfg, correct))
    moved = sum(g.abs().sum() for g in opt.grads if g is not None)
    assert stats["loss"] == 0.0
    if form == "off":
        assert "c2gspg_bce" not in stats and moved == 0
        return
    want = sum(bce) / 3 if form == "seq-mean" else sum(x * k for x, k in zip(bce, n)) / sum(n)
    assert stats["c2gspg_bce"] == pytest.approx(want, rel=1e-5) and moved > 0
    cfg = dict(cfg, reward="grpo")   # the flag is c2gspg's alone
    assert baselines.extra_loss(cfg, correct) is None


def test_implied_settings_and_explicit_flags_win(tmp_path):
    r = lambda *a: config.resolve_args([*a, "--out", str(tmp_path / "run")])  # noqa: E731
    assert r()["budgets"] == (0.25, 0.5, 0.75) and r()["drop_unanimous"] is False
    fm = r("--reward", "final-margin")
    assert fm["budgets"] == (1.0,) and fm["corner"] == "final-margin" and fm["drop_unanimous"] is False
    assert r("--reward", "final-margin", "--budgets", "0.5", "--corner", "zero")["budgets"] == (0.5,)
    assert r("--reward", "final-margin", "--corner", "zero")["corner"] == "zero"
    fb = r("--reward", "final-brier")
    assert fb["budgets"] == (1.0,) and fb["drop_unanimous"] is True and fb["corner"] == "zero"
    pb = r("--reward", "process-brier")
    assert pb["budgets"] == (0.25, 0.5, 0.75) and pb["drop_unanimous"] is True
    assert r("--reward", "grpo", "--drop-unanimous")["drop_unanimous"] is True
    assert r("--reward", "rlcr")["instruction"] == toy.RLCR_INSTRUCTION   # the toy's own short RLCR prompt
    real = r("--reward", "rlcr", "--model", "some-org/some-model")
    assert real["instruction"] == data.RLCR_INSTRUCTION and "<confidence>" in real["instruction"]
    assert r("--reward", "rlcr", "--model", "m", "--instruction", " Go.")["instruction"] == " Go."
    assert r("--model", "m")["instruction"] == data.INSTRUCTION


def test_resume_keeps_the_mode_and_what_it_saved(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    saved = config.resolve_args(["--reward", "final-brier", "--budgets", "0.5", "--out", str(run)])
    (run / "config.json").write_text(json.dumps(saved))
    cfg = config.resolve_args(["--resume", str(run)])
    assert cfg["reward"] == "final-brier" and cfg["budgets"] == [0.5] and cfg["drop_unanimous"] is True
    with pytest.raises(config.UserError, match="--reward cannot change on resume"):
        config.resolve_args(["--resume", str(run), "--reward", "rlcm"])


@pytest.mark.parametrize("model, mode", [("toy", "final-brier"), ("toy", "final-margin"), ("toy", "rlcr"),
                                         ("some-org/some-model", "final-brier"),
                                         ("some-org/some-model", "rlcr")])
def test_config_of_another_mode_gives_exactly_the_new_modes_settings(tmp_path, model, mode):
    """--config A --reward rlcm: A's mode-implied settings do not leak (33d36b1: from final-brier,
    budgets [1.0] and the filter on; from rlcr, RLCR's prompt); a flag given now still wins."""
    out = ["--model", model, "--out", str(tmp_path / "run")]
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(config.resolve_args(["--reward", mode, *out])))
    plain = config.resolve_args(["--reward", "rlcm", *out])
    cfg = config.resolve_args(["--config", str(saved), "--reward", "rlcm", *out])
    assert json.loads(json.dumps({**cfg, "config": None})) == json.loads(json.dumps(plain))
    assert list(cfg["budgets"]) == [0.25, 0.5, 0.75] and cfg["drop_unanimous"] is False and cfg["corner"] == "zero"
    assert cfg["instruction"] == ("" if model == "toy" else data.INSTRUCTION)
    given = config.resolve_args(["--config", str(saved), "--reward", "rlcm", "--budgets", "1.0",
                                 "--drop-unanimous", "--corner", "final-margin", "--instruction", " Go.", *out])
    assert (given["budgets"], given["drop_unanimous"], given["corner"], given["instruction"]) == \
        ((1.0,), True, "final-margin", " Go.")


def test_config_keeps_what_neither_mode_implies(tmp_path):
    saved = tmp_path / "config.json"
    out = ["--out", str(tmp_path / "run")]
    saved.write_text(json.dumps(config.resolve_args(["--reward", "final-brier", "--lam", "0.3", *out])))
    cfg = config.resolve_args(["--config", str(saved), "--reward", "process-brier", *out])
    assert cfg["lam"] == 0.3 and cfg["drop_unanimous"] is True and list(cfg["budgets"]) == [0.25, 0.5, 0.75]


def metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"eval": true' not in line]


@pytest.mark.parametrize("mode", list(COMPONENTS))
def test_every_mode_runs_two_toy_steps_and_logs_its_components(tmp_path, monkeypatch, mode):
    calls = []
    real = label.row_generators  # the forced answers' streams: mc_labels samples none without a cut
    monkeypatch.setattr(label, "row_generators", lambda *a, **k: calls.append(1) or real(*a, **k))
    run = str(tmp_path / "run")
    train.main(["--steps", "2", "--out", run, "--reward", mode, *SMALL])
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    others = set().union(*COMPONENTS.values()) - COMPONENTS[mode]
    for row in rows:
        assert COMPONENTS[mode] <= set(row) and not others & set(row), (mode, set(row))
        assert all(math.isfinite(row[k]) for k in COMPONENTS[mode])
    assert (len(calls) == 0) == (mode in NO_LABELS)   # grpo, rlcr, c2gspg never label
    assert json.load(open(os.path.join(run, "config.json")))["reward"] == mode
    if mode == "rlcr":   # the toy base answers in RLCR's tags when the prompt asks: confidences are read
        assert json.load(open(os.path.join(run, "config.json")))["instruction"] == toy.RLCR_INSTRUCTION
        assert all(r["verbal_missing"] <= 2 and 0.2 < r["verbal_conf"] < 0.8 for r in rows), rows
    if mode == "c2gspg":   # the released run: no BCE term
        assert all(0 < r["seq_conf"] < 1 and "c2gspg_bce" not in r for r in rows)
    if mode in ("process-brier", "final-brier"):
        assert all(r["brier"] <= 0 and 0 <= r["dropped"] <= 1 for r in rows)
    held = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if '"eval": true' in line]
    if mode in ("process-brier", "final-brier"):   # the held-out check logs the mode's own calibration term
        assert all(r["eval_brier"] <= 0 and "eval_margin" not in r for r in held)
    elif mode in ("rlcm", "final-margin"):
        assert all("eval_margin" in r and "eval_brier" not in r for r in held)


def test_confidence_formulas_at_their_bounds():
    """C2GSPG's c is clipped below 1 (a sure sequence, logp 0, gives 1 - 1e-6) and averaged over the
    real tokens (one token: its own probability); the BCE clamps c to [1e-6, 1 - 1e-6], so c = 0 with
    r = 1 and c = 1 with r = 0 both cost -log(1e-6) = 13.8155, finite. RLCR keeps float64."""
    c = baselines.sequence_confidence(torch.tensor([[0.0, 0.0], [math.log(0.5), 7.0]]),
                                      torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    assert c.tolist() == pytest.approx([1 - 1e-6, 0.5], abs=1e-7)  # float32: 1 - 1e-6 within 2e-8
    bce = baselines.c2gspg_bce(torch.tensor([0.0, 1.0, 0.0, 1.0]), [1.0, 0.0, 0.0, 1.0])
    assert bce.tolist() == pytest.approx([-math.log(1e-6)] * 2 + [0.0] * 2, abs=0.02)  # float32 1 - 1e-6
    assert baselines.rlcr_reward(torch.tensor([1.0], dtype=torch.float64), [0.5]).dtype == torch.float64
