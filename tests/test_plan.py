"""The memory plan: its terms against real allocations, and the 7B verdicts from the config alone."""
import os

import pytest
import torch

from harness import plan
import tiny
import train
from config import resolve_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE_7B = "deepseek-r1-distill-qwen-7b"   # its config.json ships (configs/): planned offline
RELEASED = ["--prompts-per-step", "32", "--group-size", "6", "--max-new-tokens", "8000"]


def test_parameter_terms_match_a_real_model():
    model = tiny.model(vocab_size=300, hidden=32, layers=3)
    total, root, layer, _ = plan.param_counts(model.config)
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


def test_kv_cache_term_matches_a_real_static_cache():
    import rollout as sampling
    model = tiny.model(vocab_size=300, hidden=32, layers=3)
    tok = tiny.tokenizer()
    cfg = dict(model="toy", prompts_per_step=8, gen_batch=3, group_size=4, k=1, max_new_tokens=10,
               micro_tokens=64, grad_ckpt=True, chunk_size=8)
    # gen_batch 3 prompts x group_size 4 = 12 rows (a bucket already); 16 prompt tokens + 10 new - 1
    # = 25 positions, rounded up to the 64 of the smallest length bucket
    prompts = [[5] * plan.TOY_PROMPT_TOKENS] * 3
    for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "cuda")):
        sampler = sampling.Sampler(model.to(dtype), tok, max_new_tokens=10, decode="static")
        sampler.static.start(model, sampler.prefill(prompts), 4, 10)
        held = sum(x.numel() * x.element_size() for x in sampler.static.shape.kv.keys + sampler.static.shape.kv.values)
        t = plan.estimate(model.config, cfg, 1, device, probed=False)  # no forced answers
        assert t["kv_shape"] == (12, 64) == tuple(sampler.static.shape.kv.keys[0].shape[::2])
        assert t["KV cache"] == held
        assert t["label KV cache"] == 0


def test_log_prob_chunk_term_matches_what_a_chunk_allocates():
    """The update's LM head runs chunk by chunk, each checkpointed (grpo.logprobs_from_hidden). With
    bf16 weights, as FSDP2 gathers them, a chunk's backward holds its recomputed log-softmax, the
    gradient gather scatters into and log-softmax's own gradient at once: 3 fp32 [chunk, V]; the
    bf16 logits and their fp32 copy are gone by then. The bytes a CPU run allocates over a forward
    and backward of several chunks peak at the plan's term (the rest: the head's bf16 gradient)."""
    from grpo import logprobs_from_hidden
    from live_bytes import LiveBytes
    model = tiny.model(vocab_size=20000, hidden=8, layers=1).to(torch.bfloat16)
    cfg = dict(model="x", prompts_per_step=1, gen_batch=1, group_size=1, k=1, max_new_tokens=10,
               micro_tokens=64, grad_ckpt=True, chunk_size=128)
    term = plan.estimate(model.config, cfg, 1, "cuda", probed=False)["log-prob chunk"]
    assert term == 3 * 128 * 20000 * 4
    hidden = torch.randn(2, 257, 8, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 20000, (2, 256))
    with LiveBytes() as live:
        logp = logprobs_from_hidden(hidden, model.lm_head, targets, 0.8, 128)  # 4 chunks
        forward = live.peak
        logp.float().sum().backward()
    assert forward < 0.7 * term  # no gradient: bf16 logits + fp32 copy, or fp32 copy + log-softmax
    assert live.peak == pytest.approx(term, rel=0.03), (live.peak, term)


def test_the_7b_head_geometry_gives_56_kib_per_token():
    from transformers import Qwen2Config
    cfg = Qwen2Config(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28)
    assert plan.kv_bytes_per_token(cfg, 2) == 56 * 1024  # docs/design.md, "Scale"


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
    # rollout: 32 prompts / 8 ranks = 4 prompts x 6 samples = 24 rows; 600 + 8000 - 1 = 8599
    # positions, bucketed by 1024 above 8192: 9216; 56 KiB per token
    assert t["kv_shape"] == (24, 9216) and t["KV cache"] == 24 * 9216 * 56 * 1024
    # labels: gen_batch 8 cuts x k 4 = 32 rows; 600 + 6000 (3/4 of 8000) + 32 (suffix) + 32 (answer)
    # - 1 = 6663 positions, bucketed by 512 above 4096: 7168
    assert t["label_kv_shape"] == (32, 7168) and t["label KV cache"] == 32 * 7168 * 56 * 1024
    # host: rank 0 gathers the full fp32 model (4 N) and AdamW state (8 N) at a save; no offload
    assert t["host"] == t["host node"] == 12 * plan.param_counts(plan.model_config(FIXTURE_7B))[0]
    assert "label KV cache" in out and "host" in out


def test_one_gpu_needs_offload_and_fits_with_it(capsys):
    args = ["--model", FIXTURE_7B, "--gpus", "1", "--gpu-mem", "80", *RELEASED]
    with pytest.raises(SystemExit) as e:
        train.main(args + ["--plan"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--offload" in err, err
    t = plan.check(resolve_args(args + ["--offload"]))
    assert t["peak"] < 80 * plan.GiB and t["training state"] == 0
    # the update holds the fp32 gradients unsharded until the last micro-batch (grpo.py): 4 N,
    # 28.4 GiB; with --offload-grads host they go to the host after each micro-batch instead
    n = plan.param_counts(plan.model_config(FIXTURE_7B))[0]
    host = plan.check(resolve_args(args + ["--offload", "--offload-grads", "host"]))
    assert t["held grads"] == 4 * n and host["held grads"] == 0
    assert t["peak"] - host["peak"] == 4 * n - (host["KV cache"] + host["prefill"]) + \
        (host["FSDP gather"] + host["activations"] + host["log-prob chunk"])  # the update is the peak now
    with pytest.raises(SystemExit):  # 48 GB: the held gradients do not fit, the per-micro-batch copy does
        train.main(["--model", FIXTURE_7B, "--gpus", "1", "--gpu-mem", "48", *RELEASED, "--offload", "--plan"])
    assert "cheapest fix: --offload-grads host (peak 39.6 GiB" in capsys.readouterr().err
    # the refresh's largest group is the embedding (152,064 x 3,584, more than a layer's 233 M): one
    # buffer for its bf16 shard and gathered copy on one rank, and one fp32 shard staged from the host;
    # never the peak
    g = 152064 * 3584
    assert t["refresh"] == 2 * g * 2 + 4 * g and 4 * plan.GiB < t["refresh"] < t["held grads"]
    # the offloaded training state (16 N) plus, at a save, the full fp32 model and AdamW state (12 N)
    assert t["host"] == t["host node"] == pytest.approx(28 * 7.62e9, rel=0.01)


def test_a_start_that_cannot_fit_stops_before_loading(tmp_path, capsys, monkeypatch):
    import shutil
    monkeypatch.setattr(train, "run", lambda cfg: pytest.fail("run() must not start"))
    folder = tmp_path / "m"   # a local model (a start needs one offline): the 7B's config.json alone
    shutil.copytree(os.path.join(ROOT, "configs", "DeepSeek-R1-Distill-Qwen-7B"), folder)
    with pytest.raises(SystemExit):
        train.main(["--model", str(folder), "--gpus", "2", "--gpu-mem", "40", "--out", str(tmp_path / "r")])
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


def test_kv_terms_match_what_a_toy_step_allocates(tmp_path, monkeypatch):
    """One RL step of the toy on the static path: the plan's rollout and label K/V terms are within
    15 % of the largest static buffers each phase really allocated (recorded as they are built)."""
    from static_shapes import Shapes
    shapes = Shapes(monkeypatch)

    def phase(name, f):
        def run(*a, **kw):
            shapes.phase = name
            try:
                return f(*a, **kw)
            finally:
                shapes.phase = None
        return run
    monkeypatch.setattr(train, "generate", phase("rollout", train.generate))
    monkeypatch.setattr(train, "mc_labels", phase("label", train.mc_labels))
    # 48 new tokens, which the toy's responses fill: the plan sizes every phase for full-length responses
    args = ["--steps", "1", "--decode", "static", "--eval-n", "0", "--prompts-per-step", "4",
            "--group-size", "4", "--gen-batch", "6", "--save-every", "0", "--max-new-tokens", "48"]
    train.main(args + ["--out", str(tmp_path / "run")])
    t = plan.estimate(plan.model_config("toy"), resolve_args(args), 1, "cpu")
    for name, term in (("rollout", "KV cache"), ("label", "label KV cache")):
        measured = max(s["bytes"] for s in shapes.made if s["phase"] == name)
        assert t[term] == pytest.approx(measured, rel=0.15), (name, t[term], measured)


def test_no_static_buffers_beyond_the_label_term_sit_under_a_label_prefill(tmp_path, monkeypatch):
    """The plan's label phase holds one label chunk's static buffers beside the next chunk's prefill.
    Here the rollout's shape (64 rows x 64 positions) is larger than any label shape, so it must be
    freed before the first label prefill: the static K/V bytes alive at every prefill of the label
    phase (recorded when it runs) stay within the plan's label KV term."""
    import rollout as sampling
    from static_shapes import Shapes
    shapes, under = Shapes(monkeypatch), []
    real_prefill, real_labels = sampling.Sampler.prefill, train.mc_labels

    def prefill(self, *a, **kw):
        if shapes.phase == "label":
            under.append(sum(b for r, b in shapes.live if r() is not None))
        return real_prefill(self, *a, **kw)

    def labels(*a, **kw):
        shapes.phase = "label"
        try:
            return real_labels(*a, **kw)
        finally:
            shapes.phase = None
    monkeypatch.setattr(sampling.Sampler, "prefill", prefill)
    monkeypatch.setattr(train, "mc_labels", labels)
    args = ["--steps", "1", "--decode", "static", "--eval-n", "0", "--prompts-per-step", "4",
            "--group-size", "16", "--gen-batch", "4", "--save-every", "0", "--max-new-tokens", "48"]
    train.main(args + ["--out", str(tmp_path / "run")])
    t = plan.estimate(plan.model_config("toy"), resolve_args(args), 1, "cpu")
    rollout_bytes = next(s["bytes"] for s in shapes.made if s["phase"] is None)
    assert t["kv_shape"] == (64, 64) and rollout_bytes == t["KV cache"] > t["label KV cache"]
    assert under and max(under) <= t["label KV cache"], (max(under), t["label KV cache"])


def test_host_memory_is_printed_and_warned_about_not_refused(monkeypatch):
    """Host memory cannot be checked for another node, so the plan prints it and, planning for this
    machine, warns when a save would need more than it has; only device memory refuses a run."""
    total = plan.param_counts(plan.model_config("toy"))[0]
    lines = []
    monkeypatch.setattr(plan, "detected", lambda nproc: ("cuda", 1, 80.0))  # this machine: one GPU
    monkeypatch.setattr(plan, "host_ram", lambda: 28 * total - 1)
    t = plan.check(resolve_args(["--offload"]), show=True, log=lines.append)
    # --offload on one process: its training state on the host (16 N) and, at a save, the gathered
    # fp32 model and AdamW state (12 N)
    assert t["host"] == t["host node"] == 28 * total
    assert any(line.split()[0] == "host" for line in lines)
    assert lines[-2].startswith("warning: the plan needs") and lines[-1].startswith("fits")
    monkeypatch.setattr(plan, "host_ram", lambda: 28 * total)
    lines.clear()
    plan.check(resolve_args(["--offload"]), show=True, log=lines.append)
    assert not any(line.startswith("warning") for line in lines)


def test_the_step_frees_the_static_buffers_before_the_update(tmp_path, monkeypatch):
    """The plan counts the static K/V buffers in the decode phases only, so the RL step must free
    the shape its last decode kept (staticcache.decoder keeps it for the next call) before the update."""
    import data
    import probe as probe_lib
    import train
    import config
    from grpo import token_logprobs
    from harness import staticcache
    from harness.parallel import wrap
    cfg = config.resolve_args(["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16",
                               "--decode", "static", "--out", str(tmp_path)])
    model, tok = train.load_policy(cfg, torch.device("cpu"))
    policy, sampler = wrap(model, torch.device("cpu"), token_logprobs)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    probe = probe_lib.Probe(model.config.hidden_size)
    alive = []
    real = train.update
    monkeypatch.setattr(train, "update", lambda *a, **k: alive.append(
        staticcache.decoder(sampler, {}).shape is not None) or real(*a, **k))
    train.logged_step(1, data.load_rows("toy", split="train")[:2], train.Learner(
        policy, sampler, tok, probe, probe_lib.make_optimizer(probe, lr=cfg["probe_lr"]), opt, sched,
        torch.device("cpu")), cfg)
    assert alive == [False]


def test_every_named_model_plans_offline_from_its_shipped_config(capsys, monkeypatch):
    """No hub and no model folder: each alias's plan reads configs/NAME/config.json and prints the
    README's figures."""
    from harness.checkpoint import ALIASES
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    train.main(["--model", "deepseek-r1-distill-qwen-7b", "--plan", "--gpus", "8", "--gpu-mem", "80"])
    assert "fits: peak 52.9 of 80 GiB" in capsys.readouterr().out   # README.md, "The 7B run"
    for name in ALIASES:
        train.main(["--model", name, "--plan", "--gpus", "8", "--gpu-mem", "80"])
        assert capsys.readouterr().out.splitlines()[-1].startswith("fits: peak")


def test_the_shipped_configs_are_the_public_ones():
    """The architecture the plans read: the 7B's is its public config.json (a copy of the shared
    fixture where that exists), the 4B's the sizes Qwen3-4B-Instruct-2507 publishes."""
    from harness.checkpoint import resolve_model
    assert resolve_model("rlcm-7b") == "Melodramas/RLCM-DeepSeek-R1-Distill-Qwen-7B"
    assert resolve_model("rlcm-4b") == "Melodramas/RLCM-Qwen3-4B-Instruct"
    seven = plan.model_config("rlcm-7b")
    assert plan.model_config("deepseek-r1-distill-qwen-7b").to_dict() == seven.to_dict()
    fixture = os.path.join(ROOT, "..", "shared", "fixtures", "r1_distill_qwen_7b", "config.json")
    if os.path.isfile(fixture):
        shipped = os.path.join(ROOT, "configs", plan.SHIPPED[resolve_model("rlcm-7b")], "config.json")
        with open(fixture) as a, open(shipped) as b:
            assert a.read() == b.read()
    four = plan.model_config("qwen3-4b-instruct")
    assert (four.model_type, four.hidden_size, four.intermediate_size, four.num_hidden_layers,
            four.num_attention_heads, four.num_key_value_heads, four.head_dim, four.vocab_size,
            four.tie_word_embeddings) == ("qwen3", 2560, 9728, 36, 32, 8, 128, 151936, True)
    assert 4.0e9 < plan.param_counts(four)[0] < 4.05e9   # "4.0B" on its card, the tied embedding once
    assert plan.model_config("rlcm-4b").to_dict() == four.to_dict()


def test_the_refusal_and_the_reference_give_the_same_fixes_in_the_same_order(capsys):
    """One 80 GB GPU and the 7B: the refusal's fixes, as docs/reference.md quotes them."""
    with pytest.raises(SystemExit):
        train.main(["--model", "deepseek-r1-distill-qwen-7b", "--plan", "--gpus", "1", "--gpu-mem", "80"])
    fix = capsys.readouterr().err.strip().split("cheapest fix: ")[1]
    assert fix.startswith("--lora-rank 32 (peak 55.0 GiB") and "to keep full fine-tuning: --offload" in fix
    with open(os.path.join(ROOT, "docs", "reference.md")) as f:
        assert f'"cheapest fix: {fix}"' in " ".join(f.read().split())


def test_the_4b_recipe_on_one_80_gb_gpu(capsys):
    """Qwen3-4B-Instruct's full fine-tune (16 N = 59.9 GiB of training state) fits one 80 GB GPU with
    one prompt per generation call; its K/V is 144 KiB a token (36 layers x 8 heads x 128), 2.6x the
    7B's, so the default 8 prompts x 6 samples x 9216 positions (60.8 GiB) do not fit."""
    args = ["--model", "qwen3-4b-instruct", "--plan", "--gpus", "1", "--gpu-mem", "80"]
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith("cheapest fix: --gen-batch 1 (peak 76.1 GiB)")
    train.main(args + ["--gen-batch", "1"])
    out = capsys.readouterr().out
    assert "training state     59.94 GiB" in out and "fits: peak 76.1 of 80 GiB" in out
    assert plan.kv_bytes_per_token(plan.model_config("qwen3-4b-instruct"), 2) == 144 * 1024
