"""--reward-fn FILE.py:NAME (harness/rewardfn.py): loading, the value check, skipping, the forced
answers' labels, two toy steps with it, and the one-line stops that leave nothing behind."""
import json
import math
import os

import pytest
import torch

import grpo
import label
import baselines
import tiny
import train
import config
from harness import rewardfn
from harness.files import UserError
from runs import one_line

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "reward_fn.py")
SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "40", "--eval-every", "0",
         "--gen-batch", "64"]
CHECKED = ["--eval-n", "8", "--save-every", "0"]  # a held-out check at the start and the end, one checkpoint


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def write(tmp_path, text, name="fn.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("body, spec_end, says", [
    ("def f(:\n", ":f", "importing"),                          # a syntax error
    ("raise ImportError('no such lib')\n", ":f", "ImportError: no such lib"),
    ("import sys\nsys.exit(1)\n", ":f", "SystemExit"),        # must not end the run silently
    ("def f(r, a, row):\n    return 1.0\n", ":g", "has no function g"),
    ("f = 3\n", ":f", "has no function f (f is a int)"),
    ("def f(r, a, row):\n    return 1.0\n", "", "give FILE.py:NAME"),
])
def test_a_file_that_does_not_give_a_function_is_one_line(tmp_path, body, spec_end, says):
    spec = write(tmp_path, body) + spec_end
    with pytest.raises(UserError, match="--reward-fn") as e:
        rewardfn.load(spec)
    assert says in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="no file"):
        rewardfn.load(str(tmp_path / "gone" / "fn.py") + ":f")


@pytest.mark.parametrize("value, ok", [(1, 1.0), (0.25, 0.25), (None, None), (0.0, 0.0),
                                       ("yes", None), (True, None), (1.5, None), (-0.1, None),
                                       (float("nan"), None), (torch.tensor(0.5), None)])
def test_values_are_floats_in_0_1_or_none(tmp_path, value, ok):
    spec = write(tmp_path, "VALUE = None\ndef f(r, a, row):\n    return VALUE\n") + ":f"
    rewardfn.load(spec).__globals__["VALUE"] = value  # what the function returns
    if ok is None and value is not None:
        with pytest.raises(UserError, match="must return a float in \\[0, 1\\] or None"):
            rewardfn.judge(spec, "\\boxed{3}", "3", {"problem": "1+2", "answer": "3"})
    else:
        assert rewardfn.judge(spec, "\\boxed{3}", "3", {"problem": "1+2", "answer": "3"}) == ok


def test_the_fixture_gives_partial_credit():
    spec = FIXTURE + ":partial"
    row = {"problem": "9+8", "answer": "17"}
    assert [rewardfn.judge(spec, r, "17", row) for r in ("a\\boxed{17}", "\\boxed{16}", "\\boxed{9}", "17", "x")] \
        == [1.0, 0.5, 0.0, 1.0, 0.0]


def test_a_skipped_sample_gets_advantage_zero_and_leaves_its_group():
    # group 1: sample 2 skipped, the others' R = 2c - 1 = (1, -1, 1) z-scored among themselves;
    # group 2: scored (1, 1, 1) -> advantages 0 although the skipped one's placeholder is 0
    cfg = dict(reward="grpo", group_size=4, lam=0.1, corner="zero", drop_unanimous=False)
    correct = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    scored = torch.tensor([True, True, False, True, True, True, True, False])
    R, adv, parts = baselines.reward_and_advantages(cfg, correct, torch.zeros(8), [""] * 8, None, scored=scored)
    kept = grpo.group_advantages(torch.tensor([1.0, -1.0, 1.0]), 3)
    assert kept.tolist() == pytest.approx([0.57735, -1.1547, 0.57735], abs=1e-4)
    assert adv.tolist() == pytest.approx([*kept[:2].tolist(), 0.0, kept[2].item(), 0.0, 0.0, 0.0, 0.0])
    assert R.tolist() == [1.0, -1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert parts["skipped"].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    # the unanimous filter reads the scored samples alone: group 2 is all right
    assert baselines.unanimous(correct, 4, scored).tolist() == [False] * 4 + [True] * 4
    assert baselines.unanimous(correct, 4).tolist() == [False] * 8


def test_forced_answers_are_judged_by_the_function(monkeypatch):
    """The function sees the forced answer alone; an unclosed box is 0 without a call; Y_b is the
    mean of the values it gives, None where it skips all K (label.labelled drops that cut)."""
    texts = ["17}\n", "16}", "x}", "17", "x}", "x}", "x}", "x}"]  # cut 1; cut 2
    monkeypatch.setattr(label, "forced_answers", lambda *a: (texts, None))
    seen = []

    def judge(answer, i):
        seen.append((answer, i))
        return None if answer == "x" else rewardfn.judge(FIXTURE + ":partial", answer, "17", {})
    ys = label.mc_labels(None, tiny.tokenizer(), [[5]], [[6, 7, 8]], [[1, 2]], ["17"], k=4, close="eos", judge=judge,
                         decode="dynamic")
    assert ys == [[(1.0 + 0.5 + 0.0) / 3, None]]   # "17" 1, "16" 0.5, "x" skipped, "17" unclosed: 0
    assert seen == [("17", 0), ("16", 0), ("x", 0)] + [("x", 0)] * 4
    assert label.labelled([[1, 2]], ys) == ([[1]], [[0.5]])
    # with features (one row per cut), the dropped cut's row goes with it
    feats = [torch.tensor([[1.0, 2.0], [3.0, 4.0]])]
    cuts, labels, kept = label.labelled([[1, 2]], ys, feats)
    assert (cuts, labels) == ([[1]], [[0.5]]) and kept[0].tolist() == [[1.0, 2.0]]
    assert label.grid(kept).tolist() == [[[1.0, 2.0]]] and label.cut_mask([[1], []]).tolist() == [[True], [False]]


def test_two_steps_with_the_function(tmp_path):
    """Every response and forced answer is judged by the function and its values are the run's
    accuracy: a function that logs its calls and says 0.3 gives accuracy 0.3 at every step and
    held-out check (no built-in grader gives 0.3 on 16 or 8 answers)."""
    calls = tmp_path / "calls.jsonl"
    spec = write(tmp_path, "import json\ndef f(response, answer, row):\n"
                           f"    with open({str(calls)!r}, 'a') as out:\n"
                           "        out.write(json.dumps([response, answer, row]) + '\\n')\n"
                           "    return 0.3\n") + ":f"
    run = str(tmp_path / "run")
    train.main(["--steps", "2", "--out", run, "--reward-fn", spec, *SMALL, *CHECKED])
    logged = lines(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in logged] == [0, 1, 2, 2]
    for r in logged:
        assert r.get("accuracy", r.get("eval_accuracy")) == pytest.approx(0.3)
    steps = [r for r in logged if not r.get("eval")]
    assert all(r["skipped"] == 0 for r in steps)
    assert all(0.2 < r["label_mean"] <= 0.3 + 1e-6 for r in steps)  # an unclosed forced box is 0
    judged = lines(calls)
    assert all(c[2]["answer"] == c[1] and set(c[2]) == {"problem", "answer"} for c in judged)
    natural = [c for c in judged if "\n" in c[0]]   # every toy response has a line: its first sum
    assert len(natural) >= 2 * 16 + 2 * 8            # the rollouts and the held-out checks' responses
    forced = [c[0] for c in judged if "\n" not in c[0]]
    # the forced answer is the sum the path implies, at most 6 single-digit terms ("9+9+9+9+9+9": 11 characters)
    assert len(forced) > 50 and not any("boxed" in a or "}" in a or len(a) > 11 for a in forced)
    assert json.load(open(os.path.join(run, "config.json")))["reward_fn"] == spec


def test_skipped_samples_get_no_labels_and_leave_the_accuracy(tmp_path):
    run = str(tmp_path / "run")
    train.main(["--steps", "1", "--out", run, "--reward-fn", FIXTURE + ":skip_odd", "--log-samples", "32",
                "--eval-n", "0", *SMALL, "--prompts-per-step", "8"])
    step_row = [r for r in lines(os.path.join(run, "metrics.jsonl")) if not r.get("eval")][0]
    samples = lines(os.path.join(run, "samples.jsonl"))
    skipped = [s for s in samples if s["skipped"]]
    assert len(samples) == 32 and len(skipped) == step_row["skipped"] > 0 and step_row["prefixes"] > 0
    assert all(int(s["answer"]) % 2 == 1 and s["budgets"] == [] and s["Y_b"] == [] and s["reward"] == 0
               for s in skipped)
    scored = [s["correct"] for s in samples if not s["skipped"]]
    assert sum(scored) > 0 and step_row["accuracy"] == pytest.approx(sum(scored) / len(scored))


def test_a_bad_value_stops_in_one_line_and_writes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "2", "--out", str(run), "--reward-fn", FIXTURE + ":says_yes", *SMALL, *CHECKED])
    assert e.value.code == 2 and not run.exists()   # the first call is the step-0 held-out check
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --reward-fn") and "returned 'yes' (str)" in err
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "2", "--out", str(run), "--reward-fn", write(tmp_path, "def f(:\n") + ":f", *SMALL, *CHECKED])
    assert e.value.code == 2 and not run.exists()


def test_a_bad_value_mid_run_stops_before_that_step_is_written(tmp_path, capsys):
    """The function turns bad once step 1 is in metrics.jsonl: step 1 and its checkpoint stay,
    nothing of step 2 is written."""
    run = tmp_path / "run"
    metrics = str(run / "metrics.jsonl")
    spec = write(tmp_path, "import os\ndef f(response, answer, row):\n"
                           f"    return 0.5 if os.path.getsize({metrics!r}) == 0 else 2.0\n") + ":f"
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "2", "--out", str(run), "--reward-fn", spec, "--eval-n", "0",
                    *SMALL, "--save-every", "1"])
    assert e.value.code == 2
    assert "returned 2.0 (float)" in capsys.readouterr().err.strip().splitlines()[-1]
    assert [r["step"] for r in lines(metrics)] == [1]
    assert {s["step"] for s in lines(run / "samples.jsonl")} == {1}
    assert sorted(os.listdir(run / "checkpoints")) == ["step_000001"]


def test_never_taken_from_a_saved_config(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    spec = FIXTURE + ":partial"
    saved = config.resolve_args(["--reward-fn", spec, "--out", str(run)])
    (run / "config.json").write_text(json.dumps(saved))
    for flags in (["--resume", str(run)], ["--config", str(run / "config.json"), "--out", str(tmp_path / "b")]):
        with pytest.raises(UserError, match="started with --reward-fn .*never taken from a saved config"):
            config.resolve_args(flags)
        assert config.resolve_args([*flags, "--reward-fn", spec])["reward_fn"] == spec
    assert config.resolve_args(["--out", str(tmp_path / "c")])["reward_fn"] is None


def test_a_step_whose_samples_are_all_skipped_logs_no_probe_numbers():
    """No prefix to fit (every rollout skipped): the probe was not fitted, so its BCE and ECE are nan,
    not a 0.0 that reads as a perfect fit (red team 3, M2)."""
    import probe as probe_lib
    prb = probe_lib.Probe(8, 0)
    cfg = dict(reward="rlcm", corner="zero", probe_passes=2, probe_batch=4)
    fitted = train.fit_probe(prb, probe_lib.make_optimizer(prb, lr=1e-3), torch.zeros(0, 8), torch.zeros(0), cfg, 0)
    stats = train.probe_stats(train.Learner(None, None, None, prb, None, None, None, None), dict(fitted=fitted))
    assert math.isnan(stats["probe_bce"]) and math.isnan(stats["probe_ece"]) and stats["prefixes"] == 0


SMALL_RUN = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "24", "--eval-every", "0",
             "--gen-batch", "64", "--eval-n", "8", "--save-every", "0"]


FN = ("import sys\ndef quits(response, answer, row):\n    sys.exit(0)\nclass Stop(BaseException):\n    pass\n"
      "def stops(response, answer, row):\n    raise Stop('x')\ndef skips(response, answer, row):\n    return None\n")


@pytest.mark.parametrize("name, raised", [("quits", "SystemExit: 0"), ("stops", "Stop: x")])
def test_a_reward_fn_that_exits_or_raises_a_base_exception_is_one_line_exit_2(tmp_path, capsys, name, raised):
    # M1: at a7c59f5 sys.exit(0) in the function ended train.py with exit 0, no word and a half-made
    # folder; a BaseException subclass gave a traceback and exit 1.
    import train
    (tmp_path / "fn.py").write_text(FN)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "2", "--out", str(run), "--reward-fn", f"{tmp_path / 'fn.py'}:{name}", *SMALL_RUN])
    assert e.value.code == 2 and not run.exists()   # its first call is the step-0 held-out check
    line = one_line(capsys)
    assert line.startswith(f"error: --reward-fn {tmp_path / 'fn.py'}:{name} raised {raised} (on response"), line


def test_a_reward_fn_that_skips_everything_reports_nothing_scored_not_zero(tmp_path, capsys):
    # M2: at a7c59f5 "held-out accuracy: 0.000 at the start -> 0.000", and step rows with accuracy 0.0.
    import json
    import math
    import train
    (tmp_path / "fn.py").write_text(FN)
    run = tmp_path / "run"
    train.main(["--steps", "1", "--out", str(run), "--reward-fn", f"{tmp_path / 'fn.py'}:skips", *SMALL_RUN])
    out = capsys.readouterr().out
    assert ("held-out accuracy: nothing scored (--reward-fn skipped every response) at the start -> nothing scored "
            "(--reward-fn skipped every response) at step 1") in out and "accuracy: 0.000" not in out
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    step = [r for r in rows if not r.get("eval")][0]
    assert [math.isnan(r["eval_accuracy"]) for r in rows if r.get("eval")] == [True, True]
    assert step["skipped"] == 16 and math.isnan(step["accuracy"]) and math.isnan(step["probe_bce"])


def test_an_edited_reward_fn_file_is_a_change_on_resume(tmp_path):
    # L6 (C51): at a7c59f5 only the path was saved: a resume went on with the edited function, no word,
    # and reproduce.py called the run "trained already".
    import json
    import config
    from harness import checkpoint, rewardfn
    fn = tmp_path / "fn.py"
    fn.write_text("def f(response, answer, row):\n    return 1.0\n")
    run = tmp_path / "run"
    run.mkdir()
    saved = json.loads(json.dumps(config.resolve_args(["--reward-fn", f"{fn}:f", "--out", str(run)])))  # as saved
    (run / "config.json").write_text(json.dumps(saved))
    fn.write_text("def f(response, answer, row):\n    return 0.0\n")
    rewardfn.load.cache_clear()
    now = config.resolve_args(["--resume", str(run), "--reward-fn", f"{fn}:f"])
    import hashlib
    before = hashlib.sha256(b"def f(response, answer, row):\n    return 1.0\n").hexdigest()
    after = hashlib.sha256(b"def f(response, answer, row):\n    return 0.0\n").hexdigest()
    assert checkpoint.changes(saved, now) == [("reward_fn_sha256", before, after)]
