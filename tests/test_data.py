"""data.py: dataset loading (local fixtures only); its prompts: test_prompts.py, grading in test_grade.py."""
import json
import os
import sys
import types

import pytest

import data
from runs import jsonl, write

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")   # the benchmarks' files


def test_scrub_restores_latex_escapes():
    assert data.scrub("$\x0crac{1}{2} \times 3$\r\n\x00ok\t1") == "$\\frac{1}{2} \\times 3$\nok 1"
    assert data.scrub("\x08inom{5}{2}") == "\\binom{5}{2}"


def test_benchmark_files_in_their_real_layouts():
    math500 = data.load_rows(os.path.join(FIXTURES, "math500.jsonl"))
    assert len(math500) == 500 and math500[0]["answer"] == r"\left( 3, \frac{\pi}{2} \right)"
    aime24 = data.load_rows(os.path.join(FIXTURES, "aime24.jsonl"), limit=3)
    assert [r["answer"] for r in aime24] == ["204", "113", "371"]
    assert aime24[0]["problem"].startswith("Every morning Aya")
    aime25 = data.load_rows(os.path.join(FIXTURES, "aime25.jsonl"))  # field `question`, float answers
    assert len(aime25) == 30 and aime25[0]["answer"] == "70" and aime25[0]["problem"].startswith("Find the sum")
    amc23 = data.load_rows(os.path.join(FIXTURES, "amc23.jsonl"))
    assert len(amc23) == 40 and amc23[0]["answer"] == "27"
    assert set(math500[0]) == {"problem", "answer"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_local_formats_and_field_names(tmp_path):
    rows = [{"query": "2+2?\x0crac", "target": 4.0}, {"query": "3+3?", "target": "6"}]
    assert data.load_rows(write_jsonl(tmp_path / "a.jsonl", rows)) == [
        {"problem": "2+2?\\frac", "answer": "4"}, {"problem": "3+3?", "answer": "6"}]
    (tmp_path / "b.json").write_text(json.dumps({"data": rows}))
    assert len(data.load_rows(str(tmp_path / "b.json"), limit=1)) == 1
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow
    pq.write_table(pyarrow.Table.from_pylist([{"question": "x?", "final_answer": ["$\\frac{1}{2}$", "$3$"]}]),
                   tmp_path / "c.parquet")
    assert data.load_rows(str(tmp_path / "c.parquet")) == [
        {"problem": "x?", "answer": "\\frac{1}{2}"}]


def test_binary_parquet_columns_are_read_as_utf8_text(tmp_path):
    """Before, str(b'2') made the gold "b'2'", which nothing matches."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow
    path = str(tmp_path / "b.parquet")
    pq.write_table(pyarrow.table({"problem": [b"What is 1+1?"], "answer": [b"2"]}), path)
    assert pq.read_schema(path).field("answer").type == pyarrow.binary()
    assert data.load_rows(path) == [{"problem": "What is 1+1?", "answer": "2"}]
    pq.write_table(pyarrow.table({"problem": [b"What is 1+1?"], "answer": [b"\xff2"]}), path)
    with pytest.raises(data.DataError, match=r"row 0 answer is not valid Unicode .*'\\udcff' at character 0\): fix the row"):
        data.load_rows(path)


def test_error_messages(tmp_path):
    solution_only = write_jsonl(tmp_path / "s.jsonl", [{"problem": "p", "solution": "worked text"}])
    with pytest.raises(data.DataError, match=r"no answer field.*'solution'.*rename one to 'answer'"):
        data.load_rows(solution_only)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(data.DataError, match="has no rows"):
        data.load_rows(str(tmp_path / "empty.jsonl"))
    with pytest.raises(data.DataError, match=r"unknown benchmark 'aime26'.*math500, aime24"):
        data.load_rows("aime26")
    with pytest.raises(data.DataError, match="file not found"):
        data.load_rows(str(tmp_path / "missing.jsonl"))


def test_two_candidate_fields_are_refused_in_one_line(tmp_path, fake_hub):
    """Before, the first name in data.PROBLEM_FIELDS / ANSWER_FIELDS won without a word: every prompt
    was the topic label, every gold the worked sentence."""
    for row, fields in (({"problem": "arithmetic", "question": "1+1?", "answer": "2"}, "'problem' and 'question'"),
                        ({"problem": "1+1?", "answer": "It is 2.", "final_answer": "2"}, "'answer' and 'final_answer'")):
        path = write_jsonl(tmp_path / "two.jsonl", [row])
        with pytest.raises(data.DataError, match=f"^{path}: fields {fields} could each be the .* and differ in row 0: rename or drop"):
            data.load_rows(path)
    row = {"question": "1+1?", "answer": "so #### 2", "target": "2"}
    with pytest.raises(data.DataError, match="'answer' and 'target'"):
        data.load_rows(write_jsonl(tmp_path / "gsm8k.jsonl", [row]))
    fake_hub[1]["openai/gsm8k"] = [row]  # a benchmark's own layout names its fields
    assert data.load_rows("gsm8k") == [{"problem": "1+1?", "answer": "2"}]
    copied = write_jsonl(tmp_path / "aime.jsonl", [{"problem": "1+1?", "question": "1+1?", "answer": "2"}])
    assert data.load_rows(copied) == [{"problem": "1+1?", "answer": "2"}]  # the same text twice: no question


@pytest.fixture
def fake_hub(monkeypatch):
    """Replace datasets.load_dataset: record (id, config, split), return the rows given per id."""
    datasets = pytest.importorskip("datasets")
    calls, tables = [], {}

    def load_dataset(hf_id, config=None, split=None):
        calls.append((hf_id, config, split))
        if hf_id not in tables:
            raise ConnectionError(f"Couldn't reach '{hf_id}' on the Hub (OfflineModeIsEnabled)")
        return tables[hf_id]
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls, tables


def test_benchmark_names_resolve_to_hub_ids(fake_hub):
    calls, tables = fake_hub
    tables["AI-MO/aimo-validation-amc"] = [
        {"problem": "p22", "answer": 3.0, "url": "https://x/2022_AMC_12A"},
        {"problem": "p23", "answer": 27.0, "url": "https://x/2023_AMC_12A"}]
    assert data.load_rows("amc23") == [{"problem": "p23", "answer": "27"}]
    tables["Hothan/OlympiadBench"] = [{"question": "q", "final_answer": ["$\\sqrt{2}$", "$2$"], "solution": ["s"]}]
    assert data.load_rows("olympiadbench") == [{"problem": "q", "answer": "\\sqrt{2}"}]
    tables["yentinglin/aime_2025"] = [{"problem": "p", "answer": "025"}]
    assert data.load_rows("aime25")[0]["answer"] == "25"
    tables["Idavidrein/gpqa"] = [{"Question": f"Q{i}", "Correct Answer": "right", "Incorrect Answer 1": "w1",
                                  "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"} for i in range(8)]
    gpqa = data.load_rows("gpqa")
    for row in gpqa:
        assert f"{row['answer']}) right" in row["problem"]
    assert len({r["answer"] for r in gpqa}) > 1 and gpqa == data.load_rows("gpqa")  # shuffled, fixed seed
    assert calls[:3] == [("AI-MO/aimo-validation-amc", None, "train"),
                         ("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train"),
                         ("yentinglin/aime_2025", None, "train")]
    assert data.BENCHMARKS["math500"]["hf"] == "HuggingFaceH4/MATH-500" and data.BENCHMARKS["math500"]["split"] == "test"
    with pytest.raises(data.DataError, match="cannot reach the Hugging Face hub for HuggingFaceH4/MATH-500.*local json"):
        data.load_rows("math500")
    with pytest.raises(data.DataError, match="cannot reach the Hugging Face hub for someone/data"):
        data.load_rows("someone/data", split="test")
    assert calls[-1] == ("someone/data", None, "test")


def test_toy_source_calls_toy_dataset(monkeypatch):
    seen = []
    fake = types.ModuleType("toy")
    fake.dataset = lambda split, name: seen.append((split, name)) or [{"problem": "1+1=", "answer": "2"}]
    monkeypatch.setitem(sys.modules, "toy", fake)
    assert data.load_rows("toy") == [{"problem": "1+1=", "answer": "2"}]
    data.load_rows("toy", split="test")
    data.load_rows("toy-long", split="test")
    assert seen == [("train", "toy"), ("test", "toy"), ("test", "toy-long")]


def test_rows_are_bounded_where_they_are_read(tmp_path):
    """A problem over MAX_PROBLEM_CHARS, or text that is not valid Unicode (a lone surrogate, which
    JSON can spell), is one line naming the file and the row, not minutes of tokenizing or a chat
    template blamed for the data (red team 4, cases 26 and 27)."""
    big = "1+" * 100_000 + "1"
    path = write_jsonl(tmp_path / "big.jsonl", [{"problem": "2+2", "answer": "4"}, {"problem": big, "answer": "1"}])
    with pytest.raises(data.DataError) as e:
        data.load_rows(path)
    assert str(e.value) == (f"{path}: row 1 has a problem of 200,001 characters, over the 200,000 a row may "
                            "hold (data.MAX_PROBLEM_CHARS): fix or drop the row")
    assert data.load_rows(path, limit=1) == [{"problem": "2+2", "answer": "4"}]
    at_bound = write_jsonl(tmp_path / "ok.jsonl", [{"problem": big[:-1], "answer": "1"}])
    assert len(data.load_rows(at_bound)[0]["problem"]) == 200_000
    lone = tmp_path / "lone.jsonl"
    lone.write_text('{"problem": "2+2", "answer": "4"}\n{"problem": "2+2 \\ud800", "answer": "4"}\n')
    with pytest.raises(data.DataError, match=rf"^{lone}: row 1 problem is not valid Unicode \(surrogates not "
                                             r"allowed, '\\ud800' at character 4\): fix the row$"):
        data.load_rows(str(lone))
    lone.write_text('[{"problem": "2+2", "answer": "4\\udfff"}]')
    with pytest.raises(data.DataError, match=rf"^{lone}: row 0 answer is not valid Unicode"):
        data.load_rows(str(lone))


def write_verl(path, rows):
    """A parquet in verl's layout, as the release ships its benchmarks and lead_80.parquet (its
    deepscaler_dataset script): rows of (chat content, ground truth)."""
    import pyarrow
    import pyarrow.parquet
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([
        {"data_source": "math", "prompt": [{"role": "user", "content": content}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": gold}, "extra_info": {"split": "test", "index": i}}
        for i, (content, gold) in enumerate(rows)]), path)
    return str(path)


def test_verl_layout_parquets_read_as_released(tmp_path):
    """The prompt is the chat list as released (its instruction already in it), the gold
    reward_model.ground_truth; before, such a file stopped with "no answer field"."""
    asked = "What is 2+3? Let's think step by step and output the final answer within \\boxed{}."
    path = write_verl(tmp_path / "lead.parquet", [(asked, "5"), ("Compute 7*6.", "42")])
    rows = data.load_rows(path)
    assert rows == [{"problem": asked, "answer": "5", "messages": [{"role": "user", "content": asked}]},
                    {"problem": "Compute 7*6.", "answer": "42", "messages": [{"role": "user", "content": "Compute 7*6."}]}]
    assert data.load_rows(path, like="logiqa") == rows   # a released benchmark's file: its own prompt, not rebuilt
    with pytest.raises(data.DataError, match="LiveCodeBench file in verl's layout"):
        data.load_rows(path, like="lcb")
    with pytest.raises(data.DataError, match=r"row 0 has an empty answer \(fields 'prompt', 'reward_model.ground_truth'\)"):
        data.load_rows(write_verl(tmp_path / "nogold.parquet", [(asked, "")]))


def test_a_mistyped_extension_on_an_existing_file_still_reads(tmp_path):
    import data
    path = jsonl(tmp_path / "d.jsnol", [{"problem": "1+1", "answer": "2"}])
    assert data.load_rows(path) == [{"problem": "1+1", "answer": "2"}]
    assert data.load_rows(path, limit=0) == []   # 0 means none, not all


GPQA_ROW = {"Question": "Which gas do plants absorb?", "Correct Answer": "Carbon dioxide", "Incorrect Answer 1": "Oxygen",
            "Incorrect Answer 2": "Helium", "Incorrect Answer 3": "Neon"}


def test_a_local_gpqa_file_is_built_as_the_hubs_gpqa(tmp_path):
    # H6: at a7c59f5 gpqa=FILE gave {'problem': 'Which gas do plants absorb?', 'answer': 'Carbon dioxide'}:
    # no options, the answer text as gold (a response naming the right letter scored 0).
    import data
    from evaluation import benchmarks
    path = tmp_path / "gpqa.jsonl"
    path.write_text(json.dumps(GPQA_ROW) + "\n")
    name, rows, _, _ = benchmarks.load_benchmark(f"gpqa={path}")
    assert name == "gpqa" and rows == [{"problem": "Which gas do plants absorb?\n\nA) Helium\nB) Carbon dioxide\n"
                                                   "C) Oxygen\nD) Neon", "answer": "B"}]
    assert (rows[0]["problem"], rows[0]["answer"]) == data._choices(GPQA_ROW, 0, data.BENCHMARKS["gpqa"])
    path.write_text(json.dumps({k: v for k, v in GPQA_ROW.items() if k != "Incorrect Answer 2"}) + "\n")
    with pytest.raises(data.DataError, match=f"^{path}: row 0 has no 'Incorrect Answer 2' field: a gpqa file"):
        benchmarks.load_benchmark(f"gpqa={path}")


DATA_CASES = {   # name: (file content, words in the DataError)
    "dict answer": ('[{"problem": "1+2", "answer": {"value": "3"}}]', "row 0 field 'answer'"),
    "bool answer": ('[{"problem": "1+2", "answer": true}]', "row 0 field 'answer' is 'True' (bool)"),
    "NaN answer": ('{"problem": "1+2", "answer": 1}\n{"problem": "1+2", "answer": NaN}\n', "row 1 field 'answer'"),
    "dict problem": ('[{"problem": {"text": "1+2"}, "answer": "3"}]', "row 0 field 'problem'"),
    "non-dict row": ('[{"problem": "1+2", "answer": "3"}, 5, "x"]', "row 1 is 5, not an object"),
    "scalar file": ("5", "holds 5 at the top level, not rows"),
    "null file": ("null", "holds null at the top level"),
    "bad line 5": ("".join('{"problem": "1+2", "answer": "3"}\n' for _ in range(4)) + '{"problem": "1+2", "answer": }\n',
                   "(line 5, column"),
}


@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_data_is_one_line_naming_the_file_and_the_row(case, tmp_path):
    content, words = DATA_CASES[case]
    path = write(tmp_path / "d.jsonl", content)
    with pytest.raises(data.DataError) as e:
        data.load_rows(path)
    assert path in str(e.value) and words in str(e.value), str(e.value)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = write(tmp_path / "d.json", b'\xef\xbb\xbf[{"problem": "1+2", "answer": 3}]')
    assert data.load_rows(path) == [{"problem": "1+2", "answer": "3"}]


def test_a_one_line_jsonl_is_one_row_even_with_one_list_field(tmp_path):
    # L2 (C36): a one-line .jsonl was read as one JSON document, and a row holding one list as
    # "a dict holding one list of rows": "has no rows".
    path = write_jsonl(tmp_path / "olympiad.jsonl", [{"question": "q", "final_answer": ["$2$"]}])
    assert data.load_rows(path) == [{"problem": "q", "answer": "2"}]
