"""The fused static decode step (harness/staticcache.py: fuse, _Shape.fused_forward), which a GPU runs
captured and compiled, run on the CPU in float32, eagerly and compiled as on a GPU: the dynamic path's
tokens and scores at query groups 1, 2 and 7, one static graph per shape, finished rows attending over
nothing, one GEMM for q, k, v and one for gate and up, buffers freed at release."""
import gc
import shutil
import weakref

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention
from transformers import LlamaConfig, LlamaForCausalLM

import rollout
from harness import staticcache
from tests import tiny
from tests.test_rollout import SETTINGS, assert_same_scores, enc

PROMPTS = ["1+2=", "what is 17*3? think.", "x", "hello there"]  # left padding leaves holes in the mask


def llama():
    """A tiny random Llama (no biases), with tiny.model()'s large weights."""
    torch.manual_seed(1)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                     max_position_embeddings=512, pad_token_id=0, bos_token_id=2,
                                     eos_token_id=1)).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return m


@pytest.fixture(scope="module")
def tok():
    return tiny.tokenizer()


def fused_decoder(model):
    d = staticcache.decoder(model, rollout.Sampler(model, tiny.tokenizer()).cache_kw)
    d.fused = True  # off by default until a GPU check has run it
    return d


@pytest.mark.parametrize("kw", SETTINGS, ids=["greedy", "sampled", "top-p"])
@pytest.mark.parametrize("build", [tiny.model, llama], ids=["qwen2", "llama"])
def test_fused_step_gives_the_dynamic_samples(tok, build, kw):
    model = build()
    fused_decoder(model)
    prompts = [enc(tok, p) for p in PROMPTS]
    common = dict(n=2, max_new_tokens=16, batch_size=3, scores=True, **kw)
    free = rollout.generate(model, tok, prompts, eos_ids=[], decode="dynamic", **common)
    eos = free.ids[1][4]  # ends some rows early: they stay in the static batch, reading nothing
    for eos_ids in ([], [eos]):
        a = rollout.generate(model, tok, prompts, eos_ids=eos_ids, decode="dynamic", **common)
        b = rollout.generate(model, tok, prompts, eos_ids=eos_ids, decode="static", **common)
        assert a.ids == b.ids and a.finish == b.finish
        assert_same_scores(a, b)
    assert min(a.lengths) < 16 == max(a.lengths)
    shape = staticcache.decoder(model, "cache").shape
    assert shape.fused is not None and len(shape.steps) == 1  # one step for the shape, no live buckets
    # one tensor per group: q, k, v are row slices of it, not copies (the weights are read once)
    attn, qkv = model.model.layers[1].self_attn, shape.fused[1][0]
    assert attn.k_proj.weight.data_ptr() == qkv[len(attn.q_proj.weight):].data_ptr()
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))


def test_finished_rows_attend_over_nothing_and_running_rows_over_their_written_blocks(tok, monkeypatch):
    monkeypatch.setattr(staticcache, "BLOCK", 8)  # 16 steps cross a few blocks
    model = tiny.model()
    fused_decoder(model)
    seen, forward = [], staticcache._Shape.fused_forward

    def recorded(shape, m):
        out = forward(shape, m)
        seen.append((shape.lengths.clone(), shape.blocks.flatten().clone()))
        return out
    monkeypatch.setattr(staticcache._Shape, "fused_forward", recorded)
    prompts = [enc(tok, p) for p in PROMPTS[:3]]
    free = rollout.generate(model, tok, prompts, n=2, max_new_tokens=16, temperature=0, eos_ids=[])
    eos = free.ids[2][3]
    out = rollout.generate(model, tok, prompts, n=2, max_new_tokens=16, temperature=0, eos_ids=[eos],
                           decode="static")
    W = max(map(len, prompts))
    assert "eos" in out.finish and "length" in out.finish
    for t, (lengths, blocks) in enumerate(seen):  # step t feeds token t, written at column W + t
        want = [W + t + 1 if fin == "length" or t < m - 1 else 0 for m, fin in zip(out.lengths, out.finish)]
        # rows the buffers' bucket adds past the 6 real ones read nothing either
        assert lengths[:6].tolist() == want and lengths[6:].eq(0).all()
        assert blocks.tolist() == [-(-x // 8) for x in lengths.tolist()]
    assert len(seen) == 15


def compiled_as_on_cuda(monkeypatch, small="eager"):
    """staticcache.compiled's CUDA branch on the CPU: flex_attention through dynamo alone (inductor's CPU
    lowering of it takes minutes), the small ops through the backend `small`. Returns the graphs
    compiled, {"flex": [...], "small": [...]}."""
    graphs, compile, real = {"flex": [], "small": []}, torch.compile, staticcache.compiled

    def counted(kind, backend):  # one object per kind: dynamo reuses a graph for the same backend only
        def run(gm, inputs):
            graphs[kind].append(gm)
            return torch._dynamo.lookup_backend(backend)(gm, inputs)
        return run
    flex, rest = counted("flex", "eager"), counted("small", small)
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile(fn, backend=flex if fn is flex_attention
                                                                   else rest, **kw))
    monkeypatch.setattr(staticcache, "compiled", lambda fn, device: real(fn, torch.device("cuda")))
    return graphs


def symbolic(graph):
    """Whether a dynamo graph takes a size as a symbol (a dynamic shape) rather than a number."""
    values = [n.meta.get("example_value") for n in graph.graph.find_nodes(op="placeholder")]
    return any(isinstance(v, torch.SymInt) or any(isinstance(d, torch.SymInt) for d in getattr(v, "shape", ()))
               for v in values)


@pytest.mark.parametrize("group", [1, 2, 7])
def test_query_groups_fold_into_query_rows_and_each_shape_compiles_one_static_graph(tok, group, monkeypatch):
    """A KV head's `group` query heads are its query rows; on CUDA flex decoding takes that at any group
    and needs a static batch, which torch.compile's automatic dynamic shapes give up at a second shape."""
    graphs = compiled_as_on_cuda(monkeypatch)["flex"]
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)  # compiled() lifts it: runs make many shapes
    model = tiny.model(hidden=16 * group, heads=2 * group)  # over 2 KV heads
    fused_decoder(model)
    prompts = [enc(tok, p) for p in PROMPTS]
    for n, new_graphs in [(1, 1), (2, 1), (1, 0)]:  # shapes of 4 and 8 rows, then the first again
        kw = dict(n=n, max_new_tokens=6, temperature=1.0, seed=3, eos_ids=[], scores=True)
        a = rollout.generate(model, tok, prompts, decode="dynamic", **kw)
        was = len(graphs)
        b = rollout.generate(model, tok, prompts, decode="static", **kw)
        assert a.ids == b.ids and len(graphs) - was == new_graphs
        assert_same_scores(a, b)
    assert len(graphs) == 2 and not any(map(symbolic, graphs))
    query = graphs[0].graph.find_nodes(op="placeholder")[0].meta["example_value"]
    assert list(query.shape) == [4, 2, group, 8]  # [rows, KV heads, group, head dim]


@pytest.mark.skipif(not shutil.which("g++"), reason="inductor's CPU code needs a C++ compiler")
def test_the_small_ops_compiled_by_inductor_give_the_dynamic_samples(tok, monkeypatch):
    """fused="compiled": RMSNorm, rotary and SiLU-mul each one inductor graph (C++ here, Triton on a GPU)."""
    graphs = compiled_as_on_cuda(monkeypatch, small="inductor")
    model = tiny.model()
    fused_decoder(model).fused = "compiled"
    prompts = [enc(tok, p) for p in PROMPTS]
    kw = dict(n=2, max_new_tokens=8, temperature=1.0, seed=3, eos_ids=[], scores=True)
    a = rollout.generate(model, tok, prompts, decode="dynamic", **kw)
    b = rollout.generate(model, tok, prompts, decode="static", **kw)
    assert a.ids == b.ids
    assert_same_scores(a, b)
    assert len(graphs["flex"]) == 1 and len(graphs["small"]) == 3  # RMSNorm's serves all its layers


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_release_frees_the_fused_shapes_buffers_without_the_cycle_collector(tok, compiled, monkeypatch):
    """Neither the block mask (it holds tensors, not the shape) nor dynamo's trace of the first compile
    keeps a released shape's buffers for the cycle collector: the next shape's memory is there."""
    if compiled:
        compiled_as_on_cuda(monkeypatch)
    model = tiny.model()
    fused_decoder(model)
    rollout.generate(model, tok, [enc(tok, "1+2=")], n=2, max_new_tokens=4, temperature=0, eos_ids=[],
                     decode="static")
    keys = weakref.ref(staticcache.decoder(model, "cache").shape.kv.keys[0])
    gc.disable()  # what is freed now is freed by reference counts, at once
    try:
        staticcache.release(model)
        assert keys() is None
    finally:
        gc.enable()
