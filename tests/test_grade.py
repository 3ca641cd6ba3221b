"""grade.py: the strict (released training) grader, the math grader, and the time bound."""
import json
import os
import re
import signal
import threading
import time
from fractions import Fraction

import pytest

import config
from harness import verifier
import grade

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")   # the benchmarks' files
BOUND_S = 10  # wall seconds: the budget is CPU time, which a loaded machine stretches (and WALL_S is 30)


def golds(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return [json.loads(line)["answer"] for line in f]


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{a}{b}}.", r"\frac{a}{b}"),
    (r"\boxed{1} first, then \boxed{2}", "2"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed{ 7 }", "7"),
    (r"\fbox{7}", "7"),
    (r"$\boxed 5$", "5"),
    (r"\boxed{1} and finally \boxed{\frac{1}{2}", None),  # truncated final answer: no answer
    ("no box here", None),
    ("", None),
])
def test_boxed_answer(text, expected):
    assert grade.boxed_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    (r"\boxed{1} then \boxed{ 2 }.", "2"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\boxed{5}}", "5"),              # the last `\boxed{` is the inner one
    (r"\boxed{5} \fbox{6} $\boxed 7$", "5"),  # only `\boxed{` counts
    (r"\boxed{1} \boxed{2", None),            # the last box never closes
    ("\\boxed{" * 3, None),
    ("none", None),
    (None, None),
])
def test_last_boxed(text, expected):
    assert grade.last_boxed(text) == expected


# The released training rule, pair by pair: last `\boxed{` content and gold each stripped, one
# trailing ".0" dropped, leading zeros dropped (after a minus too; "0" stays "0"), equal strings.
STRICT = [
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", False),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", True),
    (r"\boxed{1,000}", "1000", False),
    (r"\boxed{1000}", "1,000", False),
    (r"\boxed{1,000}", "1,000", True),
    (r"\boxed{2.0}", "2", True),
    (r"\boxed{2}", "2.0", True),            # the gold is normalised too
    (r"\boxed{3.0}", "3.0", True),
    (r"\boxed{2.00}", "2", False),          # one ".0" only
    (r"\boxed{2.0.0}", "2", False),
    (r"\boxed{2.50}", "2.5", False),
    (r"\boxed{007}", "7", True),
    (r"\boxed{7}", "007", True),
    (r"\boxed{-007}", "-7", True),
    (r"\boxed{ -007.0 }", "-7", True),
    (r"\boxed{+7}", "7", False),
    (r"\boxed{-0}", "0", False),
    (r"\boxed{00}", "0", True),
    (r"\boxed{0.0}", "0", True),
    (r"\boxed{00.5}", "0.5", True),
    # every leading zero goes, "0" where nothing is left (released normalize_answer; wrong at 33d36b1)
    (r"\boxed{.5}", "0.5", True),
    (r"\boxed{0.5}", ".5", True),
    (r"\boxed{-.5}", "-0.5", True),
    (r"\boxed{.0}", "0", True),
    (r"\boxed{}", "0", True),              # an empty box is "0": a released quirk
    (r"\boxed{ }", "0", True),
    (r"\boxed{1} then \boxed{2}", "2", True),   # a second box after the first
    (r"\boxed{1} then \boxed{2}", "1", False),
    (r"\boxed{1} then \boxed{2", "2", False),   # an unclosed last box is wrong
    (r"\boxed{1} then \boxed{2", "1", False),
    (r"\boxed{ 42 }", " 42\n", True),
    ("\\boxed{\n7\n}.", "7", True),
    (r"\boxed{(1, 2)}", "(1,2)", False),   # inner spaces are not stripped
    (r"\boxed{x+1}", "1+x", False),
    (r"\boxed{\frac{1}{2}}", "0.5", False),
    (r"\boxed{Evelyn}", r"\text{Evelyn}", False),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"\boxed{\{1,2\}}", r"\{1,2\}", True),
    (r"\boxed{\boxed{5}}", "5", True),
    (r"\fbox{7}", "7", False),
    (r"$\boxed 7$", "7", False),
    (r"\boxed{10}", "1", False),
    ("the answer is 7", "7", False),
]


@pytest.mark.parametrize("text, gold, ok", STRICT)
def test_strict_grader_is_the_released_rule(text, gold, ok):
    assert grade.is_correct(text, gold, "strict") is ok


def test_strict_form():
    assert [grade.strict_form(s) for s in (" -007.0 ", "0", "00", "0.5", "00.5", "-0", "10.00", "0x", "", "-")] == \
        ["-7", "0", "0", ".5", ".5", "-0", "10.00", "x", "0", "-0"]


@pytest.mark.parametrize("text, gold, ok", [
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{ 1,000 }", "1000", True),
    (r"\boxed{x+1}", "1+x", True),
    (r"\boxed{25}", "025", True),             # AIME
    (r"\boxed{27}", "27.0", True),            # AMC
    (r"\boxed{\dfrac{14}{3}}", r"\frac{14}{3}", True),
    (r"\boxed{(3, \pi/2)}", r"\left( 3, \frac{\pi}{2} \right)", True),
    (r"\boxed{Evelyn}", r"\text{Evelyn}", True),
    (r"\boxed{B}", "B", True),
    (r"\boxed{41}", "42", False),
    (r"\boxed{(2,5)}", "[2,5)", False),
    (r"\boxed{C}", "B", False),
    ("the answer is 42", "42", False),
    (r"\boxed{42", "42", False),
    (r"\boxed{}", "42", False),
    (r"\boxed{42} no wait \boxed{41}", "42", False),
])
def test_math_grader(text, gold, ok):
    assert grade.is_correct(text, gold) is ok
    assert grade.is_correct(text, gold, "math") is ok


def test_a_sum_of_integers_is_graded_by_its_value_without_math_verify(monkeypatch):
    # the legible toy world's forced answers ("15+2"): thousands of them per RL step, so no parser
    monkeypatch.setattr(grade, "_math_verify", lambda *a: pytest.fail("math-verify called"))
    cases = [("15+2", "17", True), ("15-3", "12", True), ("9-3+5-2", "9", True), ("15+2", "18", False),
             ("-4+1", "-3", True), ("3+5+7+2", "17.0", True)]
    assert [grade.answers_match(p, g, "math") for p, g, _ in cases] == [ok for _, _, ok in cases]
    assert grade.integer_sum("15+2") == 17 and grade.integer_sum("15") is None   # a plain number is not a sum
    assert grade.integer_sum("1+") is None and grade.integer_sum("2*3") is None and grade.integer_sum("1.5+1") is None
    assert not grade.answers_match("15+2", "17", "strict")   # the released training reward compares forms


@pytest.mark.parametrize("text, gold, ok", [
    (r"\boxed{A) 3.5 eV}", "A", True),       # the option as listed (data._choices): wrong at 33d36b1
    (r"\boxed{Option A}", "A", True),        # wrong at 33d36b1
    (r"\boxed{\text{Option C}}", "C", True),
    (r"\boxed{the answer is (b)}", "B", True),
    (r"\boxed{Answer: D.}", "D", True),
    (r"\boxed{A) 3.5 eV}", "B", False),
    (r"\boxed{Option A}", "C", False),
    (r"\boxed{B}", "B", True),
    (r"\boxed{C}", "B", False),
    (r"\boxed{A) 3}", "3", False),           # only a gold option letter reads the letter
])
def test_gpqa_letter_forms_are_read_as_released(text, gold, ok):
    assert grade.is_correct(text, gold) is ok


def test_gpqa_choice_is_the_released_rule():
    assert [grade.gpqa_choice(s) for s in ("(B) 4 eV", "Option C", "choice: d", "A) 3.5 eV", "B.", "a",
                                           "x is C", "ABC", "", "3.5 eV")] == \
        ["B", "C", "D", "A", "B", "A", "C", None, None, None]
    # GPQA in RLCR's format: the letter in the last <answer> tag
    assert grade.is_correct("<answer>Option C</answer>", "C", form="tag")


def test_graders_disagree_where_the_rules_differ():
    # math reads the last \fbox too, strict only `\boxed{`: here strict is the one that says right
    assert grade.is_correct(r"\boxed{5} \fbox{6}", "5", "strict") and not grade.is_correct(r"\boxed{5} \fbox{6}", "5")


def test_math500_answers_under_both_graders():
    math500 = golds("math500.jsonl")
    assert len(math500) == 500
    for g in math500:  # every gold answer, boxed, is right under both graders
        assert grade.is_correct(r"so $\boxed{" + g + "}$.", g, "strict"), g
        assert grade.is_correct(r"so $\boxed{" + g + "}$.", g, "math"), g

    def count(variant, chosen):
        """(pairs, right under strict, right under math) for `variant(gold)` against each chosen gold."""
        pairs = [(variant(g), g) for g in math500 if chosen(g)]
        return (len(pairs), sum(grade.is_correct(r"\boxed{" + p + "}", g, "strict") for p, g in pairs),
                sum(grade.is_correct(r"\boxed{" + p + "}", g, "math") for p, g in pairs))

    integer = lambda g: re.fullmatch(r"-?\d+", g) is not None  # noqa: E731
    # agreements: the released rule's own normalisations, and wrong integers
    assert count(lambda g: g + ".0", integer) == (311, 311, 311)
    assert count(lambda g: re.sub(r"^(-?)", r"\g<1>00", g), integer) == (311, 311, 311)
    assert count(lambda g: str(int(g) + 1), integer) == (311, 0, 0)
    # disagreements: spelling the strict grader does not forgive
    assert count(lambda g: g.replace("\\frac", "\\dfrac"), lambda g: "\\frac" in g) == (68, 0, 68)
    assert count(lambda g: g.replace(" ", ""), lambda g: " " in g) == (46, 0, 46)
    assert count(lambda g: re.sub(r"\\text\{([^{}]*)\}", r"\1", g), lambda g: "\\text{" in g) == (10, 0, 10)
    assert count(lambda g: g.replace("\\left", "").replace("\\right", ""), lambda g: "\\left" in g) == (4, 0, 4)
    assert count(lambda g: g.replace(",", ""), lambda g: re.fullmatch(r"\d{1,3}(,\d{3})+", g)) == (1, 0, 1)

    # and values math-verify proves equal: a terminating fraction as a decimal, a decimal as a fraction
    def other_form(g):
        value = Fraction(g) if re.fullmatch(r"\d*\.\d+", g) else Fraction(*map(int, re.findall(r"\d+", g)))
        return str(float(value)) if "frac" in g else rf"\frac{{{value.numerator}}}{{{value.denominator}}}"

    def terminating(g):
        m = re.fullmatch(r"\\frac\{(\d+)\}\{(\d+)\}", g)
        return bool(re.fullmatch(r"\d*\.\d+", g)) or bool(m and 10 ** 12 % int(m[2]) == 0)
    assert count(other_form, terminating) == (32, 0, 32)
    assert not grade.is_correct(r"\boxed{1.51}", r"\frac{3}{2}") and not grade.is_correct(r"\boxed{1.5}", r"\frac{3}{2}", "strict")


def test_integer_benchmarks_agree_under_both_graders():
    """AIME 2024 stores "204", AIME 2025 and AMC 2023 store 70.0: the strict rule's ".0" makes both fit."""
    for name in ("aime24.jsonl", "aime25.jsonl", "amc23.jsonl"):
        for gold in map(str, golds(name)):
            n = gold.removesuffix(".0")
            padded = re.sub(r"^(-?)", r"\g<1>0", n)  # -1 -> -01
            for text in (rf"\boxed{{{n}}}", rf"\boxed{{{padded}}}", rf"\boxed{{{n}.0}}"):
                assert grade.is_correct(text, gold, "strict") and grade.is_correct(text, gold, "math"), (text, gold)
            assert not grade.is_correct(rf"\boxed{{{n}0}}", gold, "strict")
            assert not grade.is_correct(rf"\boxed{{{n}0}}", gold, "math")


def test_forced_answers_and_labels_use_the_run_grader(monkeypatch):
    """Y_b: the forced answer ends at the brace that closes the forced box; the grader decides."""
    import label
    assert grade.answers_match(label.forced_answer(" 007}\n"), "7", "strict")
    assert not grade.answers_match(label.forced_answer(r"\dfrac{1}{2}} so"), r"\frac{1}{2}", "strict")
    assert grade.answers_match(label.forced_answer(r"\dfrac{1}{2}} so"), r"\frac{1}{2}", "math")
    texts = ["\\dfrac{1}{2}}\n", "\\frac{1}{2}}", "0.5}", "\\frac{1}{2}"]  # the last one never closes
    monkeypatch.setattr(label, "forced_answers", lambda *a, **k: (texts, None))
    tok = type("Tok", (), dict(eos_token_id=2, encode=lambda self, text, add_special_tokens: [3]))()
    args = (None, tok, [[5]], [[6, 7]], [[1]], [r"\frac{1}{2}"])
    assert label.mc_labels(*args, k=4, close="eos", grader="strict") == [[0.25]]
    assert label.mc_labels(*args, k=4, close="eos", grader="math") == [[0.75]]


def test_grader_flag_defaults_per_world():
    assert config.REAL["grader"] == "strict" and config.TOY["grader"] == "math"
    assert config.resolve_args(["--model", "some/model"])["grader"] == "strict"
    assert config.resolve_args(["--model", "some/model", "--grader", "math"])["grader"] == "math"
    assert config.resolve_args([])["grader"] == "math"


def test_model_text_is_never_executed(tmp_path):
    target = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {target}')"
    for text in (rf"\boxed{{{payload}}}", payload + r" \boxed{" + payload + "}", rf"$\boxed{{{payload}}}$"):
        assert grade.is_correct(text, "0") is False
        assert grade.answers_match(payload, "1+x") is False
    assert not target.exists()


def test_long_answers_are_compared_as_strings():
    long = "+".join(["x"] * 1500)
    start = time.time()
    assert grade.is_correct(r"\boxed{" + long + "}", "1500*x") is False  # over the cap: no parser
    assert grade.is_correct(r"\boxed{" + long + "}", long) is True
    assert time.time() - start < 0.1
    assert grade.plain_number("1" * 3000) is None  # over the cap (and int() refuses > 4300 digits)
    start = time.time()
    assert grade._NUMBER.fullmatch("1" * 200_000 + "x") is None  # the number pattern is linear
    assert time.time() - start < 0.1


HOSTILE = {  # name -> (response text, gold)
    "64,000 digits then x": ("\\boxed{" + "1" * 64_000 + "x}", "5"),
    "1,000,000 characters": ("\\boxed{" + "x+" * 500_000 + "}", "5"),
    "1,000,000 characters, no box": ("7 " * 500_000, "7"),
    "10,000 nested braces": ("\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}", "1"),
    "10,000 unclosed braces": ("\\boxed{" + "{" * 10_000 + "1", "1"),
    "100,000 unclosed \\boxed{": ("\\boxed{" * 100_000, "5"),
    "9^{99999999}": (r"\boxed{9^{99999999}}", "5"),
    "power tower": (r"\boxed{9^{9^{9^{9^{9}}}}}", "5"),
    "1000000!": (r"\boxed{1000000!}", "5"),
}


def grade_all(times):
    """Grade every hostile case under both graders, recording (result, seconds) per case."""
    for name, (text, gold) in HOSTILE.items():
        for grader in grade.GRADERS:
            start = time.monotonic()
            ok = grade.is_correct(text, gold, grader)
            times[name, grader] = ok, time.monotonic() - start


def test_hostile_inputs_return_wrong_within_the_bound_in_any_thread():
    assert grade.is_correct(r"\boxed{x+1}", "1+x")  # a warm worker: its start is not in the bound
    in_main, in_thread = {}, {}
    grade_all(in_main)
    worker = threading.Thread(target=grade_all, args=(in_thread,))
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    for times in (in_main, in_thread):
        assert set(times) == {(n, g) for n in HOSTILE for g in grade.GRADERS}
        for (name, grader), (ok, seconds) in times.items():
            assert ok is False, (name, grader)
            assert seconds < BOUND_S, (name, grader, seconds)
    # and grading still works afterwards, in both threads
    results = []
    worker = threading.Thread(target=lambda: results.append(grade.is_correct(r"\boxed{x+2}", "2+x")))
    worker.start()
    worker.join(30)
    assert results == [True] and grade.is_correct(r"\boxed{\frac{1}{2}}", "0.5")


def test_a_worker_that_overruns_is_killed_and_replaced(monkeypatch):
    """The timer inside the worker is the first stop; where it cannot act (a long C call), the
    parent kills the worker once it has used its CPU budget. Simulated by giving the worker 30 s."""
    assert grade.is_correct(r"\boxed{x+1}", "1+x")  # a warm worker
    procs = [w.proc for w in verifier._idle]
    ask, seen = verifier._Worker.ask, {}

    def ask_30(self, pred, gold, seconds):
        start = self.cpu_s()
        seen["ok"] = ask(self, pred, gold, seconds, timer=30)
        seen["cpu_s"] = self.cpu_s() - start
        return seen["ok"]
    monkeypatch.setattr(verifier._Worker, "ask", ask_30)
    assert grade.is_correct(r"\boxed{9^{99999999}}", "5") is False
    assert seen["ok"] is None and seen["cpu_s"] < grade.GRADE_TIMEOUT_S + verifier.REPLY_S + 0.25
    assert any(p.returncode is not None for p in procs)  # killed
    assert any(w.proc not in procs and w.proc.poll() is None for w in verifier._idle)  # a replacement starts


def test_a_grade_does_not_depend_on_the_load():
    """The budget is the worker's CPU time: a worker paused for longer than GRADE_TIMEOUT_S during a
    comparison (a process descheduled on a busy machine) gives the idle call's grade."""
    pair = (r"\sin^2 x+\cos^2 x", "1")
    assert grade.answers_match(*pair)  # idle, and the worker is warm
    pid = verifier._idle[-1].proc.pid  # the ready worker the next call takes
    os.kill(pid, signal.SIGSTOP)
    threading.Timer(grade.GRADE_TIMEOUT_S + 0.2, os.kill, (pid, signal.SIGCONT)).start()
    assert grade.answers_match(*pair)


def test_a_grade_does_not_depend_on_what_was_graded_before(monkeypatch):
    """Parsing is most of a comparison's time. Near the budget (here 70% of what a like comparison took),
    the same pair graded again, or after another pair with the same gold, gets the same grade."""
    def terms(name, order):  # x_{1}+x_{2}+...: math-verify parses each sum in about 0.2 s here
        return "+".join(f"{name}_{{{i}}}" for i in order)
    up, down, odd_first = range(1, 25), range(24, 0, -1), [*range(1, 25, 2), *range(2, 25, 2)]
    ask, used = verifier._Worker.ask, []

    def measured(self, *args, **kwargs):
        start = self.cpu_s()
        ok = ask(self, *args, **kwargs)
        used.append(self.cpu_s() - start)
        return ok
    monkeypatch.setattr(verifier._Worker, "ask", measured)
    monkeypatch.setattr(grade, "GRADE_TIMEOUT_S", 30)
    assert grade.answers_match(terms("y", up), terms("y", down))
    monkeypatch.setattr(grade, "GRADE_TIMEOUT_S", 0.7 * used[-1])
    gold = terms("x", down)
    verdicts = [grade.answers_match(terms("x", order), gold) for order in (up, up, odd_first, up)]
    assert verdicts == [False] * 4, used


def test_no_verdict_in_wall_time_is_graded_wrong_with_a_warning(monkeypatch, capsys):
    assert grade.answers_match("x+1", "1+x")  # a warm worker
    monkeypatch.setattr(verifier, "WALL_S", 0.5)
    os.kill(verifier._idle[-1].proc.pid, signal.SIGSTOP)  # stopped for good: the call kills it
    assert grade.answers_match(r"\sin^2 x+\cos^2 x", "1") is False
    assert "no verdict in 0.5 s of wall time" in capsys.readouterr().err


def test_a_late_worker_start_is_waited_for(monkeypatch, capsys):
    """A start past START_TIMEOUT_S (a loaded host, a suspended job) is waited for: math-verify stays on.
    Here the limit is 2 s and the new worker is stopped for 3 s."""
    monkeypatch.setattr(verifier, "_idle", [])
    monkeypatch.setattr(verifier, "_unavailable", [])
    monkeypatch.setattr(verifier, "START_TIMEOUT_S", 2)
    verifier.start()
    pid = verifier._idle[-1].proc.pid
    os.kill(pid, signal.SIGSTOP)
    threading.Timer(3, os.kill, (pid, signal.SIGCONT)).start()
    try:
        assert grade.answers_match(r"\sin^2 x+\cos^2 x", "1")
        assert grade.answers_match(r"\frac{1}{2}", "x/(2x)")  # and afterwards
    finally:
        verifier._stop_workers()
    assert "not ready after 2 s" in capsys.readouterr().err


def test_without_a_worker_math_verify_is_skipped_with_one_warning(monkeypatch, capsys):
    monkeypatch.setattr(verifier, "_idle", [])
    monkeypatch.setattr(verifier, "_unavailable", [])
    monkeypatch.setattr(verifier.sys, "executable", "/nonexistent/python")
    assert grade.is_correct(r"\boxed{\frac{1}{2}}", "0.5") is False
    assert grade.is_correct(r"\boxed{x+1}", "1+x") is False
    assert grade.is_correct(r"\boxed{025}", "25") and grade.is_correct(r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}")
    err = capsys.readouterr().err
    assert err.count("math-verify worker did not start") == 1 and "FileNotFoundError" in err


# RLCR's released reward (rlcr.compute_score): the last <answer> tag and the gold in Minerva's normal form.
MINERVA = [
    ("<answer> \\boxed{17} </answer>", "17", True, "17"),
    ("<answer>$17$</answer>", "17", True, "17"),
    ("<answer>x = 5</answer>", "5", True, "5"),
    ("<answer>5 degrees</answer>", "5", True, "5"),
    ("<answer>10,000</answer>", "10000", True, "10000"),
    ("<answer>\\frac12</answer>", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("<answer>\\text{(B)}</answer>", "(B)", True, "(B)"),
    ("<answer>017</answer>", "17", False, "017"),          # the strict rule drops the zero: right there
    ("<answer>2.0</answer>", "2", False, "2.0"),           # and the ".0"
    ("<answer>1,5</answer>", "15", True, "15"),            # every comma of a digit string goes, as released
    ("no tag, \\boxed{17}", "17", False, None),            # no <answer> tag: no answer
]


@pytest.mark.parametrize("text, gold, right, form", MINERVA)
def test_minerva_grader_is_the_released_rlcr_rule(text, gold, right, form):
    answer = grade.answer_tag(text)
    assert (grade.minerva_form(answer) if answer is not None else None) == form
    assert grade.is_correct(text, gold, "minerva", form="tag") is right
    # the strict box rule that graded RLCR before: right only on 017 and 2.0
    strict = grade.is_correct(text, gold, "strict", form="tag")
    assert strict is (text in ("<answer>017</answer>", "<answer>2.0</answer>"))


def test_rlcr_trains_with_the_minerva_grader_by_default(tmp_path):
    assert config.resolve_args(["--reward", "rlcr", "--out", str(tmp_path / "a")])["grader"] == "minerva"
    assert config.resolve_args(["--reward", "rlcm", "--out", str(tmp_path / "b")])["grader"] == "math"
    assert config.resolve_args(["--reward", "rlcr", "--grader", "strict", "--out", str(tmp_path / "c")])["grader"] \
        == "strict"


@pytest.mark.parametrize("text, boxed", [
    ("3+5=8\n</think>\\boxed{8}", False),                   # R1's habit: the box only after </think>
    ("3+5=8 so \\boxed{8}\n</think>The answer is \\boxed{8}", True),
    ("no close tag, \\boxed{8}", True),                     # no </think>: the whole text is thinking
    ("\\boxed{8</think>}", False),                          # a box cut by the end of thinking never closes
    # the released gate is last_boxed_only_string: `\\boxed{` only, and the last one must close
    ("so \\fbox{8}</think>\\boxed{8}", False),
    ("so $\\boxed 8$</think>\\boxed{8}", False),
    ("\\boxed{8} then \\boxed{9</think>", False),
])
def test_boxed_in_thinking(text, boxed):
    assert grade.boxed_in_thinking(text) is boxed


@pytest.mark.parametrize("answer, gold, right", [
    # GPQA's natural boxed answers as the released strict-box grader reads them (letters=False):
    # Minerva's normal form equal to the letter, or sympy's reading of "(A)"
    ("A", "A", True), ("$A$", "A", True), ("\\text{A}", "A", True), ("x = A", "A", True), ("(A)", "A", True),
    ("a", "A", False), ("\\text{(B)}", "B", False), ("A) 3.5 eV", "A", False), ("B", "A", False),
])
def test_gpqa_natural_letters_are_graded_as_released(answer, gold, right):
    assert grade.answers_match(answer, gold, letters=False) is right
    assert grade.answers_match(answer, gold) is (answer != "B")    # forced and RLCR answers: by the letter


@pytest.mark.parametrize("text, answer", [
    ("<answer>5</answer>", "5"),
    # released (1_obtain --use_rlcr): a blank tag and a `\\boxed{` in the text: graded by the last box
    ("<answer></answer> so \\boxed{5}", "5"),
    ("\\boxed{4} <answer>$ $</answer> \\boxed{5}", "5"),
    ("<answer></answer> so \\boxed{5", None),         # a box that never closes: nothing to grade
    ("<answer></answer> so \\fbox{5}", ""),            # `\\boxed{` only
    ("\\boxed{5}", None),                              # no tag: natural_eval's gate, wrong
])
def test_rlcr_natural_answer_falls_back_to_the_box_on_a_blank_tag(text, answer):
    assert grade.rlcr_answer(text) == answer
    assert grade.answer_tag("<answer></answer> \\boxed{5}") == ""     # training's reward: no fallback
