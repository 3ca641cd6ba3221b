"""data.py's prompts: the chat prompt's ids and the released RLCR instruction (local fixtures only)."""
import os

import pytest

import data
import toy
from tests import tiny

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")   # the benchmarks' files
needs_7b = pytest.mark.skipif(not os.path.isdir(tiny.REAL_TOKENIZER),
                              reason="shared fixture r1_distill_qwen_7b not present")


class FakeTokenizer:
    bos_token_id = 5

    def __init__(self, out):
        self.out = out

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize and messages[0]["content"].endswith(data.INSTRUCTION)
        return self.out


def test_chat_prompt_returns_plain_ids_with_one_bos():
    assert data.chat_prompt(FakeTokenizer({"input_ids": [5, 5, 7, 8]}), "p") == [5, 7, 8]
    assert data.chat_prompt(FakeTokenizer([5, 9]), "p") == [5, 9]


@needs_7b
def test_chat_prompt_with_the_real_tokenizer():
    from tests import tiny  # imported here: the grading tests need no transformers
    tok = tiny.real_tokenizer()
    problem = data.load_rows(os.path.join(FIXTURES, "math500.jsonl"), limit=1)[0]["problem"]
    ids = data.chat_prompt(tok, problem)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert ids[0] == 151646 and ids.count(151646) == 1
    assert ids[-3:] == [151645, 151648, 198]
    assert tok.decode(ids).endswith("<｜Assistant｜><think>\n")
    assert problem + data.INSTRUCTION in tok.decode(ids)


# The released RLCR prompt (scripts/data/deepscaler_dataset_rlcr), copied by hand: f"{problem}\n\n{it}".
RELEASED_RLCR = ("Let's think step by step. Output the final answer inside <answer> </answer>. Then analyze your "
                 "confidence and uncertainty inside <analysis> </analysis>. Finally, output a confidence score "
                 "between 0 and 1 inside <confidence> </confidence>.\n\nUse exactly this format:\n"
                 "<answer> final answer here </answer>\n<analysis> confidence and uncertainty analysis here "
                 "</analysis>\n<confidence> number between 0 and 1 </confidence>")


def test_rlcr_prompt_is_the_released_string():
    problem = "What is 3 + 5?"
    assert problem + data.RLCR_INSTRUCTION == f"{problem}\n\n{RELEASED_RLCR}"
    assert RELEASED_RLCR.endswith(data.RLCR_FORMAT)


@needs_7b
def test_rlcr_prompt_on_the_r1_template():
    from tiny import real_tokenizer
    tok = real_tokenizer()
    text = tok.decode(data.chat_prompt(tok, "What is 3 + 5?", data.RLCR_INSTRUCTION))
    assert text == f"<｜begin▁of▁sentence｜><｜User｜>What is 3 + 5?\n\n{RELEASED_RLCR}<｜Assistant｜><think>\n"


def test_prompts_past_the_context_are_refused_and_overflow_is_warned():
    import data
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(toy.BASE_DIR)   # context 256
    short = {"problem": "1+1", "answer": "2"}
    n = len(data.chat_prompt(tok, short["problem"], ""))
    said = []
    data.check_context(tok, [short], "", 256, 256 - n, "d", say=said.append)
    assert said == []                                        # exactly fills the context
    data.check_context(tok, [short], "", 256, 257 - n, "d", say=said.append)
    assert len(said) == 1 and "1 of 1 prompts plus" in said[0]
    with pytest.raises(data.DataError, match=r"d: 1 prompt\(s\) do not fit .* \(row 1: "):
        data.check_context(tok, [short, {"problem": "2" * 300, "answer": "2"}], "", 256, 10, "d")


def templated(template):
    tok = tiny.tokenizer()
    tok.chat_template = template
    return tok


PLAIN = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


TEMPLATE_CASES = {   # template, system prompt, words in the DataError
    "raises on a system turn": ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                                "supported') }}{% endif %}" + PLAIN, "be careful",
                                "(TemplateError: System role not supported): give the model a working "
                                "chat_template or drop --system-prompt"),
    "missing": (None, None, "(ValueError: "),
    "sandbox": ("{{ ''.__class__.__mro__[1].__subclasses__() }}" + PLAIN, None, "(SecurityError: "),
}


@pytest.mark.parametrize("case", TEMPLATE_CASES)
def test_a_chat_template_that_fails_is_one_data_error(case):
    template, system, words = TEMPLATE_CASES[case]
    with pytest.raises(data.DataError) as e:
        data.chat_prompt(templated(template), "1+1", "", system)
    assert words in str(e.value), str(e.value)


def test_the_first_prompt_is_rendered_with_the_system_turn_before_any_folder_is_made():
    tok = templated(TEMPLATE_CASES["raises on a system turn"][0])
    rows = [{"problem": "1+1", "answer": "2"}]
    data.check_context(tok, rows, "", None, 8, "toy")   # no system turn: renders
    with pytest.raises(data.DataError, match="System role not supported"):
        data.check_context(tok, rows, "", None, 8, "toy", system="be careful")
