"""The released training defaults for real models, read from the resolved config of a real-model run
(a tiny random Qwen2 with DeepSeek-R1-Distill-Qwen-7B's tokenizer, saved to a local directory)."""
import json
import os

import pytest
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from harness import config
import data
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "..", "shared", "fixtures")
TOKENIZER = os.path.join(FIXTURES, "r1_distill_qwen_7b")
pytestmark = pytest.mark.skipif(not os.path.isdir(TOKENIZER), reason="shared tokenizer fixture missing")


@pytest.fixture(scope="module")
def real_model(tmp_path_factory):
    """A directory that loads like a real model: random 1-layer weights, the real tokenizer."""
    path = str(tmp_path_factory.mktemp("tiny_r1"))
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


RELEASED = dict(prompts_per_step=32, group_size=6, max_new_tokens=8000, max_prompt_tokens=600,
                budgets=[0.25, 0.5, 0.75], corner="zero", temperature=0.8, top_p=1.0, k=4, lam=0.1,
                lr=1e-6, warmup=10, clip_low=0.2, clip_high=0.2, agg="token-mean", data="deepscaler")


def test_resolved_config_of_a_real_model_run_has_the_released_defaults(real_model, tmp_path, capsys,
                                                                       monkeypatch):
    path, tok = real_model
    # Three training problems; one with a chat prompt far over 600 tokens must be dropped at load.
    train_file = tmp_path / "train.jsonl"
    rows = [{"problem": "What is 1 + 1?", "answer": "2"}, {"problem": "What is 2 + 3?", "answer": "5"},
            {"problem": "Compute " + " + ".join(str(i) for i in range(400)) + ".", "answer": "79800"}]
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = [len(data.chat_prompt(tok, r["problem"])) for r in rows]
    assert lengths[0] < 600 < lengths[2]
    monkeypatch.setattr(train, "held_out_accuracy", lambda *a, **k: 0.0)   # no 8000-token sampling

    class Loaded(Exception):
        pass

    def stop(*a, **k):   # the run is set up and its config written: stop before 8000-token rollouts
        raise Loaded
    monkeypatch.setattr(train, "rl_step", stop)
    out = str(tmp_path / "run")
    with pytest.raises(Loaded):
        train.main(["--model", path, "--data", str(train_file), "--eval-data",
                    os.path.join(FIXTURES, "math500.jsonl"), "--eval-n", "1", "--steps", "1", "--out", out])
    assert "training set: 2 problems, 1 dropped (prompt over 600 tokens)" in capsys.readouterr().out
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert {k: cfg[k] for k in RELEASED if k != "data"} == {k: v for k, v in RELEASED.items() if k != "data"}
    resolved = config.resolve_args(["--model", path])
    assert {k: resolved[k] for k in RELEASED} == {**RELEASED, "budgets": (0.25, 0.5, 0.75)}
    assert resolved["grader"] == "strict" and cfg["grader"] == "strict"


def test_toy_world_keeps_its_sizes_and_filters_nothing():
    cfg = config.resolve_args([])
    assert (cfg["prompts_per_step"], cfg["group_size"], cfg["max_prompt_tokens"]) == (16, 8, 0)


def test_budgets_flag():
    assert config.resolve_args(["--budgets", "1.0"])["budgets"] == (1.0,)
    assert config.resolve_args(["--budgets", "0.5,0.25"])["budgets"] == (0.5, 0.25)
    for bad in ("0", "1.5", "a,b", ""):
        with pytest.raises(SystemExit):
            config.resolve_args(["--budgets", bad])


def test_drop_long_prompts(real_model):
    _, tok = real_model
    rows = [{"problem": " ".join(str(i) for i in range(n)), "answer": "1"} for n in (10, 1000)]
    kept, dropped = data.drop_long_prompts(rows, tok, 600)
    assert kept == rows[:1] and dropped == 1
    assert data.drop_long_prompts(rows, tok, 10**6) == (rows, 0)
