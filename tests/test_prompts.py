"""prompts.py: the chat prompt's ids and the released RLCR instruction (local fixtures only)."""
import os

import pytest

import data
import prompts as prompts_lib

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "fixtures")
needs_fixtures = pytest.mark.skipif(not os.path.isdir(FIXTURES), reason="shared fixtures not present")


class FakeTokenizer:
    bos_token_id = 5

    def __init__(self, out):
        self.out = out

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize and messages[0]["content"].endswith(prompts_lib.INSTRUCTION)
        return self.out


def test_chat_prompt_returns_plain_ids_with_one_bos():
    assert prompts_lib.chat_prompt(FakeTokenizer({"input_ids": [5, 5, 7, 8]}), "p") == [5, 7, 8]
    assert prompts_lib.chat_prompt(FakeTokenizer([5, 9]), "p") == [5, 9]


@needs_fixtures
def test_chat_prompt_with_the_real_tokenizer():
    from tests import tiny  # imported here: the grading tests need no transformers
    tok = tiny.real_tokenizer()
    if tok is None:
        pytest.skip("shared fixture r1_distill_qwen_7b not present")
    problem = data.load_rows(os.path.join(FIXTURES, "math500.jsonl"), limit=1)[0]["problem"]
    ids = prompts_lib.chat_prompt(tok, problem)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert ids[0] == 151646 and ids.count(151646) == 1
    assert ids[-3:] == [151645, 151648, 198]
    assert tok.decode(ids).endswith("<｜Assistant｜><think>\n")
    assert problem + prompts_lib.INSTRUCTION in tok.decode(ids)


# The released RLCR prompt (scripts/data/deepscaler_dataset_rlcr), copied by hand: f"{problem}\n\n{it}".
RELEASED_RLCR = ("Let's think step by step. Output the final answer inside <answer> </answer>. Then analyze your "
                 "confidence and uncertainty inside <analysis> </analysis>. Finally, output a confidence score "
                 "between 0 and 1 inside <confidence> </confidence>.\n\nUse exactly this format:\n"
                 "<answer> final answer here </answer>\n<analysis> confidence and uncertainty analysis here "
                 "</analysis>\n<confidence> number between 0 and 1 </confidence>")


def test_rlcr_prompt_is_the_released_string():
    problem = "What is 3 + 5?"
    assert problem + prompts_lib.RLCR_INSTRUCTION == f"{problem}\n\n{RELEASED_RLCR}"
    assert RELEASED_RLCR.endswith(prompts_lib.RLCR_FORMAT)


@needs_fixtures
def test_rlcr_prompt_on_the_r1_template():
    from tiny import real_tokenizer
    tok = real_tokenizer()
    text = tok.decode(prompts_lib.chat_prompt(tok, "What is 3 + 5?", prompts_lib.RLCR_INSTRUCTION))
    assert text == f"<｜begin▁of▁sentence｜><｜User｜>What is 3 + 5?\n\n{RELEASED_RLCR}<｜Assistant｜><think>\n"
