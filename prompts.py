"""Prompts: the instruction each benchmark's problems get and the chat-template prompt ids.

    ids = row_prompt(tokenizer, rows[0], instruction_for("math500"))

The rows come from data.py (load_rows); check_context and drop_long_prompts fit them to the model.
"""
from data import DataError

INSTRUCTION = " Let's think step by step and output the final answer within \\boxed{}."
# --reward rlcr on a real model: the released RLCR prompt, word for word (docs/design.md, "Baselines");
# RLCR_FORMAT is also what its released evaluation asks of a forced re-answer.
RLCR_FORMAT = ("<answer> final answer here </answer>\n<analysis> confidence and uncertainty analysis here "
               "</analysis>\n<confidence> number between 0 and 1 </confidence>")
RLCR_INSTRUCTION = ("\n\nLet's think step by step. Output the final answer inside <answer> </answer>. Then analyze "
                    "your confidence and uncertainty inside <analysis> </analysis>. Finally, output a confidence "
                    "score between 0 and 1 inside <confidence> </confidence>.\n\nUse exactly this format:\n"
                    + RLCR_FORMAT)
TEMPLATE_SECONDS = 5  # the most one chat-template render may take; a real template takes milliseconds
# LogiQA is multiple choice with four options shown as A. to D.; the letter is asked for in a box.
LOGIQA_INSTRUCTION = (" Let's think step by step and output the letter of the correct option (A, B, C or D) "
                      "within \\boxed{}.")


def instruction_for(name):
    """The text appended to each problem of a benchmark: none for LiveCodeBench (its prompt is whole),
    LogiQA's letter request, else the math INSTRUCTION."""
    return {"lcb": "", "logiqa": LOGIQA_INSTRUCTION}.get(name, INSTRUCTION)


class _Slow(BaseException):
    """Raised by the render timer; a BaseException, so that no `except Exception` swallows it."""


def _render(tokenizer, messages, **kw):
    """apply_chat_template, where a template that raises, is missing, or renders for over
    TEMPLATE_SECONDS (an interval timer: main thread only) is one DataError line."""
    import signal
    import threading
    from jinja2 import TemplateError

    def stop(signum, frame):
        raise _Slow
    timed = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    try:
        if timed:
            before = signal.signal(signal.SIGALRM, stop)
            signal.setitimer(signal.ITIMER_REAL, TEMPLATE_SECONDS)
        try:
            return tokenizer.apply_chat_template(messages, **kw)
        finally:
            if timed:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, before or signal.SIG_DFL)  # None: a handler set outside Python
    except _Slow:
        raise DataError(f"this model's chat template renders one prompt for over {TEMPLATE_SECONDS} s: "
                        "fix its chat_template") from None
    except (TemplateError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        fix = " or drop --system-prompt" if messages[0]["role"] == "system" else ""
        raise DataError(f"this model's chat template cannot render the prompt ({type(e).__name__}: {first}): "
                        f"give the model a working chat_template{fix}") from None


def chat_prompt(tokenizer, problem: str, instruction: str = INSTRUCTION, system: str = None) -> list[int]:
    """Prompt ids: chat template over one user turn `problem + instruction` (after a system turn
    when `system` is given), generation prompt added (R1: BOS <｜User｜>...<｜Assistant｜><think>\\n).
    Tokenized by the template itself, since re-tokenizing the rendered string would add a second BOS."""
    messages = [{"role": "user", "content": problem + instruction}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
        if _render(tokenizer, messages, tokenize=False) == _render(tokenizer, messages[1:], tokenize=False):
            raise DataError("this model's chat template drops the system turn: put the text in the "
                            "instruction (--instruction) instead")
    return _ids(tokenizer, messages)


def row_prompt(tokenizer, row, instruction: str = INSTRUCTION, system: str = None) -> list[int]:
    """Prompt ids of a data row: chat_prompt over its problem, or, for a row read from a file in verl's
    layout (the release's parquets), its chat list row["messages"] as released: that prompt already
    holds the release's instruction, so neither `instruction` nor `system` is added."""
    if "messages" in row:
        return _ids(tokenizer, row["messages"])
    return chat_prompt(tokenizer, row["problem"], instruction, system)


def _ids(tokenizer, messages):
    """The chat template over `messages`, generation prompt added, tokenized; one BOS."""
    out = _render(tokenizer, messages, add_generation_prompt=True, tokenize=True)
    ids = [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]
    bos = tokenizer.bos_token_id
    while bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
        ids.pop(0)
    return ids


def drop_long_prompts(rows, tokenizer, max_tokens, instruction=INSTRUCTION):
    """(rows whose chat prompt has at most max_tokens tokens, number dropped); the released training
    set drops longer prompts (600 tokens) when it is loaded."""
    over = {i for i, _ in long_prompts(tokenizer, rows, instruction, max_tokens)}
    return [r for i, r in enumerate(rows) if i not in over], len(over)


def check_context(tokenizer, rows, instruction, context, max_new_tokens, where, say=print, system=None):
    """DataError when a prompt leaves no room to generate in the model's `context` tokens; `say` a
    warning when prompts plus max_new_tokens overflow it. The first row is rendered (with `system`)
    first: a chat template that fails stops here, before any folder is made."""
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
        say(f"warning: {where}: {len(over)} of {len(rows)} prompts plus {max_new_tokens} new tokens exceed "
            f"the model's context of {context} tokens")


def long_prompts(tokenizer, rows, instruction, limit):
    """[(row index, prompt tokens)] for rows whose chat prompt is longer than `limit` tokens. Only rows
    that could be are tokenized: at most the template's tokens (per turn) plus two per UTF-8 byte."""
    import logging
    base = len(chat_prompt(tokenizer, "", instruction))
    out, log = [], logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)  # the tokenizer's "longer than the maximum length" warning: we say it better
    try:
        for i, r in enumerate(rows):
            if base * max(1, len(r.get("messages", ()))) + 2 * len(r["problem"].encode("utf-8")) > limit:
                n = len(row_prompt(tokenizer, r, instruction))
                if n > limit:
                    out.append((i, n))
    finally:
        log.setLevel(level)
    return out
