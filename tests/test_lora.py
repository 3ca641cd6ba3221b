"""--lora-rank (harness/lora.py): the adapter trains on every path (one process, FSDP2 on two CPU
processes, resume after a kill), saves in peft's format, evaluates, and the memory plan counts it."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import tiny
import train
from harness import checkpoint, files, lora, plan
from config import resolve_args
from grpo import token_logprobs
from harness.files import UserError
from harness.parallel import full_state, wrap
from runs import one_line

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURE_7B = os.path.join(ROOT, "..", "shared", "fixtures", "r1_distill_qwen_7b")
RELEASED = ["--prompts-per-step", "32", "--group-size", "6", "--max-new-tokens", "8000"]
SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "40", "--eval-n", "8",
         "--eval-every", "0", "--gen-batch", "64"]
CFG = dict(lora_rank=4, lora_alpha=8.0, lora_targets="all-linear", model="toy")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONHASHSEED": "0"}


def logprobs(model, ids):
    """[1, T, V] next-token log-probs (peft's PeftModel forwards to the adapted model's logits)."""
    with torch.no_grad():
        return model(ids).logits.log_softmax(-1)


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_the_plan_counts_the_adapter_peft_trains(targets):
    model = lora.add_adapter(tiny.model(vocab_size=64, hidden=32, layers=2), dict(CFG, lora_targets=targets), "tiny")
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == plan.param_counts(model.config, targets)[3] * 4
    assert not any("lm_head" in n for n in trained)  # all-linear: the decoder's layers, not the LM head


def test_lora_lr_default_is_10x_and_a_given_lr_wins():
    assert resolve_args(["--lora-rank", "8"])["lr"] == pytest.approx(10 * resolve_args([])["lr"])
    assert resolve_args(["--lora-rank", "8", "--lr", "3e-4"])["lr"] == 3e-4
    assert resolve_args(["--model", "some/model", "--lora-rank", "32"])["lr"] == pytest.approx(1e-5)


def test_a_toy_run_without_lora_never_imports_peft(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # any `import peft` now raises ImportError
    train.main(["--steps", "1", "--out", str(tmp_path / "run"), "--save-every", "0", *SMALL])
    assert os.path.isfile(os.path.join(tmp_path, "run", "checkpoints", "step_000001", "model.safetensors"))


def adapted_bf16(hidden=32):
    """(the one-GPU policy: a bf16 tiny base with peft's fp32 adapter, lora_B as if trained; its base)."""
    import copy
    base = tiny.model(vocab_size=64, hidden=hidden, layers=2).to(torch.bfloat16)
    model = lora.add_adapter(copy.deepcopy(base), CFG, "tiny")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(n)))
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    return model, base


def test_one_gpu_samples_from_a_merged_bf16_copy():
    """wrap() on one GPU (built where the model is: no GPU needed): the generation copy is a plain
    model, no peft layer, every weight bf16, each adapted linear W + s B A. Its log-probs are no
    further from the exact policy (all fp32) than those of the unmerged bf16 policy it replaces."""
    from peft.tuners.lora import LoraLayer
    model, base = adapted_bf16()
    policy, sampler = wrap(model, torch.device("cuda"), token_logprobs)
    assert policy is model and sampler is not model and not lora.has_adapter(sampler)
    assert not any(isinstance(m, LoraLayer) for m in sampler.modules())
    assert {p.dtype for p in sampler.parameters()} == {torch.bfloat16}
    assert sorted(n for n, _ in sampler.named_parameters()) == sorted(n for n, _ in base.named_parameters())
    exact = __import__("copy").deepcopy(model).float()
    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    want = logprobs(exact, ids)
    merged, unmerged = (logprobs(m, ids).float() - want for m in (sampler, model))
    assert (logprobs(base, ids).float() - want).abs().max() > 0.1  # the adapter matters here
    assert merged.abs().max() <= 2 * unmerged.abs().max() and merged.abs().mean() <= 2 * unmerged.abs().mean()


def test_a_refresh_merges_the_trained_adapter_and_never_touches_the_base():
    from harness.parallel import refresh_sampler
    model, _ = adapted_bf16()
    policy, sampler = wrap(model, torch.device("cuda"), token_logprobs)
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    before = logprobs(sampler, ids)
    with torch.no_grad():  # an optimizer step on the adapter
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    assert torch.equal(logprobs(sampler, ids), before)  # the copy is refreshed only when asked
    refresh_sampler(sampler, policy)
    after = lora.merged_copy(model)  # a copy merged from scratch
    assert all(torch.equal(p, dict(after.named_parameters())[n]) for n, p in sampler.named_parameters())
    assert (logprobs(sampler, ids) - before).abs().max() > 1e-2
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_a_saved_adapter_loads_with_peft_and_gives_the_same_logprobs(tmp_path):
    """What a checkpoint saves (full_state, then lora.save) is peft's format: PeftModel.from_pretrained
    on the base rebuilds the trained policy's log-probs exactly; evaluation's merged model to 1e-5."""
    from peft import PeftModel
    from harness.checkpoint import load_model
    torch.manual_seed(0)
    model = checkpoint.with_adapter(load_model("toy")[0], CFG)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # as if trained: B = 0 would leave the adapted model equal to the base
    policy, _ = wrap(model, torch.device("cpu"), token_logprobs)
    sd, _ = full_state(policy, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    lora.save(str(tmp_path), model, sd)
    ids = torch.tensor([[5, 9, 3, 7, 11, 2, 40, 8]])
    base = load_model("toy")[0]
    before = logprobs(base, ids)
    loaded = PeftModel.from_pretrained(base, str(tmp_path))
    assert (logprobs(model, ids) - before).abs().max() > 1e-3  # the adapter changes the model
    assert torch.equal(logprobs(loaded, ids), logprobs(model, ids))
    merged, _ = load_model(str(tmp_path))  # evaluate.py's path: the base named in adapter_config.json
    assert not lora.has_adapter(merged)
    assert torch.allclose(logprobs(merged, ids), logprobs(model, ids), atol=1e-5)


@pytest.mark.slow   # torchrun, two processes
def test_lora_on_two_cpu_processes_equals_one(tmp_path):
    outs = {}
    for world in (1, 2):
        out = str(tmp_path / f"w{world}.pt")
        cmd = [sys.executable, os.path.join(HERE, "fsdp_lora.py"), out]
        if world > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *cmd[1:]]
        env = {**ENV, "PYTHONPATH": os.pathsep.join([ROOT, HERE]), "OMP_NUM_THREADS": "1"}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        outs[world] = torch.load(out, weights_only=True)
    one, two = outs[1]["model"], outs[2]["model"]
    assert one.keys() == two.keys() and all("lora_" in k for k in one)  # the adapter alone is saved
    init = lora.add_adapter(tiny.model(vocab_size=64, hidden=32, layers=2, seed=0), CFG, "tiny").state_dict()
    for part in ("lora_A", "lora_B"):  # both moved (lora_B starts non-zero in the script)
        assert max((one[k] - init[k]).abs().max().item() for k in one if part in k) > 1e-4, part
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5), (k, (one[k] - two[k]).abs().max())
    assert outs[1]["steps"] == outs[2]["steps"] and len(outs[1]["steps"]) == len(one)
    for r in (0, 1):  # the lean start: every rank holds rank 0's adapted model
        assert torch.load(str(tmp_path / f"w2.pt.lean{r}")) == dict(sampler=0.0, gathered=True, policy=0.0, trainable=True)
    # several ranks sample from a plain copy with the adapter merged, as one GPU does (no peft layer):
    # refreshed after the step, every merged weight has moved off the base, the frozen base is
    # untouched, and its log-probs are the sharded adapted policy's: to fp32 rounding in fp32 (the
    # CPU's copy); in bf16 (a GPU's) it is bit for bit the copy one GPU merges from the same adapter,
    # as close to the policy on average as the unmerged bf16 copy several ranks sampled from before
    for r in (0, 1):
        merged = torch.load(str(tmp_path / f"w2.pt.merged{r}"))
        assert merged["plain"] and merged["base"] and merged["moved"] > 1e-3 and merged["one GPU's"], merged
        assert merged["torch.float32"][0] < 1e-5, merged
        assert merged["torch.bfloat16"][1] < min(0.05, 1.5 * merged["unmerged bf16"][1]), merged
    # the probe: peft's init moved each rank's RNG differently, yet both ranks built and fitted the
    # same probe, the one the run's seed gives whatever was drawn before
    a, b = (torch.load(str(tmp_path / f"w2.pt.probe{r}"), weights_only=True) for r in (0, 1))
    torch.manual_seed(123)
    fresh = train.new_probe(dict(seed=3, probe_hidden=None, probe_lr=1e-2), 128)[0].state_dict()  # the toy's d
    for part in ("init", "fitted"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in fresh), part
    assert all(torch.equal(a["init"][k], fresh[k]) for k in fresh)
    assert any(not torch.equal(a["fitted"][k], fresh[k]) for k in fresh)  # the fit moved it


@pytest.mark.slow   # two 4-step train.py processes, one killed
def test_lora_resume_is_exact_after_a_kill(tmp_path):
    from safetensors.torch import load_file
    from test_train import kill_and_resume
    full, cut = kill_and_resume(tmp_path, ["--steps", "4", "--save-every", "1", "--keep", "4", "--lora-rank", "4",
                                           *SMALL], 2, ENV)
    wa, wb = (load_file(os.path.join(r, "checkpoints", "step_000004", lora.WEIGHTS)) for r in (full, cut))
    first = load_file(os.path.join(full, "checkpoints", "step_000001", lora.WEIGHTS))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], first[k]) for k in wa)  # steps 2-4 trained the adapter
    rows = [[{k: v for k, v in r.items() if not k.startswith(("t_", "tok_per_s", "peak_mem"))}
             for r in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if r["step"] >= 3] for d in (full, cut)]
    assert rows[0] == rows[1] and len(rows[0]) == 3  # steps 3, 4 and the held-out check at 4


def test_evaluate_runs_on_a_lora_run(tmp_path):
    import evaluate
    run = str(tmp_path / "run")
    train.main(["--steps", "1", "--out", run, "--lora-rank", "4", *SMALL])
    ckpt = os.path.join(run, "checkpoints", "step_000001")
    assert sorted(n for n in os.listdir(ckpt) if "adapter" in n) == [checkpoint.CONFIG, lora.WEIGHTS]
    assert not os.path.exists(os.path.join(ckpt, "model.safetensors"))  # the frozen base is not saved again
    out = str(tmp_path / "eval")
    evaluate.main(["--model", run, "--benchmarks", "toy", "--limit", "2", "--n-samples", "1", "--max-new-tokens",
                   "24", "--probe-questions", "4", "--probe-samples", "2", "--posthoc-budgets", "2", "--out", out])
    files = os.listdir(out)
    assert any(n.endswith(".json") for n in files), files


@pytest.mark.parametrize("argv, says", [
    (["--lora-rank", "4", "--lora-targets", "nothing_here"], "--lora-targets nothing_here"),
    (["--lora-rank", "-1"], "--lora-rank -1: must be >= 0"),
])
def test_bad_lora_flags_end_in_one_line(tmp_path, capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "1", "--out", str(tmp_path / "run"), *SMALL, *argv])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("Loading weights")]
    assert e.value.code == 2 and len(lines) == 1 and says in lines[0], err
    assert "Traceback" not in err


def test_lora_flags_cannot_change_on_resume(tmp_path, capsys):
    run = str(tmp_path / "run")
    train.main(["--steps", "1", "--out", run, "--lora-rank", "4", "--save-every", "0", *SMALL])
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", run, "--steps", "2", "--lora-rank", "8"])
    assert e.value.code == 2 and "--lora-rank cannot change on resume" in capsys.readouterr().err


needs_7b = pytest.mark.skipif(not os.path.isdir(FIXTURE_7B), reason="7B config fixture not present")


@needs_7b
def test_plan_7b_with_lora_32_fits_one_80_gib_gpu_without_offload(capsys):
    args = ["--model", FIXTURE_7B, "--gpus", "1", "--gpu-mem", "80", *RELEASED]
    train.main(args + ["--plan", "--lora-rank", "32"])
    out = capsys.readouterr().out
    assert "adapter state" in out and "fits: peak" in out
    t = plan.check(resolve_args(args + ["--lora-rank", "32"]))
    n, adapter = plan.param_counts(plan.model_config(FIXTURE_7B))[0], 80_740_352  # 2.52 M per unit of rank
    assert t["training state"] == 2 * n            # the frozen base in bf16, nothing else
    assert t["adapter state"] == 16 * adapter      # fp32 params, grads, AdamW: 1.2 GiB
    assert t["generation copy"] == 2 * n and t["FSDP gather"] == 0  # the merged bf16 copy
    # the label prefill: gen_batch 8 cuts x (600 + 6000 + 32) tokens, one layer's forward and their
    # cache, on the merged copy: no casts
    T = 8 * 6632
    assert t["label prefill"] == T * ((8 * 3584 + 3 * 18944) * 2 + 56 * 1024)
    assert 53 * plan.GiB < t["peak"] < 57 * plan.GiB  # 55.0: the rollout
    # without LoRA the same node names --lora-rank 32 first, then full fine-tuning's --offload
    with pytest.raises(SystemExit) as e:
        train.main(args + ["--plan"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.index("--lora-rank 32") < err.index("--offload"), err


def test_the_merged_copy_prefills_in_the_bytes_of_the_base():
    """The plan counts a prefill's layer as the base model's: true of the merged copy. Sampling with
    the fp32 adapter on the bf16 base instead casts each adapted linear's input to fp32 and sums in
    fp32, up to T x (4 in + 8 out) of its largest linear more (8 GiB in the 7B's label prefill):
    the bytes a CPU prefill allocates, at its peak, over 4 x 300 tokens."""
    from live_bytes import LiveBytes
    model, base = adapted_bf16()
    sampler = lora.merged_copy(model)
    ids = torch.randint(3, 64, (4, 300))
    peaks = []
    for m in (base, sampler, model):
        with torch.no_grad(), LiveBytes() as live:
            m.model(input_ids=ids, use_cache=True)
        peaks.append(live.peak)
    assert peaks[1] == peaks[0]
    largest = 4 * 32 + 8 * 64  # gate/up_proj: hidden 32 in, intermediate 64 out
    assert 0.75 * largest * ids.numel() < peaks[2] - peaks[0] <= largest * ids.numel()


@needs_7b
def test_plan_with_lora_on_8_gpus_shards_the_fp32_base():
    t = plan.check(resolve_args(["--model", FIXTURE_7B, "--gpus", "8", "--gpu-mem", "80", "--lora-rank", "32",
                                 *RELEASED]))
    n, adapter = plan.param_counts(plan.model_config(FIXTURE_7B))[0], 80_740_352
    assert t["training state"] == 4 * n / 8 and t["adapter state"] == 16 * adapter / 8
    assert t["generation copy"] == 2 * n  # the merged copy, as on one GPU
    assert t["host"] == 4 * n  # rank 0 reads the fp32 base; a save gathers only the adapter (12 x 81 M)


# the toy world's data for a --model folder (a folder gets the real-model defaults)
TOYW = ["--data", "toy", "--eval-data", "toy", "--max-new-tokens", "24", "--max-prompt-tokens", "0", "--instruction=",
        "--lr", "1e-3"]


@pytest.fixture(scope="module")
def lora_pair(base_run, tmp_path_factory):
    """ROOT/a (a 2-step run) and ROOT/l (a 1-step LoRA run on a, started with --model a cwd-relative)."""
    root = tmp_path_factory.mktemp("pair")
    shutil.copytree(base_run, root / "a")
    here = os.getcwd()
    os.chdir(root)
    try:
        train.main(["--model", "a", "--lora-rank", "4", "--steps", "1", "--save-every", "1", "--out", "l", *SMALL,
                    *TOYW])
    finally:
        os.chdir(here)
    return str(root)


@pytest.fixture
def pair(lora_pair, tmp_path):
    """A copy of lora_pair elsewhere (a clone moved whole): ROOT/a, ROOT/l."""
    shutil.copytree(lora_pair, tmp_path / "moved")
    return str(tmp_path / "moved")


def test_a_lora_run_resumes_on_the_base_it_was_trained_on_not_the_runs_latest(pair, capsys, monkeypatch):
    # H10: at a7c59f5 the resume loaded --model a again, now a's step 3, while its checkpoints named step 2.
    monkeypatch.chdir(pair)   # where the run was started (its config.json names --model a, cwd-relative)
    a, l = "a", "l"
    step2 = os.path.join(a, "checkpoints", "step_000002")
    train.main(["--resume", a, "--steps", "3", "--save-every", "1", "--keep", "10"])
    assert checkpoint.resolve_model(a).endswith("step_000003")
    loaded, real = [], checkpoint.load_model
    monkeypatch.setattr(checkpoint, "load_model", lambda name, *a, **k: loaded.append(name) or real(name, *a, **k))
    train.main(["--resume", l, "--steps", "2", "--save-every", "1"])
    assert [os.path.realpath(n) for n in loaded] == [os.path.realpath(step2)]
    ckpt = os.path.join(l, "checkpoints", "step_000002")
    with open(os.path.join(ckpt, "base.json")) as f:
        assert json.load(f)["identity"] == files.identity(step2)
    assert os.path.realpath(lora.base_of(ckpt)) == os.path.realpath(step2)
    shutil.rmtree(step2)   # the base pruned (--keep): one line, not the run's newer step
    capsys.readouterr()
    with pytest.raises(UserError, match=f"^{ckpt}: the base its adapter was trained on .* is gone or holds another model"):
        checkpoint.load_model(l)


def test_a_lora_checkpoint_finds_its_base_from_another_folder_and_a_moved_clone(pair, tmp_path, monkeypatch):
    # L8: at a7c59f5 the adapter recorded its base as typed ("a/checkpoints/step_000002", cwd-relative):
    # evaluated from another folder, or after the clone moved, "model directory ... does not exist".
    monkeypatch.chdir(tmp_path)
    ckpt = checkpoint.latest_checkpoint(os.path.join(pair, "l"))
    assert os.path.realpath(lora.base_of(ckpt)) == os.path.realpath(os.path.join(pair, "a", "checkpoints", "step_000002"))
    model, _ = checkpoint.load_model(os.path.join(pair, "l"))
    assert type(model).__name__ == "Qwen2ForCausalLM"


def edit_config(ckpt, **change):
    path = os.path.join(ckpt, checkpoint.CONFIG)
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(change)
    for k in [k for k, v in change.items() if v is None]:
        del cfg[k]
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


DAMAGE = {   # what is done to adapter_config.json (an older checkpoint's: no base.json), the line's words
    "base is itself": (lambda c: edit_config(c, base_model_name_or_path=os.path.abspath(c)), "is an adapter checkpoint"),
    "no base": (lambda c: edit_config(c, base_model_name_or_path=None), "names no base model"),
    "not JSON": (lambda c: open(os.path.join(c, checkpoint.CONFIG), "w").write("{bad"), "cannot be read (Expecting"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_adapter_config_is_one_line_naming_it(pair, case, monkeypatch):
    # M7 (base is itself: RecursionError; no base: KeyError) and L4 (not JSON: "Expecting property
    # name ..." naming no file) at a7c59f5.
    monkeypatch.chdir(pair)   # where the run was started: its cwd-relative base resolves (L8 aside)
    ckpt = checkpoint.latest_checkpoint("l")
    if os.path.exists(os.path.join(ckpt, "base.json")):   # as an older version saved it
        os.remove(os.path.join(ckpt, "base.json"))
    damage, words = DAMAGE[case]
    damage(ckpt)
    with pytest.raises(UserError) as e:
        checkpoint.load_model(ckpt)
    assert str(e.value).startswith(os.path.join(ckpt, checkpoint.CONFIG)) and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_lora_on_a_tied_layer_is_refused_before_training(tmp_path, capsys):
    # M8: at a7c59f5 --lora-targets lm_head trained on the toy (tied embeddings), and evaluate.py's merge
    # changed the input embedding too (logits off by up to 2.3 from the trained policy).
    with pytest.raises(SystemExit) as e:
        train.main(["--lora-rank", "4", "--lora-targets", "lm_head", "--steps", "1", "--out", str(tmp_path / "r"),
                    *SMALL])
    assert e.value.code == 2
    line = one_line(capsys)
    assert line.startswith("error: --lora-targets lm_head: lm_head shares its weight with another layer"), line
    assert not os.path.exists(tmp_path / "r")


def test_an_adapter_on_a_tied_layer_is_evaluated_as_it_was_trained(tmp_path):
    # M8 (evaluation): at a7c59f5 loading a checkpoint (checkpoint.load_model today) merged an lm_head adapter
    # into the weight the input embedding shares: logits off by up to 2.32 from the policy that was trained.
    import torch
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    base, tok = checkpoint.load_model("toy")
    policy = lora.add_adapter(base, dict(lora_rank=4, lora_alpha=32.0, lora_targets="lm_head"),
                              checkpoint.resolve_model("toy"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)   # a trained adapter (lora_B starts at zero)
    lora.save(ckpt, policy, {n: p for n, p in policy.named_parameters() if p.requires_grad})
    tok.save_pretrained(ckpt)
    evaluated, _ = checkpoint.load_model(ckpt)
    ids = torch.tensor([tok.encode("3+4+2=")])
    with torch.no_grad():
        diff = (policy.eval()(ids).logits - evaluated.eval()(ids).logits).abs().max().item()
    assert diff < 1e-5, diff


@pytest.mark.parametrize("change, words", [(dict(r=60000), "rank 60000 on model.layers.0."),
                                           (dict(r=0), "rank r 0 is no positive integer")])
def test_an_adapter_whose_rank_does_not_fit_is_refused_before_anything_is_built(pair, change, words,
                                                                              monkeypatch):
    """r 60000 in adapter_config.json built the adapter (2.6 GB on the toy) before peft refused it."""
    monkeypatch.chdir(pair)
    ckpt = checkpoint.latest_checkpoint("l")
    edit_config(ckpt, **change)
    import peft
    monkeypatch.setattr(peft.PeftModel, "from_pretrained", lambda *a, **k: pytest.fail("an adapter was built"))
    with pytest.raises(UserError) as e:
        checkpoint.load_model(ckpt)
    assert str(e.value).startswith(f"{ckpt}: its adapter does not fit its base (") and words in str(e.value)
