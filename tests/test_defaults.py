"""The released training defaults for real models, read from the resolved config of a real-model run
(a tiny random Qwen2 with DeepSeek-R1-Distill-Qwen-7B's tokenizer, saved to a local directory)."""
import json
import os

import pytest
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

import config
import data
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")   # the benchmarks' files
TOKENIZER = os.path.join(ROOT, "..", "shared", "fixtures", "r1_distill_qwen_7b")   # outside the repository


@pytest.fixture(scope="module")
def real_model(tmp_path_factory):
    """A directory that loads like a real model: random 1-layer weights, the real tokenizer."""
    if not os.path.isdir(TOKENIZER):
        pytest.skip("shared tokenizer fixture missing")
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
                lr=1e-6, warmup=10, clip_low=0.2, clip_high=0.2, agg="token-mean", data="deepscaler",
                # verl's actor AdamW default (rlcm.sh sets none), verl's warm-up, save_freq=40
                weight_decay=0.01, warmup_from_zero=True, save_every=40)


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


def test_the_4b_name_resolves_to_the_released_4b_recipe():
    """scripts/train/qwen3_4b_instruct/rlcm.sh sets the 7B script's values (RELEASED above) and the paper
    evaluates its step 240 (the release's README); its post-hoc fit, configs/probe_training_qwen3_4b/
    lead.json, is the 7B's: 80 problems x 8 rollouts at T 0.6 of 8000 tokens, budgets 500 .. 8000, 16
    forced answers each."""
    import evaluate
    from evaluation.benchmarks import REAL as EVAL, settings
    for name in ("qwen3-4b-instruct", "Qwen/Qwen3-4B-Instruct-2507"):
        cfg = config.resolve_args(["--model", name])
        assert {k: cfg[k] for k in RELEASED} == {**RELEASED, "budgets": (0.25, 0.5, 0.75)}
        assert (cfg["steps"], cfg["save_every"], cfg["grader"], cfg["reward"]) == (240, 40, "strict", "rlcm")
    assert config.resolve_args(["--model", "qwen3-4b-instruct", "--steps", "300"])["steps"] == 300
    assert config.resolve_args(["--model", "deepseek-r1-distill-qwen-7b"])["steps"] == 600
    assert config.resolve_args(["--model", "rlcm-4b"])["steps"] == 600   # a released checkpoint: no recipe
    args = evaluate.parse_args(["--model", "rlcm-4b", "--benchmarks", "aime24"])
    s = settings("deepscaler", args)
    assert (EVAL["probe_questions"], EVAL["probe_samples"], args.temperature, s["max_new_tokens"], s["every"],
            EVAL["posthoc_budgets"], s["forced_k"]) == (80, 8, 0.6, 8000, 500, 16, 16)


def test_toy_world_keeps_its_sizes_and_filters_nothing():
    cfg = config.resolve_args([])
    assert (cfg["prompts_per_step"], cfg["group_size"], cfg["max_prompt_tokens"]) == (16, 8, 0)
    # the toy's README numbers were trained with these: no decay, the first update at lr / 3
    assert (cfg["weight_decay"], cfg["warmup_from_zero"], cfg["save_every"]) == (0.0, False, 10)
    # where the toy's margin acts (docs/toy-world.md, premise (iii)): lam 1, lr 2e-5; 72 tokens hold every trace
    assert (cfg["lam"], cfg["lr"], cfg["max_new_tokens"]) == (1.0, 2e-5, 72)


def test_warmup_factor_is_verls_from_zero_and_the_toys_shifted_by_one():
    """verl's constant-with-warm-up (transformers' get_constant_schedule_with_warmup, stepped after each
    update): factor s / 10 at update s, so 0.0 at the first update and 1.0 from update 10 on."""
    released = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0]
    assert [train.warmup_factor(s, 10, True) for s in range(12)] == pytest.approx(released, abs=1e-12)
    assert [train.warmup_factor(s, 3, False) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert train.warmup_factor(0, 0, True) == train.warmup_factor(0, 0, False) == 1.0   # no warm-up


def test_the_optimizer_takes_the_configs_weight_decay_and_a_first_update_at_lr_0(tmp_path, monkeypatch):
    """train.run builds AdamW with --weight-decay and the scheduler with --warmup-from-zero: under the
    released pair the first update leaves the weights as they were (lr 0, so no decay either)."""
    seen = {}

    class Stop(Exception):
        pass

    def stop(step, rows, prompts, learner, *a, **k):
        seen.update(wd=learner.opt.param_groups[0]["weight_decay"], lr=learner.sched.get_last_lr()[0])
        raise Stop
    monkeypatch.setattr(train, "rl_step", stop)
    monkeypatch.setattr(train, "held_out_accuracy", lambda *a, **k: 0.0)
    with pytest.raises(Stop):
        train.main(["--weight-decay", "0.01", "--warmup-from-zero", "--warmup", "10", "--lr", "1e-6",
                    "--eval-n", "1", "--out", str(tmp_path / "run")])
    assert seen == dict(wd=0.01, lr=0.0)


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
