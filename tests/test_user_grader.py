"""--grader FILE.py:FUNCTION: your own correctness function grades r_nat, the forced answers behind
Y_b and evaluation's accuracy, through grade.py alone; a broken one is one line, exit 2, before any
model loads."""
import json
import os

import pytest

import grade
import train
from runs import SMALL_NO_EVAL, metric_rows, one_line_past_bars as one_line, write


def grader_file(tmp_path, body, name="mine.py"):
    return write(tmp_path / name, body)


BROKEN = {   # the file's text, the function named: the end of the one line
    "no file": (None, "ok", "no file {path}; pass FILE.py:FUNCTION"),
    "no function": ("def other(r, g):\n    return True\n", "ok", "{path} has no function ok; pass FILE.py:FUNCTION"),
    "syntax error": ("def ok(r, g)\n    return True\n", "ok", "importing {path} failed (SyntaxError: "),
    "not a bool": ("def ok(r, g):\n    return 1.0\n", "ok", "returned 1.0 (float) on response '\\\\boxed{1}': "
                   "it must return True or False"),
    "a raise": ("def ok(r, g):\n    raise KeyError(g)\n", "ok", "raised KeyError: '1' (on response"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_grader_is_one_line_naming_the_file_before_any_model_loads(case, tmp_path, capsys,
                                                                            monkeypatch):
    body, fn, words = BROKEN[case]
    path = str(tmp_path / "mine.py") if body is None else grader_file(tmp_path, body)
    grade.user_grader.cache_clear()
    monkeypatch.setattr(train.ckpt_lib, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        train.main(["--grader", f"{path}:{fn}", "--out", str(tmp_path / "run"), "--steps", "1"])
    line = one_line(capsys)
    assert e.value.code == 2 and line.startswith(f"error: --grader {path}:{fn}") and path in line, line
    assert words.replace("{path}", path) in line, line
    assert not os.path.exists(tmp_path / "run")


def test_a_spec_that_is_no_grader_nor_a_file_is_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--grader", "mine.txt"])
    assert e.value.code == 2 and "'mine.txt': must be one of strict, math, minerva or FILE.py:FUNCTION" \
        in capsys.readouterr().err


def test_your_grader_sees_the_whole_response_and_each_forced_answer_boxed(tmp_path):
    path = grader_file(tmp_path, "def ok(response, gold):\n    return response.endswith('7}')\n")
    spec = f"{path}:ok"
    grade.user_grader.cache_clear()
    assert grade.is_correct("so \\boxed{17}", "3", spec) is True           # the gold is its business
    assert grade.is_correct("\\boxed{17} done", "17", spec) is False
    assert grade.answers_match("27", "1", spec) is True                  # a forced answer, boxed
    assert grade.answers_match("2", "2", spec) is False
    assert grade.answers_match(None, "2", spec) is False                 # no answer closed: wrong


def test_a_training_run_grades_rewards_labels_and_the_held_out_check_with_it(tmp_path):
    """A grader that calls every answer right: every response's reward is 1 and every forced answer
    counts, so Y_b is 1 at every cut (the built-in grader gives the toy's first steps about 0.3)."""
    path = grader_file(tmp_path, "def ok(response, gold):\n    return True\n")
    grade.user_grader.cache_clear()
    run = str(tmp_path / "run")
    train.main(["--grader", f"{path}:ok", "--out", run, "--steps", "1", *SMALL_NO_EVAL[:-4],
                "--eval-n", "4", "--gen-batch", "64"])
    rows = metric_rows(run)
    step = next(r for r in rows if not r.get("eval"))
    assert step["accuracy"] == 1.0 and step["label_mean"] == 1.0, step
    assert all(r["eval_accuracy"] == 1.0 for r in rows if r.get("eval"))
    with open(os.path.join(run, "config.json")) as f:
        assert json.load(f)["grader"] == f"{path}:ok"


def test_evaluation_grades_its_accuracy_with_your_grader(tmp_path):
    """evaluate.py --grader: the accuracy (and the forced answers behind its confidences) are your
    function's; the toy base is about 0.6 under the built-in grader, 1.0 under one that says yes."""
    import evaluate
    from runs import EVAL_SMALL
    path = grader_file(tmp_path, "def ok(response, gold):\n    return True\n")
    grade.user_grader.cache_clear()
    out = str(tmp_path / "eval")
    evaluate.main(["--model", "toy", *EVAL_SMALL, "--grader", f"{path}:ok", "--out", out])
    with open(os.path.join(out, "results.json")) as f:
        res = json.load(f)
    (entry,) = res.values() if "toy" not in res else [res["toy"]]
    assert entry["benchmarks"]["toy"]["acc"] == 1.0
    assert entry["settings"]["toy"]["grader"] == f"{path}:ok"


def test_evaluation_refuses_a_broken_grader_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import evaluate
    path = grader_file(tmp_path, "def ok(r, g):\n    return 'yes'\n")
    grade.user_grader.cache_clear()
    monkeypatch.setattr(evaluate.checkpoint, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", "toy", "--grader", f"{path}:ok", "--out", str(tmp_path / "eval")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"--grader {path}:ok returned 'yes' (str)" in err[0], err
