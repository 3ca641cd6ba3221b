"""Evaluation's memory: the generation's static buffers are freed before the features pass and the
early exit's labels, the features pass builds no K/V cache, the early exit's label chunks are sized
from the memory left (harness/plan.label_chunk)."""
import os

import pytest
import torch

import probe as probe_lib
import rollout
import tiny
from evaluation import benchmarks, confidence
from harness import plan, staticcache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_7B = os.path.join(ROOT, "..", "shared", "fixtures", "r1_distill_qwen_7b")


def test_the_features_pass_runs_without_the_generations_static_buffers_or_a_cache(monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2
    model, tok = tiny.model(vocab_size=300, hidden=32, layers=2), tiny.tokenizer()
    prompts = [tok.encode("1+2=")] * 2
    out = rollout.generate(model, tok, prompts, max_new_tokens=12, seed=0, decode="static")
    assert staticcache.decoder(model, None).shape is not None  # kept for a next call of its shape
    seen, caches = [], []
    real_features = confidence.features

    def features(*a, **kw):
        seen.append(staticcache.decoder(model, None).shape)
        return real_features(*a, **kw)

    class Counted(modeling_qwen2.DynamicCache):
        def __init__(self, *a, **kw):
            caches.append(1)
            super().__init__(*a, **kw)
    monkeypatch.setattr(confidence, "features", features)
    monkeypatch.setattr(modeling_qwen2, "DynamicCache", Counted)
    conf, _ = confidence.sample_confidences("probe-posthoc", model, tok, prompts, out.ids, out.texts, ["3", "3"],
                                            prb=probe_lib.Probe(32, dropout=0.0), close_id=1)
    assert seen == [None] and len(conf) == 2  # freed before the features pass
    assert caches == []  # whose forward keeps no K/V


@pytest.mark.skipif(not os.path.isdir(FIXTURE_7B), reason="7B config fixture not present")
def test_the_early_exit_chunk_fits_an_80_gb_gpu_at_aime_lengths():
    """The early exit labels up to 64 cuts per chunk (64 rows, k = 1). At AIME lengths (prompt and
    a cut of up to 7,500 thinking tokens, + the 32-token tail: 7,632 positions), with the 7B's
    weights (14.2 GiB) and the CUDA context on an 80 GB GPU, about 58 GiB are left after a tenth's
    margin; a cut needs its prefill cache row and its static row (2 x 56 KiB per position) and one
    layer's expanded K/V of the tail's prefill (2 x 2 x 28 heads x 128 x 2 bytes = 28 KiB)."""
    config = plan.model_config(FIXTURE_7B)
    per_cut = 7632 * (2 * 56 * 1024 + 28 * 1024)
    free = 58 * plan.GiB
    cuts = plan.label_chunk(64, 1, 7632, config, free)
    assert cuts == int(free // per_cut) == 56 and 64 * per_cut > free >= cuts * per_cut
    assert plan.label_chunk(64, 1, 7632, config, 100 * plan.GiB) == 64  # an H200: the whole chunk
    assert plan.label_chunk(64, 1, 7632, config, 0) == 1  # always one
