"""Red team 3's medium and low items outside the sandbox and LoRA (M1-M4, M6, L1-L3, L5, L6, L9,
L10; L7 is in test_hardening_identity.py): each test is built from its reproduction and says how the
code of a7c59f5 failed it."""
import os
import subprocess
import sys

import pytest

import evaluate
from evaluation import benchmarks
from test_hardening import ENV, EVAL_SMALL, ROOT, base_run, one_line, run_copy  # noqa: F401 (fixtures)

EVAL = [*EVAL_SMALL, "--confidence", "logits"]


def script(name, *args, timeout=120):
    """python NAME ARGS in a subprocess; the test fails, not hangs, if it is still running at `timeout`."""
    try:
        return subprocess.run([sys.executable, os.path.join(ROOT, name), *args], env=ENV, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} {' '.join(args)} still running after {timeout} s")


@pytest.mark.slow   # evaluate.py and train.py in subprocesses
@pytest.mark.parametrize("name", ["lock", "samples.jsonl"])
def test_a_fifo_planted_in_an_eval_or_run_folder_is_one_line_not_a_hang(tmp_path, run_copy, name):
    # M6: at a7c59f5 a FIFO named lock blocked os.read, one named samples.jsonl the open: killed at 120 s.
    out = tmp_path / "e"
    out.mkdir()
    os.mkfifo(out / name)
    p = script("evaluate.py", "--model", "toy", *EVAL, "--out", str(out))
    assert p.returncode != 0 and p.stderr.strip().splitlines()[-1] == (
        f"evaluate.py: error: {out / name} is not a regular file (a folder, a FIFO or a device in its place): "
        "remove it, and run the command again"), p.stderr[-2000:]
    if name == "lock":
        os.mkfifo(os.path.join(run_copy, "lock"))
        try:
            p = script("train.py", "--resume", run_copy, "--steps", "3")
        finally:
            os.remove(os.path.join(run_copy, "lock"))
        assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(
            f"error: {os.path.join(run_copy, 'lock')} is not a regular file"), p.stderr[-2000:]


def test_a_folder_named_lock_is_one_line_that_says_what_to_do(tmp_path, capsys):
    # L10: at a7c59f5 "evaluate.py: error: [Errno 21] Is a directory: '.../lock'", with no fix.
    (tmp_path / "e" / "lock").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", "toy", *EVAL, "--out", str(tmp_path / "e")])
    assert e.value.code == (f"evaluate.py: error: {tmp_path / 'e' / 'lock'} is not a regular file (a folder, a FIFO "
                            "or a device in its place): remove it, and run the command again")


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


LCB = os.path.join(ROOT, "tests", "fixtures", "lcb.jsonl")
BAD_ROWS = {   # (change to the fixture's first row, the words of the one line); at a7c59f5:
    "deep private": ({"private_test_cases": "[" * 100000 + "]" * 100000}, "private_test_cases is nested too deep"),  # RecursionError
    "deep public": ({"public_test_cases": "[" * 100000 + "]" * 100000}, "public_test_cases is nested too deep"),  # RecursionError
    "private an object": ({"private_test_cases": '{"a": 1}'}, "private_test_cases is dict, not a list of tests"),  # TypeError
    "no testtype": ({"private_test_cases": '[{"input": "1\\n7\\n", "output": "7\\n"}]'}, "test 1 is {\"input\""),  # KeyError at grading
    "a test a list": ({"private_test_cases": '[["1", "2"]]'}, "test 1 is [\"1\", \"2\"], not"),  # TypeError at grading
    "int input": ({"public_test_cases": '[{"input": 5, "output": "5", "testtype": "stdin"}]', "private_test_cases": "[]"},
                  "test 0 is {\"input\": 5"),  # every sample graded wrong, no word
    "int output": ({"private_test_cases": '[{"input": "1", "output": 1, "testtype": "stdin"}]'}, "test 1 is"),
    "no tests": ({"public_test_cases": "[]", "private_test_cases": "[]"}, "it has no tests"),  # L1: at grading
    "mixed": ({"private_test_cases": '[{"input": "1", "output": "1", "testtype": "functional"}]'},
              "it mixes stdin and functional tests"),   # L1: at grading, not naming the problem
    "question null": ({"question_content": None}, "question_content is null, not the problem's text"),  # L3: "Question: None"
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_malformed_lcb_row_is_one_line_naming_its_problem_at_load(tmp_path, case):
    # M3 (C29-C32), L1 (C33), L3 (C37): at a7c59f5 tracebacks at load or at grading, after generation,
    # or a problem graded wrong (or shown as "Question: None") with no word.
    import json
    import data
    change, words = BAD_ROWS[case]
    row = dict(json.loads(open(LCB).readline()), **change)
    path = tmp_path / "lcb.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(data.DataError) as e:
        benchmarks.load_benchmark(f"lcb={path}")
    assert str(e.value).startswith(f"LiveCodeBench problem abc001_a: {words}") and str(e.value).endswith(
        ": fix or drop the row") and "\n" not in str(e.value), str(e.value)


def test_a_one_row_lcb_jsonl_with_decoded_tests_and_metadata_is_that_row(tmp_path):
    # L2 (C36): at a7c59f5 a one-line .jsonl was read as one JSON document, and a row holding one list
    # (its tests) as "a dict holding one list of rows": "has no rows". M3 (C30): metadata an object was a TypeError.
    import json
    first = json.loads(open(LCB).readline())
    row = dict(first, private_test_cases=[{"input": "2\n4 5\n", "output": "9\n", "testtype": "stdin"}],
               metadata={"func_name": None})
    path = tmp_path / "lcb.jsonl"
    path.write_text(json.dumps(row) + "\n")
    name, rows, _ = benchmarks.load_benchmark(f"lcb={path}")
    assert name == "lcb" and len(rows) == 1
    gold = json.loads(rows[0]["answer"])
    assert gold == {"tests": json.loads(first["public_test_cases"]) + row["private_test_cases"], "fn_name": None}


def test_a_checkpoint_pruned_while_it_loads_is_one_line(tmp_path, monkeypatch):
    # L5 (C63): at a7c59f5 safetensors' "unable to open file <...> in read-only mode" (a RuntimeError)
    # came out bare, a traceback in evaluate.py, when the run pruned the checkpoint mid-load.
    import shutil
    import toy_warm
    import transformers
    from harness import models
    from harness.files import UserError
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    shutil.copytree(toy_warm.base_model(), ckpt)

    def pruned(path, **kw):
        shutil.rmtree(ckpt)
        raise RuntimeError(f"unable to open file <{path}/model.safetensors> in read-only mode: No such file")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", pruned)
    with pytest.raises(UserError, match=f"^cannot load model '{tmp_path / 'run'}': its checkpoint {ckpt} was "
                                        "removed while loading"):
        models.load_model(str(tmp_path / "run"))


def test_an_edited_reward_fn_file_is_a_change_on_resume(tmp_path):
    # L6 (C51): at a7c59f5 only the path was saved: a resume went on with the edited function, no word,
    # and reproduce.py called the run "trained already".
    import json
    import config
    from harness import rewardfn, runfolder
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
    assert runfolder.changes(saved, now) == [("reward_fn_sha256", before, after)]


def test_results_say_how_many_samples_an_earlier_command_drew(tmp_path):
    # L9 (C65): at a7c59f5 results.json did not say that an evaluation was resumed after a cut.
    out = tmp_path / "e"
    evaluate.main(["--model", "toy", *EVAL, "--out", str(out)])
    path = out / "samples.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2   # 2 questions x 1 sample
    path.write_text(lines[0] + "\n")   # as a cut after the first batch leaves it
    res = evaluate.main(["--model", "toy", *EVAL, "--out", str(out)])["toy"]
    assert res["settings"]["toy"]["samples_earlier"] == 1 and res["benchmarks"]["toy"]["n"] == 2


def test_a_zlib_bomb_in_private_tests_is_refused_before_it_inflates(tmp_path, monkeypatch):
    # M4 (C35): at a7c59f5 zlib.decompress had no bound (1.4 MB row -> 2.06 GB). Here the bound is
    # lowered to 1 MB so that the original code, which inflates 4 MB, fails in a moment.
    import base64
    import json
    import resource
    import zlib
    import data
    from evaluation import lcb
    monkeypatch.setattr(lcb, "LIMIT", 1 << 20, raising=False)   # raising=False: a7c59f5 had no bound
    z = zlib.compressobj(9)
    blob = base64.b64encode(b"".join([z.compress(b"\0" * (1 << 22)), z.flush()])).decode()
    row = dict(json.loads(open(LCB).readline()), private_test_cases=blob)
    path = tmp_path / "lcb.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(data.DataError, match="^LiveCodeBench problem abc001_a: private_test_cases inflates to more "
                                             "than 1 MB \\(a zlib bomb\\?\\): fix or drop the row$"):
        benchmarks.load_benchmark(f"lcb={path}")
    # the real bound (1 GiB) on the red team's 1.4 MB row: refused without holding what it inflates to
    monkeypatch.setattr(lcb, "LIMIT", 1 << 30)
    z = zlib.compressobj(9)
    blob = base64.b64encode(b"".join([z.compress(b"\0" * (1 << 24)) for _ in range(65)] + [z.flush()])).decode()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(lcb.RowError, match="inflates to more than 1024 MB"):
        lcb.tests_of(dict(row, private_test_cases=blob))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024   # kB: under 200 MB more
