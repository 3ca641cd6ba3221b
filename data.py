"""What is asked: each benchmark's rows (from the hub, a local file or the toy world) and the
prompts built from them; grade.py grades the answers.

    rows = load_rows("math500")                     # [{"problem": str, "answer": str}, ...]
    ids = row_prompt(tokenizer, rows[0], instruction_for("math500"))"""
import json
import math
import os
import random
import re
import sys

from grade import plain_number as _number  # integer gold answers: "025" -> "25"
from harness.files import UserError, first_line, sha256

PROBLEM_FIELDS = ("problem", "question", "prompt", "Question", "query")
# A problem's most characters (real: under 10,000): broken files fail before minutes of tokenizing.
MAX_PROBLEM_CHARS = 200_000
# Answer-like names only: `solution` is a worked text, never a gold answer.
ANSWER_FIELDS = ("answer", "final_answer", "gold", "target", "Correct Answer")
_ESCAPES = {"\x07": "\\a", "\x08": "\\b", "\t": "\\t", "\x0b": "\\v", "\x0c": "\\f", "\r": "\\r"}

# short name -> its hub id, config, split and row layout (docs/benchmarks.md). integer: answers are
# integers however stored ("025", 70.0); filter: (field, substring) a kept row has; files: the hub
# repository's raw json files (datasets runs no loading scripts).
BENCHMARKS = {
    "math500": dict(hf="HuggingFaceH4/MATH-500", split="test", problem="problem", answer="answer"),
    "aime24": dict(hf="HuggingFaceH4/aime_2024", split="train", problem="problem", answer="answer",
                   integer=True),
    "aime25": dict(hf="yentinglin/aime_2025", split="train", problem="problem", answer="answer",
                   integer=True),
    "amc23": dict(hf="AI-MO/aimo-validation-amc", split="train", problem="problem", answer="answer",
                  integer=True, filter=("url", "2023")),
    "olympiadbench": dict(hf="Hothan/OlympiadBench", config="OE_TO_maths_en_COMP", split="train",
                          problem="question", answer="final_answer"),
    # GPQA stores no letter: the four options are shuffled with a fixed seed per row (see _choices).
    "gpqa": dict(hf="Idavidrein/gpqa", config="gpqa_diamond", split="train", problem="Question",
                 answer="Correct Answer", choices=("Correct Answer", "Incorrect Answer 1",
                                                   "Incorrect Answer 2", "Incorrect Answer 3")),
    # LiveCodeBench: code run against its tests (harness/sandbox.py); an LCB_RELEASES window's rows.
    "lcb": dict(hf="livecodebench/code_generation_lite", files="test*.jsonl", problem="question_content",
                answer="public_test_cases"),
    "logiqa": dict(hf="lighteval/logiqa_harness", config="logiqa", split="test", problem="question",
                   answer="label"),
    "gsm8k": dict(hf="openai/gsm8k", config="main", split="test", problem="question", answer="answer"),
    "deepscaler": dict(hf="agentica-org/DeepScaleR-Preview-Dataset", split="train",
                       problem="problem", answer="answer"),
}

OOD = ("lcb", "gpqa", "logiqa")  # out-of-distribution: their own block in evaluate.py's report
# LiveCodeBench's releases as contest months (first, last), from its README: release_vN holds every
# problem up to vN's last month; "v4_v5" (--lcb-release) is v4's first to v5's (docs/benchmarks.md).
LCB_RELEASES = {"v1": ("2023-05", "2024-03"), "v2": ("2024-04", "2024-05"), "v3": ("2024-06", "2024-07"),
                "v4": ("2024-08", "2024-09"), "v5": ("2024-10", "2025-01"), "v6": ("2025-02", "2025-04")}
LCB_RELEASE = "v4_v5"
# The whole LiveCodeBench user turn: lighteval's plus lcb_runner's stdin line (docs/benchmarks.md)
LCB_PREAMBLE = ("You will be given a question (problem specification) and will generate a correct "
                "Python program that matches the specification and passes all tests.\n\n")
LCB_STARTER = ("You will use the following starter code to write the solution to the problem and "
               "enclose your code within delimiters.\n")
LCB_STDIN = ("Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test "
             "on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python "
             "program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n")
INSTRUCTION = " Let's think step by step and output the final answer within \\boxed{}."
# --reward rlcr on real models: the released RLCR prompt word for word (docs/design.md, "Baselines");
# RLCR_FORMAT is also what its released evaluation asks of a forced re-answer.
RLCR_FORMAT = ("<answer> final answer here </answer>\n<analysis> confidence and uncertainty "
               "analysis here </analysis>\n<confidence> number between 0 and 1 </confidence>")
RLCR_INSTRUCTION = ("\n\nLet's think step by step. Output the final answer inside <answer> "
                    "</answer>. Then analyze your confidence and uncertainty inside <analysis> "
                    "</analysis>. Finally, output a confidence score between 0 and 1 inside "
                    "<confidence> </confidence>.\n\nUse exactly this format:\n" + RLCR_FORMAT)
# LogiQA is multiple choice with four options shown as A. to D.; the letter is asked for in a box.
LOGIQA_INSTRUCTION = (" Let's think step by step and output the letter of the correct option (A, "
                      "B, C or D) within \\boxed{}.")


def kind(name):
    """How a benchmark is graded: "code" (run against its tests), else "answer" (the last box)."""
    return "code" if name == "lcb" else "answer"


def lcb_window(release):
    """(first, last) contest month of an --lcb-release value: "v5", or "v4_v5" for v4 to v5."""
    first, _, last = release.partition("_")
    if first not in LCB_RELEASES or (last or first) not in LCB_RELEASES or first > (last or first):
        raise DataError(f"--lcb-release {release!r}: give vN or vA_vB (A <= B) with versions in "
                        f"{', '.join(LCB_RELEASES)}, e.g. v4_v5")
    return LCB_RELEASES[first][0], LCB_RELEASES[last or first][1]


def lcb_tests(r):
    """(tests, fn_name) of a LiveCodeBench row: public then private tests, each {"input": str,
    "output": str, "testtype": stdin | functional}, all of one type (functional: fn_name, the method
    of class Solution, from the metadata's func_name). ValueError when any of it is not so."""
    from harness.sandbox import decode_private_tests
    try:
        tests = json.loads(r["public_test_cases"])
        tests += decode_private_tests(r.get("private_test_cases") or "[]")
        fn_name = json.loads(r.get("metadata") or "{}").get("func_name")
        text = lambda t: isinstance(t["input"], str) and isinstance(t["output"], str)  # noqa: E731
        kinds = [t["testtype"] for t in tests if text(t)]
    except RecursionError:   # nested thousands deep: no test is
        raise ValueError("its tests are nested too deep") from None
    except (TypeError, KeyError, AttributeError) as e:   # a field of another shape
        why = f"{type(e).__name__}: {e}"
        raise ValueError(f"its tests or metadata are not LiveCodeBench's ({why})") from None
    if len(kinds) != len(tests) or len(set(kinds)) != 1 or kinds[0] not in ("stdin", "functional"):
        raise ValueError(f"its {len(tests)} tests are not all of one type, stdin or functional, "
                         "with text input and output")
    if kinds[0] == "functional" and not (isinstance(fn_name, str) and fn_name.isidentifier()):
        raise ValueError(f"its tests are functional but metadata's func_name is {fn_name!r}")
    return tests, fn_name


def _lcb_row(r):
    """(prompt, gold) of a LiveCodeBench row: the LCB_* prompt and the JSON of {"tests", "fn_name"}
    (lcb_tests) that grade.is_correct(..., grader="code") runs; a bad row is one line."""
    starter, question = r.get("starter_code"), r.get("question_content")
    try:
        if not isinstance(question, str) or not question.strip():
            shown = json.dumps(question, default=str)[:40]
            raise ValueError(f"question_content is {shown}, not the problem's text")
        tests, fn_name = lcb_tests(r)
    except ValueError as e:
        raise DataError(f"LiveCodeBench problem {r.get('question_id')}: {first_line(e)}: fix or drop the row") from None
    prompt = LCB_PREAMBLE + f"Question: {question}\n\n" + (
        LCB_STARTER + f"```python\n{starter}\n```\n\n" if starter else LCB_STDIN + "```python\n# YOUR CODE HERE\n```\n\n")
    return prompt, json.dumps({"tests": tests, "fn_name": fn_name})


def _logiqa_row(r):
    """(prompt, gold letter) of a LogiQA row: the passage, the question, the options as A. to D."""
    lack = next((f for f in ("context", "question", "options", "label") if r.get(f) is None), None)
    if lack:
        raise DataError(f"LogiQA row with no {lack!r}: a logiqa file needs the hub's context, question, options "
                        "and label (a file in another layout: rename it, e.g. DIR/logiqa_mine.jsonl)")
    options = [scrub(str(o)).strip() for o in r["options"]]
    if len(options) != 4 or str(r["label"]).lower() not in ("a", "b", "c", "d"):
        raise DataError(f"LogiQA row with {len(options)} options and label {r['label']!r}: need 4 and a-d")
    text = "\n".join(f"{'ABCD'[k]}. {o}" for k, o in enumerate(options))
    return f"{scrub(r['context']).strip()}\n\n{scrub(r['question']).strip()}\n\n{text}", str(r["label"]).upper()


BUILD = {"lcb": _lcb_row, "logiqa": _logiqa_row}  # rows built from several fields, local copies too
TOY_BENCHMARKS = ("toy", "toy-long", "toy-sub")  # toy.BENCHMARKS: data.py imports no toy


class DataError(UserError):
    """A dataset problem the user can fix; the message is one line saying how."""


def digest(source):
    """The sha256 of a local data file (None for a benchmark name or a hub id)."""
    named = source in TOY_BENCHMARKS or source in BENCHMARKS
    return None if named or not os.path.isfile(source) else sha256(source)

def scrub(text: str) -> str:
    """Undo LaTeX written into JSON unescaped ("\\frac" read as form feed + "rac") and drop other
    control characters; newlines stay (an escaped "\\n..." cannot be told from a real newline)."""
    text = re.sub(r"[\x07\x08\t\x0b\x0c\r](?=[A-Za-z])", lambda m: _ESCAPES[m.group()], text)
    text = text.replace("\r\n", "\n").replace("\t", " ")
    return re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)


def read_file(path):
    """Rows of a local .jsonl, .json (a list, or a dict holding one list of rows) or .parquet file
    (told by its content: a mistyped extension still reads; a .jsonl's lines are rows, even one)."""
    if not os.path.isfile(path):
        raise DataError(f"file not found: {path}: give the path of a json, jsonl or parquet file")
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:4] == b"PAR1" or path.lower().endswith(".parquet"):
        import pyarrow.parquet
        try:
            return pyarrow.parquet.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors have no common base besides Exception
            raise DataError(f"{path} is not a readable parquet file ({first_line(e)}): fix or replace it") from None
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not data
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}): "
                        "save it as UTF-8") from None
    try:
        data = json.loads(text) if text.strip() else []
    except json.JSONDecodeError:  # JSON lines, whatever the extension
        data = []
        for i, line in enumerate(text.splitlines()):
            try:
                data += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as e:
                raise DataError(f"{path} is neither JSON nor JSON lines (line {i + 1}, column "
                                f"{e.colno}: {e.msg}): fix the file") from None
            except ValueError:
                raise _long_integer(path, i + 1) from None
    except ValueError:   # too long an integer (in a document or a first line): its line
        digits = re.search(r"\d{%d}" % (sys.get_int_max_str_digits() + 1), text)
        raise _long_integer(path, text.count("\n", 0, digits.start()) + 1 if digits else "?") from None
    if isinstance(data, dict):   # a .jsonl of one line is one row, whatever fields it holds
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 and not path.lower().endswith(".jsonl") else [data]
    if not isinstance(data, list):
        raise DataError(f"{path} holds {json.dumps(data)[:40]} at the top level, not rows: give a "
                        "list of objects with problem and answer fields, or one object per line")
    return data


def _long_integer(path, line):  # json.loads' plain ValueError past sys.get_int_max_str_digits
    return DataError(f"{path}: line {line} holds an integer of over {sys.get_int_max_str_digits():,} digits, "
                     "which Python does not read as a number: fix the row (or write the value as a string)")


def _from_hub(hf_id, config, split, files=None):
    """A hub dataset's rows, or with `files` (a glob) its raw json files' (no loading script)."""
    import datasets
    try:
        if files:
            files = f"hf://datasets/{hf_id}/{files}"
            return list(datasets.load_dataset("json", data_files=files, split="train"))
        return list(datasets.load_dataset(hf_id, config, split=split))
    except Exception as e:
        raise DataError(f"cannot reach the Hugging Face hub for {hf_id} ({type(e).__name__}: "
                        f"{first_line(e)}): download it first or pass a local json/jsonl/parquet "
                        "file") from None


def _field(records, keys, preferred, candidates, kind, source):
    if preferred in keys:  # a benchmark's own layout
        return preferred
    found = [name for name in candidates if name in keys]
    differ = next((i for i, r in enumerate(records) if len({repr(r.get(f)) for f in found}) > 1), None)
    if differ is not None:  # two candidates that hold the same text (a copy) are no question
        raise DataError(f"{source}: fields {' and '.join(map(repr, found))} could each be the {kind} and differ "
                        f"in row {differ}: rename or drop all but the one that holds it")
    if found:
        return found[0]
    raise DataError(f"{source}: no {kind} field among {list(candidates)}; fields found: "
                    f"{sorted(keys)}; rename one to {kind!r} (a hub dataset: in a local copy)")


def _first(value):  # OlympiadBench lists its final answers
    return (value[0] if value else None) if isinstance(value, (list, tuple)) else value


def _answer_text(value, integer):
    """Gold answer as a string: $ stripped, "####" tail (GSM8K), 70.0 as "70"."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = scrub(str(value)).split("####")[-1].strip().strip("$").strip()
    if integer and _number(text) is not None and _number(text).denominator == 1:
        text = str(_number(text).numerator)  # "025" -> "25"
    return text


def _choices(row, index, spec):
    """GPQA: options shuffled with a per-row fixed seed; the gold is the correct option's letter."""
    options = [scrub(str(row[f])).strip() for f in spec["choices"]]
    order = list(range(len(options)))
    random.Random(index).shuffle(order)
    problem = scrub(str(row[spec["problem"]])).strip() + "\n\n" + "\n".join(
        f"{'ABCD'[k]}) {options[j]}" for k, j in enumerate(order))
    return problem, "ABCD"[order.index(0)]


def _verl_row(r, i, where):
    """(problem text, gold, chat list) of a row in verl's layout (the release's parquets)."""
    chat, gold = r.get("prompt"), (r.get("reward_model") or {}).get("ground_truth")
    turn = lambda m: isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)  # noqa: E731
    if not (isinstance(chat, list) and chat and all(map(turn, chat))):
        raise DataError(f"{where}: row {i} prompt is {str(chat)[:40]!r}, not a chat list of "
                        f"{{role, content}} (verl's layout): fix the row")
    messages = [{"role": m["role"], "content": m["content"]} for m in chat]
    return "\n\n".join(m["content"] for m in messages).strip(), gold, messages


def _gradable(where, i, field, value):
    if isinstance(value, bytes):  # a binary parquet column: UTF-8, or _check_text refuses the row
        return value.decode("utf-8", "surrogateescape")
    if isinstance(value, (dict, list, bool)) or (isinstance(value, float) and not math.isfinite(value)):
        raise DataError(f"{where}: row {i} field {field!r} is {str(value)[:40]!r} "
                        f"({type(value).__name__}), which can never be graded: give text or a number")
    return value


def _check_text(where, i, problem, answer):
    """A problem of at most MAX_PROBLEM_CHARS; valid Unicode (JSON can spell a lone surrogate)."""
    if len(problem) > MAX_PROBLEM_CHARS:
        raise DataError(f"{where}: row {i} has a problem of {len(problem):,} characters, over the "
                        f"{MAX_PROBLEM_CHARS:,} a row may hold (data.MAX_PROBLEM_CHARS): fix or drop the row")
    for field, text in (("problem", problem), ("answer", answer)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"{where}: row {i} {field} is not valid Unicode ({e.reason}, "
                            f"{text[e.start]!r} at character {e.start}): fix the row") from None


def load_rows(source, split=None, limit=None, like=None, lcb_release=LCB_RELEASE):
    """[{"problem": str, "answer": str}] from a TOY_BENCHMARKS or BENCHMARKS name, a local
    json/jsonl/parquet file or an HF dataset id ("owner/name"); fields are found by name. Rows
    of a file in verl's layout also hold "messages", rendered as is. like: the BENCHMARKS name whose
    layout a local file has; lcb_release: LiveCodeBench's window of contest months (lcb_window)."""
    name = source if source in BENCHMARKS else like
    spec = BENCHMARKS[like] if like in BUILD or "choices" in BENCHMARKS.get(like, {}) else {}
    if source in TOY_BENCHMARKS:
        import toy
        records, where = toy.dataset(split or "train", source), source
    elif source in BENCHMARKS:
        spec, where = BENCHMARKS[source], BENCHMARKS[source]["hf"]
        records = _from_hub(where, spec.get("config"), split or spec.get("split"), spec.get("files"))
    elif (os.path.isfile(source) or source.lower().endswith((".json", ".jsonl", ".parquet"))
          or not re.fullmatch(r"[\w-]+(/[\w.-]+)?", source) or os.path.isdir(source.split("/")[0])):
        records, where = read_file(source), source   # a path: neither owner/name nor a bare name
    elif "/" in source:
        records, where = _from_hub(source, None, split or "train"), source
    else:
        raise DataError(f"unknown benchmark {source!r}: known names are {', '.join(BENCHMARKS)}, "
                        "or pass a Hugging Face id (owner/name) or a local json/jsonl/parquet file")
    stray = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if stray is not None:
        raise DataError(f"{where}: row {stray} is {json.dumps(records[stray], default=str)[:40]}"
                        ", not an object with problem and answer fields: fix the data")
    if spec.get("filter"):
        field, needle = spec["filter"]
        records = [r for r in records if needle in str(r.get(field, ""))]
    verl = bool(records) and isinstance(records[0].get("reward_model"), dict) \
        and isinstance(records[0].get("prompt"), list)
    if verl and name == "lcb":
        raise DataError(f"{where}: a LiveCodeBench file in verl's layout holds its tests in verl's form, which "
                        "this project's code grader does not read: use lcb (the hub's rows) or a copy of them")
    if name == "lcb":
        first, last = lcb_window(lcb_release)
        records = [r for r in records if first <= str(r.get("contest_date", ""))[:7] <= last]
    if not records:
        raise DataError(f"{where} has no rows: check the file, split or filter")
    keys = set().union(*(r.keys() for r in records[:100]))
    pf, af = ("prompt", "reward_model.ground_truth") if verl else (
        _field(records, keys, spec.get("problem"), PROBLEM_FIELDS, "problem", where),
        _field(records, keys, spec.get("answer"), ANSWER_FIELDS, "answer", where))
    # GPQA's layout (options in fields of their own), hub or local copy: options shown, letter gold
    choices = spec.get("choices") if keys & set(spec.get("choices", ())) else None
    rows = []
    for i, r in enumerate(records if limit is None else records[:limit]):
        messages = None
        if verl:
            problem, gold, messages = _verl_row(r, i, where)
            answer = _answer_text(_gradable(where, i, af, _first(gold)), spec.get("integer"))
        elif name in BUILD:
            problem, answer = BUILD[name](r)
        elif choices:
            lack = [f for f in (spec["problem"], *choices) if not isinstance(r.get(f), (str, int, float))]
            if lack:
                raise DataError(f"{where}: row {i} has no {lack[0]!r} field: a {like or name} file in the hub's layout "
                                f"needs {spec['problem']!r} and {', '.join(map(repr, choices))}; fix the row")
            problem, answer = _choices(r, i, spec)
        else:
            problem = scrub(str(_gradable(where, i, pf, r.get(pf)) or "")).strip()
            answer = _answer_text(_gradable(where, i, af, _first(r.get(af))), spec.get("integer"))
        if not problem or answer in (None, ""):
            raise DataError(f"{where}: row {i} has an empty {'problem' if not problem else 'answer'} "
                            f"(fields {pf!r}, {af!r}): fix the data")
        _check_text(where, i, problem, answer)
        rows.append({"problem": problem, "answer": answer, **({"messages": messages} if messages else {})})
    return rows


def instruction_for(name):
    """The text appended to each problem of a benchmark (LiveCodeBench's prompt is whole)."""
    return {"lcb": "", "logiqa": LOGIQA_INSTRUCTION}.get(name, INSTRUCTION)


def _render(tokenizer, messages, **kw):
    """apply_chat_template, where a template that raises or is missing is one DataError line."""
    from jinja2 import TemplateError
    try:
        return tokenizer.apply_chat_template(messages, **kw)
    except (TemplateError, ValueError, TypeError) as e:
        fix = " or drop --system-prompt" if messages[0]["role"] == "system" else ""
        raise DataError(f"this model's chat template cannot render the prompt ({type(e).__name__}: "
                        f"{first_line(e)}): give the model a working chat_template{fix}") from None


def chat_prompt(tokenizer, problem: str, instruction: str = INSTRUCTION, system: str = None) -> list[int]:
    """Prompt ids: the chat template over one user turn `problem + instruction` (after a system
    turn), generation prompt added (R1: BOS <｜User｜>...<｜Assistant｜><think>\\n)."""
    messages = [{"role": "user", "content": problem + instruction}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
        if _render(tokenizer, messages, tokenize=False) == _render(tokenizer, messages[1:], tokenize=False):
            raise DataError("this model's chat template drops the system turn: put the text in the "
                            "instruction (--instruction) instead")
    return _ids(tokenizer, messages)


def row_prompt(tokenizer, row, instruction: str = INSTRUCTION, system: str = None) -> list[int]:
    """Prompt ids of a data row: chat_prompt over its problem, or a verl row's chat list as released
    (row["messages"], which holds the release's instruction: nothing is added)."""
    if "messages" in row:
        return _ids(tokenizer, row["messages"])
    return chat_prompt(tokenizer, row["problem"], instruction, system)


def _ids(tokenizer, messages):
    """`messages` tokenized by the chat template (its text re-tokenized has two BOS); one BOS."""
    out = _render(tokenizer, messages, add_generation_prompt=True, tokenize=True)
    ids = [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]
    bos = tokenizer.bos_token_id
    while bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
        ids.pop(0)
    return ids


def drop_long_prompts(rows, tokenizer, max_tokens, instruction=INSTRUCTION):
    """(rows whose chat prompt has at most max_tokens tokens, number dropped), as released."""
    over = {i for i, _ in long_prompts(tokenizer, rows, instruction, max_tokens)}
    return [r for i, r in enumerate(rows) if i not in over], len(over)


def check_context(tokenizer, rows, instruction, context, max_new_tokens, where, say=print, system=None):
    """DataError when a prompt leaves no room to generate in the model's `context` tokens; `say` a
    warning when prompts plus max_new_tokens overflow it. A template that fails stops here."""
    if rows:
        row_prompt(tokenizer, rows[0], instruction, system)
    if not context:
        return
    over = long_prompts(tokenizer, rows, instruction, context - max_new_tokens)
    too_long = [(i, n) for i, n in over if n >= context]
    if too_long:
        raise DataError(f"{where}: {len(too_long)} prompt(s) do not fit the model's context of {context} "
                        f"tokens (row {too_long[0][0]}: {too_long[0][1]} tokens): shorten or remove them")
    if over:
        say(f"warning: {where}: {len(over)} of {len(rows)} prompts plus {max_new_tokens} new "
            f"tokens exceed the model's context of {context} tokens")


def long_prompts(tokenizer, rows, instruction, limit):
    """[(row index, prompt tokens)] for rows whose chat prompt is longer than `limit` tokens; only
    those that could be (template tokens per turn plus two per UTF-8 byte) are tokenized."""
    base = len(chat_prompt(tokenizer, "", instruction))
    could = [(i, r) for i, r in enumerate(rows)
             if base * max(1, len(r.get("messages", ()))) + 2 * len(r["problem"].encode()) > limit]
    return [(i, n) for i, r in could if (n := len(row_prompt(tokenizer, r, instruction))) > limit]
