"""The memory plan: its terms against real allocations, and the 7B verdicts from the config alone."""
import os

import pytest
import torch

import plan
import tiny
import train
from config import resolve_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_7B = os.path.join(ROOT, "..", "shared", "fixtures", "r1_distill_qwen_7b")
RELEASED = ["--prompts-per-step", "32", "--group-size", "6", "--max-new-tokens", "8000"]
needs_7b = pytest.mark.skipif(not os.path.isdir(FIXTURE_7B), reason="7B config fixture not present")


def test_parameter_terms_match_a_real_model():
    model = tiny.model(vocab_size=300, hidden=32, layers=3)
    total, root, layer = plan.param_counts(model.config)
    assert total == sum(p.numel() for p in model.parameters())
    assert layer == sum(p.numel() for p in model.model.layers[1].parameters())
    assert root == sum(p.numel() for n, p in model.named_parameters() if ".layers." not in n)
    cfg = dict(model="x", prompts_per_step=4, gen_batch=4, group_size=2, k=1, max_new_tokens=10,
               micro_tokens=64, grad_ckpt=False, chunk_size=8)
    # fp32 params + grads + AdamW's two moments, as torch allocates them after one step
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    held = sum(p.numel() * p.element_size() * 2 for p in model.parameters())  # params + grads
    held += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    for world in (1, 2):
        assert plan.estimate(model.config, cfg, world, "cpu")["training state"] == held / world


def test_kv_cache_term_matches_a_real_cache():
    from transformers import DynamicCache
    from rollout import _cache_kwarg
    model = tiny.model(vocab_size=300, hidden=32, layers=3)
    cfg = dict(model="toy", prompts_per_step=8, gen_batch=3, group_size=4, k=1, max_new_tokens=10,
               micro_tokens=64, grad_ckpt=True, chunk_size=8, reward="grpo")  # no forced answers
    rows, tokens = 3 * 4, plan.TOY_PROMPT_TOKENS + 10  # gen_batch prompts x group_size samples
    for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "cuda")):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            ids = torch.randint(4, 60, (rows, tokens))
            model.to(dtype)(ids, use_cache=True, **{_cache_kwarg(model): cache})
        held = sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values))
        t = plan.estimate(model.config, cfg, 1, device)
        assert t["kv_shape"] == (rows, tokens)
        assert t["KV cache"] == held


def test_the_7b_head_geometry_gives_56_kib_per_token():
    from transformers import Qwen2Config
    cfg = Qwen2Config(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28)
    assert plan.kv_bytes_per_token(cfg, 2) == 56 * 1024  # DESIGN.md, "Scale"


@needs_7b
def test_plan_for_8_gpus_fits_under_70_gib(capsys):
    train.main(["--model", FIXTURE_7B, "--plan", "--gpus", "8", "--gpu-mem", "80", *RELEASED])
    out = capsys.readouterr().out
    for term in ("training state", "generation copy", "KV cache", "activations", "log-prob chunk", "peak"):
        assert term in out
    cfg = resolve_args(["--model", FIXTURE_7B, "--gpus", "8", "--gpu-mem", "80", *RELEASED])
    t = plan.check(cfg)
    assert 7.5e9 < plan.param_counts(plan.model_config(FIXTURE_7B))[0] < 7.7e9
    assert t["training state"] == pytest.approx(16 * 7.6e9 / 8, rel=0.01)
    assert 40 * plan.GiB < t["peak"] < 70 * plan.GiB


@needs_7b
def test_one_gpu_needs_offload_and_fits_with_it(capsys):
    args = ["--model", FIXTURE_7B, "--gpus", "1", "--gpu-mem", "80", *RELEASED]
    with pytest.raises(SystemExit) as e:
        train.main(args + ["--plan"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--offload" in err, err
    t = plan.check(resolve_args(args + ["--offload"]))
    assert t["peak"] < 80 * plan.GiB and t["training state"] == 0
    assert t["host"] == pytest.approx(16 * 7.6e9, rel=0.01)


@needs_7b
def test_a_start_that_cannot_fit_stops_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "run", lambda cfg: pytest.fail("run() must not start"))
    with pytest.raises(SystemExit):
        train.main(["--model", FIXTURE_7B, "--gpus", "2", "--gpu-mem", "40", "--out", str(tmp_path / "r")])
    assert "cheapest fix" in capsys.readouterr().err


def test_a_smaller_gen_batch_is_the_cheapest_fix_when_the_kv_cache_is_too_big():
    model = tiny.model(vocab_size=300, hidden=64, layers=2)
    cfg = dict(model="x", prompts_per_step=64, gen_batch=64, group_size=8, k=4, max_new_tokens=4000,
               micro_tokens=4096, grad_ckpt=True, chunk_size=64, offload=False)
    counts = plan.param_counts(model.config)
    t = plan.estimate(model.config, cfg, 1, "cuda", counts=counts)
    assert t["KV cache"] > t["activations"] + t["log-prob chunk"]
    fix = plan.fixes(model.config, cfg, 1, "cuda", t["peak"] - t["KV cache"] / 3, counts)
    assert fix.startswith("--gen-batch 32 ")
