"""The pinned stack: transformers must fold grouped-query heads in a masked one-token SDPA step.

transformers 5.0-5.22 call `repeat_kv` in every masked single-token SDPA step: at the 7B rollout
shape (24 rows x 9216 positions) that writes and reads the K/V cache 7 times over (about 190 GB of
attention traffic per decode step instead of 13 GB). 5.23 packs the query heads instead
(`pack_gqa`). The static decode step always passes a mask, so it is exactly the affected case.
"""
import os
import re

import pytest
import torch

import rollout
from harness import staticcache
import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_requirements_ask_for_transformers_5_23_or_newer():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        line = next(x for x in f if re.match(r"transformers\b", x))
    low = re.search(r">=\s*([\d.]+)", line)
    assert low, f"no lower bound on transformers: {line.strip()}"
    assert tuple(int(x) for x in low.group(1).split(".")[:2]) >= (5, 23), line.strip()


def test_a_static_decode_step_does_not_repeat_kv(monkeypatch):
    sdpa = pytest.importorskip("transformers.integrations.sdpa_attention")
    model, tok = tiny.model(layers=2), tiny.tokenizer()  # 4 query heads over 2 K/V heads
    assert model.config.num_attention_heads // model.config.num_key_value_heads == 2
    assert model.config._attn_implementation == "sdpa"
    steps, forward = [], staticcache._Shape.forward

    def no_repeat(*a, **k):
        raise AssertionError("repeat_kv in a static decode step: transformers < 5.23?")

    def decode_step(self, *args):
        steps.append(1)
        with monkeypatch.context() as m:
            m.setattr(sdpa, "repeat_kv", no_repeat)
            return forward(self, *args)

    monkeypatch.setattr(staticcache._Shape, "forward", decode_step)
    prompts = [tok.encode("1+1="), tok.encode("what is 2*3?")]
    out = rollout.generate(model, tok, prompts, n=2, max_new_tokens=6, temperature=0.8, seed=0,
                           decode="static", eos_ids=[])
    assert len(steps) == 5 and out.lengths == [6] * 4  # every step after the first one went through
    ref = rollout.generate(model, tok, prompts, n=2, max_new_tokens=6, temperature=0.8, seed=0,
                           decode="dynamic", eos_ids=[])
    assert out.ids == ref.ids


def test_a_model_loads_without_the_kernels_package(monkeypatch):
    """transformers 5.25 kernelizes on from_pretrained unless told not to, and refuses without the
    `kernels` package: the GPU machine's first run failed so on the toy. Loading must not need it."""
    import transformers.modeling_utils as mu

    from harness.checkpoint import load_model
    monkeypatch.setattr(mu, "is_kernels_available", lambda *a, **k: False)
    model, tok = load_model("toy", torch.float32)
    assert not model.use_kernels and tok.pad_token_id is not None
