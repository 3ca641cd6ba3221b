"""The OOD benchmarks: LiveCodeBench (graded by running code) and LogiQA from their raw layouts in
tests/fixtures/, the code grader, the post-hoc forced text for code, pass@k and the OOD block."""
import json
import os

import pytest

import data
import evaluate
import grade
import label
import rollout
import tiny
from evaluation import benchmarks, confidence
from evaluation.report import summarize
from runs import write

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LCB = os.path.join(FIXTURES, "lcb.jsonl")
LOGIQA = os.path.join(FIXTURES, "logiqa.jsonl")

SUM_RIGHT = "</think>\n```python\nn = int(input())\nprint(sum(map(int, input().split())))\n```"
SUM_SIX = "</think>\n```python\nprint(6)\n```"   # passes the first two tests, not the third
ADD_RIGHT = "</think>\n```python\nclass Solution:\n    def addTwo(self, a, b):\n        return a + b\n```"
ADD_WRONG = "</think>\n```python\nclass Solution:\n    def addTwo(self, a, b):\n        return a - b\n```"


def test_lcb_rows_from_the_raw_layout_in_the_release_window():
    name, rows, instruction, _ = benchmarks.load_benchmark(f"lcb={LCB}")
    assert (name, len(rows), instruction) == ("lcb", 2, "")      # the 2024-03 contest is outside v4_v5
    stdin, functional = rows
    assert stdin["problem"] == (
        data.LCB_PREAMBLE + "Question: Given N and N integers, print their sum.\n\n" + data.LCB_STDIN
        + "```python\n# YOUR CODE HERE\n```\n\n")
    assert functional["problem"].endswith(
        "Question: Return a + b.\n\n" + data.LCB_STARTER + "```python\nclass Solution:\n"
        "    def addTwo(self, a: int, b: int) -> int:\n        \n```\n\n")
    gold = json.loads(stdin["answer"])
    # one public test, then the two private ones decoded from their base64(zlib(pickle(json))) blob
    assert gold == {"fn_name": None, "tests": [
        {"input": "3\n1 2 3\n", "output": "6\n", "testtype": "stdin"},
        {"input": "2\n10 -4\n", "output": "6\n", "testtype": "stdin"},
        {"input": "1\n7\n", "output": "7\n", "testtype": "stdin"}]}
    assert json.loads(functional["answer"])["fn_name"] == "addTwo"
    assert len(json.loads(functional["answer"])["tests"]) == 2
    assert [r["problem"].split("Question: ")[1][:8] for r in data.load_rows(LCB, like="lcb", lcb_release="v1")] \
        == ["Print 1."]
    assert benchmarks.load_benchmark(f"lcb={LCB}")[3] == os.path.realpath(LCB) + ":v4_v5"
    with pytest.raises(data.DataError, match="--lcb-release 'v5_v4'"):
        data.lcb_window("v5_v4")


def test_the_code_grader_runs_the_last_block_against_every_test():
    stdin, functional = data.load_rows(LCB, like="lcb")
    assert grade.is_correct(SUM_RIGHT, stdin["answer"], grader="code")
    assert not grade.is_correct(SUM_SIX, stdin["answer"], grader="code")        # 2 of 3 tests pass
    assert not grade.is_correct("no code at all", stdin["answer"], grader="code")
    # the last fenced block after the thinking decides, not one inside it
    assert not grade.is_correct(ADD_RIGHT.replace("</think>", "") + "</think>\nso\n```python\nx = 1\n```",
                                functional["answer"], grader="code")
    assert grade.is_correct(ADD_RIGHT, functional["answer"], grader="code")
    assert not grade.is_correct(ADD_WRONG, functional["answer"], grader="code")


def test_logiqa_rows_show_lettered_options_and_grade_like_gpqa():
    name, rows, instruction, _ = benchmarks.load_benchmark(f"logiqa={LOGIQA}")
    assert (name, len(rows), instruction) == ("logiqa", 3, data.LOGIQA_INSTRUCTION)
    assert rows[0] == {"problem": "All cats are animals. Tom is a cat.\n\nWhich must be true?\n\nA. Tom is a dog.\n"
                                  "B. Tom is an animal.\nC. Tom is not an animal.\nD. No cat is Tom.", "answer": "B"}
    assert [r["answer"] for r in rows] == ["B", "C", "A"]
    for box, right in (("B", True), ("(b)", True), ("Option B", True), ("B. Tom is an animal.", True), ("C", False)):
        assert grade.is_correct(f"\\boxed{{{box}}}", "B") is right, box


def test_a_file_named_after_a_known_benchmark_is_read_as_that_benchmark(tmp_path):
    # red team 5, case 5: a bare DIR/gpqa.jsonl was named gpqa but asked without its options, gold "photon"
    gpqa = write(tmp_path / "gpqa.jsonl", json.dumps({"Question": "What carries light?", "Correct Answer": "photon",
                                                      **{f"Incorrect Answer {i}": w for i, w in
                                                         enumerate(("gluon", "W boson", "graviton"), 1)}}))
    bare, named = benchmarks.load_benchmarks([gpqa]), benchmarks.load_benchmarks([f"gpqa={gpqa}"])
    assert bare == named and bare[0][1] == [{"problem": "What carries light?\n\nA) W boson\nB) photon\nC) gluon"
                                                        "\nD) graviton", "answer": "B"}]
    lcb = write(tmp_path / "lcb.jsonl", open(LCB).read())   # LiveCodeBench's release window is in its source
    assert benchmarks.load_benchmarks([lcb]) == benchmarks.load_benchmarks([f"lcb={lcb}"])
    assert benchmarks.load_benchmarks([lcb])[0][3].endswith("lcb.jsonl:v4_v5")
    plain = write(tmp_path / "logiqa.jsonl", json.dumps({"problem": "Which? A. x B. y C. z D. w", "answer": "B"}))
    with pytest.raises(data.DataError, match="LogiQA row with no 'context': a logiqa file needs"):   # was a KeyError
        benchmarks.load_benchmarks([plain])


def test_posthoc_labels_for_code_force_a_program_and_run_it(monkeypatch):
    tok = tiny.tokenizer()
    tok.add_tokens(["</think>"])
    close = tok.convert_tokens_to_ids("</think>")
    gold = data.load_rows(LCB, like="lcb")[1]["answer"]
    asked = {}

    def fake_forced(model, tokenizer, prompts, responses, cut_lists, cuts, tail, k, sampling, *args, progress=None):
        asked.update(prompts=[[*prompts[i], *responses[i][:b], *tail] for i, b in cuts], k=k,
                     tokens=sampling["max_new_tokens"], stop=sampling["stop"])
        return [ADD_RIGHT[len("</think>\n"):], ADD_WRONG[len("</think>\n"):]] * len(cuts), None

    monkeypatch.setattr(label, "forced_answers", fake_forced)
    response = tok.encode("abc", add_special_tokens=False)
    labels, copied = confidence.posthoc_labels(
        None, tok, [[5, 6]], [response], ["abc"], [gold], [[1, 3]], [3],
        dict(k=2, suffix=benchmarks.CODE_SUFFIX, close="think", stop=(), copy_natural=True, seed=0,
             lead=confidence.EVAL_LEAD, gate="thinking", grader="code"))
    # budget 1: half the forced programs pass; budget 3 (the end): the natural answer (no code) copied
    assert (labels, copied) == ([[0.5, 0.0]], 1)
    assert asked["tokens"] == 2048 and asked["k"] == 2 and asked["stop"] == ()   # a program runs on
    assert [list(p) for p in asked["prompts"]] == [[5, 6] + response[:1] + tok.encode("...", add_special_tokens=False) + [close]
                                + tok.encode("\n\nHere is my final Python solution:\n", add_special_tokens=False)]


def test_pass_at_k_per_benchmark():
    rows = [dict(question=q, sample=j, answer=None, correct=int(j < c), confidence=0.5, length=1)
            for q, c in ((0, 1), (1, 0), (2, 4)) for j in range(4)]
    # per question: c/n at k=1; 1 - C(n-c, 2)/C(n, 2) at k=2 (q0: 1 - 3/6); 1 once any is right at k=4
    assert summarize(rows)["pass_at_k"] == pytest.approx({1: (0.25 + 0 + 1) / 3, 2: (0.5 + 0 + 1) / 3,
                                                                     4: (1 + 0 + 1) / 3})
    three = [dict(r, sample=r["sample"]) for r in rows if r["sample"] < 3]
    assert list(summarize(three)["pass_at_k"]) == [1, 2, 3]


def answer_with(monkeypatch, canned):
    """rollout.generate samples as usual, then each prompt's texts are replaced by the canned ones of
    the first key its decoded prompt contains (the j-th sample gets canned[key][j])."""
    real = rollout.generate

    def fixed(model, tok, prompts, n=1, **kw):
        out = real(model, tok, prompts, n=n, **kw)
        texts = [next(v for key, v in canned.items() if key in tok.decode(p)) for p in prompts]
        out.texts = [texts[i][j] for i in range(len(prompts)) for j in range(n)]
        return out

    monkeypatch.setattr(rollout, "generate", fixed)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random model whose context holds a LiveCodeBench prompt, with a plain chat template."""
    path = str(tmp_path_factory.mktemp("tiny_ood"))
    model, tok = tiny.model(), tiny.tokenizer()
    model.config.max_position_embeddings = 2048
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_code_and_logiqa_print_both_means_and_pass_at_k(tiny_dir, tmp_path, monkeypatch, capsys):
    """The tiny model's samples are replaced by fixed responses, so every number below is known (the
    reloaded tokenizer decodes without spaces or unknown characters: the keys are written so)."""
    sums = tmp_path / "sums.jsonl"
    sums.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    canned = {"theirsum": [SUM_RIGHT, SUM_SIX, "", SUM_SIX],          # 1 of 4 right
              "eturna+b": [ADD_RIGHT, ADD_WRONG, ADD_RIGHT, "none"],      # 2 of 4
              "omisacat": ["\\boxed{B}</think>\\boxed{B}"] * 4,            # 4 of 4 (a box in the thinking)
              "roadisdry": ["\\boxed{A}</think>\\boxed{A}"] * 4,
              "nnisastudent": ["</think>\\boxed{A}"] * 4,                  # no box in the thinking: wrong
              "1+1": ["\\boxed{2}</think>\\boxed{2}", "\\boxed{3}</think>"] * 2}
    answer_with(monkeypatch, canned)
    out = str(tmp_path / "out")
    evaluate.main(["--model", tiny_dir, "--benchmarks", f"{sums},lcb={LCB},logiqa={LOGIQA}", "--out", out,
                   "--confidence", "logits", "--n-samples", "4", "--max-new-tokens", "4"])
    printed = capsys.readouterr().out
    saved = json.load(open(os.path.join(out, "results.json")))[os.path.basename(tiny_dir)]
    b = saved["benchmarks"]
    assert b["lcb"]["acc"] == pytest.approx(3 / 8) and b["logiqa"]["acc"] == pytest.approx(4 / 12)
    assert b["lcb"]["pass_at_k"] == pytest.approx({"1": 3 / 8, "2": (0.5 + 5 / 6) / 2, "4": 1.0})
    assert b["logiqa"]["pass_at_k"] == pytest.approx({"1": 1 / 3, "2": 1 / 3, "4": 1 / 3})
    assert b["sums"]["pass_at_k"] == pytest.approx({"1": 0.5, "2": 5 / 6, "4": 1.0})
    assert saved["math"]["acc"] == pytest.approx(0.5)                          # sums alone
    assert saved["ood"]["acc"] == pytest.approx((3 / 8 + 1 / 3) / 2)
    # the paper's Overall: the mean over every benchmark evaluated, not the mean of the two means
    assert saved["overall"]["acc"] == pytest.approx((1 / 2 + 3 / 8 + 1 / 3) / 3)    # 0.4028, not 0.4271
    for key in ("ece", "pce"):
        assert saved["ood"][key] == pytest.approx((b["lcb"][key] + b["logiqa"][key]) / 2)
        assert saved["overall"][key] == pytest.approx((b["sums"][key] + b["lcb"][key] + b["logiqa"][key]) / 3)
    assert saved["settings"]["lcb"]["grader"] == "code" and saved["settings"]["logiqa"]["grader"] == "math"
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert [r["answer"] for r in samples if r["benchmark"] == "lcb"][:2] == [
        "n = int(input())\nprint(sum(map(int, input().split())))\n", "print(6)\n"]
    assert "(lcb: LiveCodeBench v4_v5 (contests 2024-08 to 2025-01))" in printed
    cells = [line.split("|") for line in printed.splitlines() if line.startswith("| ")][1:]
    acc = {c[1].strip(): c[3].strip() for c in cells}
    assert list(acc) == ["sums", "lcb", "logiqa", "Math mean", "OOD mean", "Overall"]
    means = {k: acc[k] for k in list(acc)[3:]}
    assert means == {"Math mean": "0.500", "OOD mean": "0.354", "Overall": "0.403"}
    assert "| 1: 0.375 2: 0.667 4: 1.000 |" in printed


def test_the_hub_loaders_read_the_raw_files_and_the_harness_copy(monkeypatch):
    asked = []
    raw = [json.loads(line) for line in open(LCB)]
    logiqa = [json.loads(line) for line in open(LOGIQA)]
    monkeypatch.setattr(data, "_from_hub", lambda hf_id, config, split, files=None: asked.append((hf_id, files))
                        or raw if files else asked.append((hf_id, config, split)) or logiqa)
    assert len(benchmarks.load_benchmark("lcb")[1]) == 2 and len(benchmarks.load_benchmark("logiqa")[1]) == 3
    assert asked == [("livecodebench/code_generation_lite", "test*.jsonl"), ("lighteval/logiqa_harness", "logiqa", "test")]


def test_gpqa_natural_boxed_answers_are_graded_as_released_and_logiqa_by_its_letter(tiny_dir, tmp_path,
                                                                                      monkeypatch, capsys):
    """Released (1_obtain_validation_rollouts: compute_score(strict_box_verify=True) on natural boxed
    answers): `\\boxed{A) 3.5 eV}` against gold "A" fails the strict box, the normal forms, eval and
    sympy, so it is wrong; `\\boxed{A}` is right. Option letters are read off forced and RLCR answers
    only. LogiQA has no released grader: the project reads its letter (README, LogiQA row)."""
    gpqa = tmp_path / "gpqa.jsonl"
    gold, option = "C", "C) neon"   # a row as data._choices lays GPQA out
    gpqa.write_text(json.dumps({"problem": "Which gas?\n\nA) iron\nB) zinc\nC) neon\nD) lead", "answer": gold}) + "\n")
    canned = {"ichgas": [f"\\boxed{{{option}}}</think>\\boxed{{{option}}}", f"\\boxed{{{gold}}}</think>"] * 2,
              "omisacat": ["\\boxed{B. Tom is an animal.}</think>\\boxed{B}"] * 4,
              "roadisdry": ["\\boxed{A}</think>"] * 4, "nnisastudent": ["\\boxed{A}</think>"] * 4}
    answer_with(monkeypatch, canned)
    out = str(tmp_path / "out")
    evaluate.main(["--model", tiny_dir, "--benchmarks", f"gpqa={gpqa},logiqa={LOGIQA}", "--out", out,
                   "--confidence", "logits", "--n-samples", "4", "--max-new-tokens", "4"])
    capsys.readouterr()
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert [r["correct"] for r in samples if r["benchmark"] == "gpqa"] == [0, 1, 0, 1]
    logiqa = [r["correct"] for r in samples if r["benchmark"] == "logiqa"]
    assert logiqa[:4] == [1, 1, 1, 1]    # "B. Tom is an animal." against B: the letter, the project's rule
    # the forced (post-hoc) and RLCR readings keep the released letter rule
    assert grade.answers_match(option, gold) and not grade.answers_match(option, gold, letters=False)
    assert evaluate.natural_correct(f"</think><answer>{option}</answer>", option, gold, form="tag", letters=True)


def test_samples_keep_their_text_and_gold_on_any_benchmark_unless_no_log_text(tiny_dir, tmp_path, monkeypatch,
                                                                               capsys):
    """Issue 51: only the toy's rows kept their text, so a wrong grade on a real benchmark could not be
    read. Issue 59: --no-log-text keeps neither text (for space); the text is no part of a sample's key,
    so rows with and without it are reused alike."""
    sums = write(tmp_path / "sums.jsonl", json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    canned = ["\\boxed{2}</think>\\boxed{2}", "\\boxed{3}</think>"]
    answer_with(monkeypatch, {"1+1": canned})
    samples = lambda out: [json.loads(line) for line in open(tmp_path / out / "samples.jsonl")]  # noqa: E731
    small = ["--benchmarks", sums, "--confidence", "logits", "--n-samples", "2", "--max-new-tokens", "4"]
    for out, *flag in (("a",), ("a", "--no-log-text"), ("b", "--no-log-text"), ("b",)):
        evaluate.main(["--model", tiny_dir, "--out", str(tmp_path / out), *small, *flag])
    logged = samples("a")   # 2 rows: the second command found both samples in it and drew none
    assert [(r["problem"], r["text"], r["gold"], r["correct"]) for r in logged] == [
        ("1+1", canned[0], "2", 1), ("1+1", canned[1], "2", 0)]
    assert samples("b") == [{k: v for k, v in r.items() if k not in ("problem", "text")} for r in logged]


BAD = "its tests or metadata are not LiveCodeBench's"
DEEP = "[" * 100000 + "]" * 100000
BAD_ROWS = {   # (change to the fixture's first row, the words of the one line); at a7c59f5:
    "deep private": ({"private_test_cases": DEEP}, "its tests are nested too deep"),
    "deep public": ({"public_test_cases": DEEP}, "its tests are nested too deep"),
    "private an object": ({"private_test_cases": '{"a": 1}'}, BAD + " (TypeError"),  # TypeError
    "no testtype": ({"private_test_cases": '[{"input": "1\\n7\\n", "output": "7\\n"}]'},
                    BAD + " (KeyError"),  # KeyError at grading
    "a test a list": ({"private_test_cases": '[["1", "2"]]'}, BAD + " (TypeError"),  # at grading
    "int input": ({"public_test_cases": '[{"input": 5, "output": "5", "testtype": "stdin"}]',
                   "private_test_cases": "[]"},
                  "its 1 tests are not all of one type"),  # every sample graded wrong, no word
    "int output": ({"private_test_cases": '[{"input": "1", "output": 1, "testtype": "stdin"}]'},
                   "its 2 tests are not"),
    "no tests": ({"public_test_cases": "[]", "private_test_cases": "[]"}, "its 0 tests are not"),
    "mixed": ({"private_test_cases": '[{"input": "1", "output": "1", "testtype": "functional"}]'},
              "its 2 tests are not all of one type, stdin or functional"),   # L1: at grading
    "question null": ({"question_content": None}, "question_content is null, not the problem's"),
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


def test_a_zlib_bomb_in_private_tests_is_refused_before_it_inflates(tmp_path, monkeypatch):
    # M4 (C35): at a7c59f5 zlib.decompress had no bound (1.4 MB row -> 2.06 GB). Here the bound is
    # lowered to 1 MB so that the original code, which inflates 4 MB, fails in a moment.
    import base64
    import json
    import resource
    import zlib
    from harness import sandbox
    monkeypatch.setattr(sandbox, "TESTS_BYTES", 1 << 20, raising=False)   # a7c59f5 had no bound
    z = zlib.compressobj(9)
    blob = base64.b64encode(b"".join([z.compress(b"\0" * (1 << 22)), z.flush()])).decode()
    row = dict(json.loads(open(LCB).readline()), private_test_cases=blob)
    path = tmp_path / "lcb.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(data.DataError, match="^LiveCodeBench problem abc001_a: private tests "
                                             "inflate to over 1 MB \\(a zlib bomb\\?\\): fix or drop the row$"):
        benchmarks.load_benchmark(f"lcb={path}")
    # the real bound (1 GiB) on the red team's 1.4 MB row: refused without holding what it inflates to
    monkeypatch.setattr(sandbox, "TESTS_BYTES", 1 << 30)
    z = zlib.compressobj(9)
    blob = base64.b64encode(b"".join([z.compress(b"\0" * (1 << 24)) for _ in range(65)] + [z.flush()])).decode()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match="inflate to over 1024 MB"):
        data.lcb_tests(dict(row, private_test_cases=blob))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024   # kB: under 200 MB more
