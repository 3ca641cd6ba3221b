"""Answer extraction and grading: is the final answer of a response the gold answer?

    is_correct(text, gold)                      # last \\boxed{...} of a response vs the gold answer
    is_correct(text, gold, grader="strict")     # the same under the released training rule
    answers_match(answer, gold, grader="math")  # an answer already extracted (a forced one) vs gold
    is_correct(text, gold, grader="code")       # the last fenced code block passes the gold's tests
    is_correct(text, gold, grader="mine.py:ok") # your own function ok(response, gold) -> bool

The graders: docs/reference.md, "Evaluation and the method's leaves, in more words"."""
import argparse
import functools
import importlib.util
import json
import os
import re
from fractions import Fraction

from harness import sandbox
from harness.files import UserError, first_line
from harness.verifier import verify as _math_verify

GRADERS = ("strict", "math", "minerva")
GRADE_TIMEOUT_S = 1.0    # math-verify's CPU seconds per comparison; one that runs out is graded wrong
MAX_ANSWER_CHARS = 2000  # longer answers are compared as plain strings: no regex, no parser


def last_boxed(text):
    """Strict extraction: content of the last `\\boxed{` up to its closing brace (every brace
    counts), stripped; None without one that closes."""
    start = (text or "").rfind("\\boxed{")
    return None if start < 0 else _close(text, start + len("\\boxed{"), _PLAIN_BRACE)


def forced_answer(text):
    """The text of a forced answer up to the brace closing the forced `\\boxed{`, stripped, or None
    if it never closes: forced_answer("17}\\n") == "17", forced_answer("{1}} so") == "{1}"."""
    return _close(text, 0, _PLAIN_BRACE)


_BOX = re.compile(r"\\(?:boxed|fbox)(?:\s*\{| +(?=[^\s{]))")  # linear: a match starts at a backslash
_BARE = re.compile(r"[^\s$]*")
_PLAIN_BRACE = re.compile(r"[{}]")
_BRACE = re.compile(r"\\[{}]|[{}]")  # \{ and \} are literal braces and do not count


def _close(text, start, braces):
    """text[start:closing brace of depth 1].strip(), or None if it never closes."""
    depth = 1
    for m in braces.finditer(text, start):
        depth += {"{": 1, "}": -1}.get(m.group(), 0)  # an escaped \{ or \} counts 0
        if depth == 0:
            return text[start:m.start()].strip()
    return None


def boxed_answer(text):
    """Math extraction: content of the last \\boxed{...}, \\fbox{...} or bare "\\boxed 5", braces
    balanced, \\{ and \\} literal; None without one that closes."""
    last = max(_BOX.finditer(text or ""), key=lambda m: m.start(), default=None)
    if last is None:
        return None
    if not last.group().endswith("{"):
        return _BARE.match(text, last.end()).group() or None
    return _close(text, last.end(), _BRACE)


def strict_form(s: str) -> str:
    """The released normalisation (math_dapo.normalize_answer): strip, drop one trailing ".0", then
    the leading zeros after a minus sign ("0" if none is left): strict_form(" -007.0 ") == "-7"."""
    s = s.strip().removesuffix(".0")
    sign = "-" if s.startswith("-") else ""
    return sign + (s[len(sign):].lstrip("0") or "0")


_MINERVA_REPLACE = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
                    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_MINERVA_UNITS = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
                  "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
                  "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
                  "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}",
                  "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots"]
_MINERVA_SUBS = [(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$"), (r"\\text\{(.*?)\}", r"\1"),
                 (r"\\textbf\{(.*?)\}", r"\1"), (r"\\overline\{(.*?)\}", r"\1"),
                 (r"\\boxed\{(.*)\}", r"\1"), (r"(frac)([^{])(.)", r"frac{\2}{\3}"),
                 (r"(sqrt)([^{])", r"sqrt{\2}")]


def minerva_form(s: str) -> str:
    """Minerva's normal form (released math_dapo.normalize_final_answer), the steps above in order:
    minerva_form("x = \\boxed{10,000} units") == "10000"; minerva_form("017") == "017"."""
    s = s.split("=")[-1]
    for before, after in _MINERVA_REPLACE:
        s = s.replace(before, after)
    for unit in _MINERVA_UNITS:
        s = s.replace(unit, "")
    for pattern, replacement in _MINERVA_SUBS:
        s = re.sub(pattern, replacement, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _normalize(s: str) -> str:
    """Spelling-only differences: "\\left( 1{,}000 \\right)." and "(1000)" both give "(1000)"."""
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[!,;: ]", "", s).replace("{,}", ",").replace("$", "")
    s = re.sub(r"\s+", "", s).replace("dfrac", "frac").replace("tfrac", "frac").rstrip(".")
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # thousands separators
        s = s.replace(",", "")
    return s


_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")  # one way to split any digit run: linear


def plain_number(s: str):
    """Exact value of a plain decimal ("025" -> 25, "27.0" -> 27, "0.5" -> 1/2), else None."""
    return Fraction(s) if len(s) <= MAX_ANSWER_CHARS and _NUMBER.fullmatch(s) else None


_SUM = re.compile(r"[-+]?\d+(?:[+-]\d+)+")  # integers added and subtracted: "15+2", "9-3+5-2"


def integer_sum(s: str):
    """Exact value of a sum of integers ("15+2" -> 17, "9-3+5-2" -> 9), else None: what math-verify
    computes for it, without its parser (the toy world's forced answers are such sums)."""
    return sum(map(int, _NUMBER.findall(s))) if len(s) <= MAX_ANSWER_CHARS and _SUM.fullmatch(s) else None


def grader_spec(text):
    """--grader: one of GRADERS, or FILE.py:FUNCTION (user_grader loads it)."""
    path, _, name = text.rpartition(":")
    if text in GRADERS or (path.endswith(".py") and name.isidentifier()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: must be one of {', '.join(GRADERS)} or "
                                     "FILE.py:FUNCTION")


@functools.cache
def user_grader(spec):
    """--grader FILE.py:FUNCTION: the function, imported and tried on one answer. It takes (response
    text, gold) and returns True or False; any failure is one UserError line naming the file."""
    path, _, name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise UserError(f"--grader {spec}: no file {path}; pass FILE.py:FUNCTION")
    module_spec = importlib.util.spec_from_file_location("user_grader", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a syntax error, a failed import, a sys.exit() in it
        raise UserError(f"--grader {spec}: importing {path} failed ({type(e).__name__}: "
                        f"{first_line(e)}); fix the file") from None
    if not callable(fn := getattr(module, name, None)):
        raise UserError(f"--grader {spec}: {path} has no function {name}; pass FILE.py:FUNCTION")
    _ask(spec, fn, "\\boxed{1}", "1")   # a wrong return or a raise is said before any model loads
    return fn


def _ask(spec, fn, text, gold):
    try:
        verdict = fn(text, gold)
    except KeyboardInterrupt:
        raise
    except BaseException as e:   # sys.exit() in it too: it must not end the run as a success
        raise UserError(f"--grader {spec} raised {type(e).__name__}: {first_line(e)} (on response "
                        f"{text[:40]!r}, gold {str(gold)[:20]!r}); fix the function") from None
    if not isinstance(verdict, bool) and type(verdict).__name__ != "bool_":   # numpy's bool too
        raise UserError(f"--grader {spec} returned {repr(verdict)[:40]} ({type(verdict).__name__}) "
                        f"on response {text[:40]!r}: it must return True or False")
    return bool(verdict)


def answers_match(pred, gold, grader="math", letters=True) -> bool:
    """Is the extracted answer `pred` the gold answer under `grader` (one of GRADERS)? Against an
    option letter, letters=True reads the letter an answer names (gpqa_choice), as the released
    evaluation reads forced and RLCR answers; letters=False grades as its natural boxed answers."""
    if pred is None or gold is None:
        return False
    pred, gold = str(pred).strip(), str(gold).strip()
    special = grader != "math" or gold in CHOICES or max(len(pred), len(gold)) > MAX_ANSWER_CHARS
    verdict = _by_form(pred, gold, grader, letters) if special else None
    if verdict is not None:
        return verdict
    a, b = _normalize(pred), _normalize(gold)
    if not a or not b:
        return False
    if a == b:
        return True
    na, nb = plain_number(a), plain_number(b)
    if na is not None and nb is not None:
        return na == nb
    if nb is not None and (total := integer_sum(a)) is not None:
        return total == nb
    return _math_verify(pred, gold, GRADE_TIMEOUT_S)


def _by_form(pred, gold, grader, letters):
    """answers_match past a plain math answer (None: graded as one): FILE.py:FUNCTION (the answer
    boxed, as a response gives it), strict, minerva, answers too long to parse, GPQA's letters."""
    if ":" in grader:
        return _ask(grader, user_grader(grader), f"\\boxed{{{pred}}}", gold)
    if grader == "strict":
        return strict_form(pred) == strict_form(gold)
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return bool(pred) and pred == gold
    if grader == "minerva":  # its $...$ pattern is quadratic: only on answers of bounded length
        return minerva_form(pred) == minerva_form(gold)
    if gold in CHOICES and not letters:  # GPQA's natural boxed answer: released_letter
        return released_letter(pred, gold)
    letter = gpqa_choice(pred) if letters and gold in CHOICES else None
    return None if letter is None else letter == gold  # no option named: graded as usual


CHOICES = ("A", "B", "C", "D")  # a gold answer that is one of these is a GPQA option letter (data._choices)
_CHOICE_WORD = re.compile(r"\b(?:OPTION|CHOICE|ANSWER)\s*[:\-]?\s*([A-D])\b")


def released_letter(pred, gold):
    """A natural boxed answer against an option letter as released (is_correct_strict_box): right
    when Minerva's form is the letter (`$A$`, `x = A`) or it is `(A)`; `a`, `A) 3 eV` are wrong."""
    return minerva_form(pred) == gold or re.fullmatch(rf"\s*\(\s*{gold}\s*\)\s*", pred.strip("$")) is not None


def gpqa_choice(answer):
    """The option letter of a multiple-choice answer as the released GPQA scoring reads it
    (extract_gpqa_choice): "(b)", "Option B", "Answer: B", "B) 3.5 eV", "B." -> "B"; None if none."""
    s = answer.strip().upper()
    if m := re.search(r"\(([A-D])\)", s) or _CHOICE_WORD.search(s):
        return m.group(1)
    if s[:1] in CHOICES and s[1:2] in ("", ".", ")", ":", "-", " ", "\n", "\t"):
        return s[0]
    m = re.search(r"\b([A-D])\b", s)
    return m.group(1) if m else None


def answer_tag(text):
    """Content of the last complete <answer>...</answer> (stripped), else None: RLCR's format.
    "<answer> 3 </answer> ... <answer>17</answer>" -> "17"."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    return text[start + len("<answer>"):end].strip() if start >= 0 else None


def blank_answer(tag):
    """Whether an RLCR answer tag is no answer as released: none, or empty in Minerva's form."""
    return tag is None or not tag.strip() or (len(tag) <= MAX_ANSWER_CHARS and not minerva_form(tag))


def rlcr_answer(text):
    """A natural RLCR response's answer as the released evaluation reads it: the last <answer> tag,
    or after a blank one the last box: "<answer></answer> so \\boxed{5}" -> "5". Evaluation only."""
    tag = answer_tag(text)
    return last_boxed(text) if tag is not None and blank_answer(tag) and "\\boxed{" in text else tag


def boxed_in_thinking(text):
    """The released gate on a natural answer: does the text before the first `</think>` (all of
    it without one) hold a `\\boxed{` that closes? `3+5=8</think>\\boxed{8}` does not."""
    return last_boxed(text.partition("</think>")[0]) is not None


def answer_form(mode):
    """A --reward mode's answer form for extract: rlcr's last <answer> tag, else the box."""
    return "tag" if mode == "rlcr" else "box"


def extract(text, grader="math", form="box"):
    """The answer a response gives: its last box (strict: the raw last), or its last <answer>."""
    if form == "tag":
        return answer_tag(text)
    return last_boxed(text) if grader == "strict" else boxed_answer(text)


def code_job(text, gold):
    """sandbox.run_tests' arguments for a response to a code problem (gold: its tests as JSON)."""
    spec = json.loads(gold)
    return dict(code=sandbox.extract_code(text), tests=spec["tests"], fn_name=spec["fn_name"])


def is_correct(text, gold, grader="math", form="box") -> bool:
    """True only when the text's answer (extract) is the gold; "code" and FILE.py:FUNCTION: _whole."""
    if grader == "code" or ":" in grader:
        return _whole(text, gold, grader)
    return answers_match(extract(text, grader, form), gold, grader)


def _whole(text, gold, grader):
    """The whole response graded: "code" runs its last code block on the gold's tests; FILE.py:FUNCTION
    asks your function (response, gold) -> bool."""
    return (sandbox.run_tests(**code_job(text, gold)) if grader == "code"
            else _ask(grader, user_grader(grader), text, gold))
