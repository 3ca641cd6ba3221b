"""The RL loop end to end on the toy world: run directory, resume, errors, the grpo switch."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import config
import data
import toy
import train
from harness import checkpoint, files
from runs import ENV, SMALL, jsonl, metric_rows, one_line, sigint_default, snapshot, train_py, write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOLATILE = ("t_", "tok_per_s", "peak_mem")  # metrics.jsonl fields that vary between identical runs
FIXTURE_7B = os.path.join(ROOT, "..", "shared", "fixtures", "r1_distill_qwen_7b")
STEP_FIELDS = {"step", "accuracy", "reward", "margin", "signal_frac", "probe_bce", "probe_ece",
               "zero_var_frac", "len_mean", "len_max", "trunc_frac", "clip_frac", "kl", "grad_norm",
               "lr", "t_rollout", "t_label", "t_score", "t_probe", "t_update", "tok_per_s", "peak_mem", "captures"}


def rows(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def stable(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def test_two_steps_write_a_complete_run(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import probe as probe_lib
    run = str(tmp_path / "run")
    train.main(["--steps", "2", "--out", run, "--save-every", "1", *SMALL])
    cfg = json.load(open(os.path.join(run, "config.json")))
    assert cfg["steps"] == 2 and cfg["reward"] == "rlcm" and cfg["lam"] == 1.0   # the toy's (docs/toy-world.md)
    logged = rows(run)
    steps = [r for r in logged if not r.get("eval")]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert STEP_FIELDS <= set(r), STEP_FIELDS - set(r)
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["signal_frac"] <= 1
    assert [r["step"] for r in logged if r.get("eval")] == [0, 2]
    ckpts = sorted(os.listdir(os.path.join(run, "checkpoints")))
    assert ckpts == ["run", "step_000001", "step_000002"]   # run: whose checkpoints they are
    last = os.path.join(run, "checkpoints", "step_000002")
    model = AutoModelForCausalLM.from_pretrained(last)
    assert AutoTokenizer.from_pretrained(last).eos_token_id is not None
    probe, opt_state = probe_lib.load(os.path.join(last, "probe.pt"))
    assert probe(torch.zeros(1, model.config.hidden_size)).shape[0] == 1 and opt_state is not None


def test_grpo_reward_runs_no_forced_answers(tmp_path, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("--reward grpo must not generate forced answers")
    import label
    monkeypatch.setattr(label, "last_layer", forbidden)  # no trajectory to prefill: no cut to ask at
    run = str(tmp_path / "run")
    train.main(["--steps", "1", "--out", run, "--reward", "grpo", *SMALL])
    (row,) = [r for r in rows(run) if not r.get("eval")]
    assert row["reward"] == pytest.approx(2 * row["accuracy"] - 1)  # signed correctness, nothing else
    assert "probe_bce" not in row


def kill_and_resume(tmp_path, flags, kill_after, env):
    """(full, cut): `python train.py FLAGS` run whole into tmp_path/full, and into tmp_path/cut killed
    (SIGKILL) once its checkpoint of step `kill_after` exists, then continued with --resume."""
    args = [sys.executable, os.path.join(ROOT, "train.py"), *flags]
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    subprocess.run(args + ["--out", full], check=True, env=env, cwd=ROOT, capture_output=True)
    proc = subprocess.Popen(args + ["--out", cut], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    saved = os.path.join(cut, "checkpoints", f"step_{kill_after:06d}")
    deadline = time.time() + 300
    while not os.path.isdir(saved) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.isdir(saved), f"the run should have reached step {kill_after} before the kill"
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--resume", cut], check=True,
                   env=env, cwd=ROOT, capture_output=True)
    return full, cut


@pytest.mark.slow   # two 6-step train.py processes, one killed
def test_resume_is_exact_after_a_kill(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    full, cut = kill_and_resume(tmp_path, ["--steps", "6", "--save-every", "1", *SMALL], 3, env)
    a = [stable(r) for r in rows(full) if not r.get("eval") and r["step"] >= 4]
    b = [stable(r) for r in rows(cut) if not r.get("eval") and r["step"] >= 4]
    assert [r["step"] for r in a] == [4, 5, 6] and a == b
    from safetensors.torch import load_file
    wa = load_file(os.path.join(full, "checkpoints", "step_000006", "model.safetensors"))
    wb = load_file(os.path.join(cut, "checkpoints", "step_000006", "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_nan_loss_stops_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    run = str(tmp_path / "run")
    train.main(["--steps", "1", "--out", run, "--save-every", "1", *SMALL])
    good = os.path.join(run, "checkpoints", "step_000001")
    before = open(os.path.join(good, "model.safetensors"), "rb").read()
    import grpo as update
    real = update.policy_loss
    monkeypatch.setattr(update, "policy_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), real(*a, **k)[1]))
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", run, "--steps", "3"])
    assert e.value.code != 0 and "non-finite loss" in capsys.readouterr().err
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["run", "step_000001"]
    assert open(os.path.join(good, "model.safetensors"), "rb").read() == before


def write_jsonl(path, items):
    with open(path, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in items)
    return str(path)


@pytest.mark.parametrize("case", ["bad-model", "no-weights", "no-answer-field", "empty-data", "no-resume"])
def test_user_errors_end_in_one_line(tmp_path, capsys, case):
    argv = {
        "bad-model": ["--model", "no-such-org/no-such-model-xyz"],
        "no-weights": ["--model", FIXTURE_7B, "--data", write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1", "answer": "2"}])],
        "no-answer-field": ["--data", write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1", "result": "2"}])],
        "empty-data": ["--data", write_jsonl(tmp_path / "d.jsonl", [])],
        "no-resume": ["--resume", str(tmp_path / "nowhere")],
    }[case]
    with pytest.raises(SystemExit) as e:
        train.main(argv + ["--out", str(tmp_path / "run"), "--steps", "1", "--eval-data", "toy"])
    err = capsys.readouterr().err.strip()
    assert e.value.code != 0
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "Traceback" not in err, err


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    from transformers import AutoModelForCausalLM
    from grpo import pack, policy_loss, token_logprobs
    path = toy.BASE_DIR
    ids = [[1, 5, 6, 7], [1, 8, 9]]
    batch = pack(ids, [[10, 11, 12], [13, 14]], pad_id=0)
    adv = torch.tensor([1.0, -1.0])
    grads, losses = [], []
    for ckpt in (False, True):
        model = AutoModelForCausalLM.from_pretrained(path)
        if ckpt:
            train.checkpoint_activations(model)
        model.train()
        logp = token_logprobs(model, batch["input_ids"], batch["attention_mask"], 0.8, 4)
        loss, _ = policy_loss(logp, logp.detach(), adv, batch["loss_mask"])
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert losses[0] == pytest.approx(losses[1], abs=1e-7)
    assert grads[0].abs().sum() > 0 and torch.allclose(grads[0], grads[1], atol=1e-7)


@pytest.mark.parametrize("model, fetched", [("deepseek-r1-distill-qwen-7b", ["deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"]),
                                            ("toy", []), ("local", [])])
def test_the_launcher_downloads_a_hub_model_once_before_starting_workers(tmp_path, monkeypatch, model, fetched):
    """Otherwise rank 0 downloads the weights (15 GB for the 7B) inside the process group while the
    other ranks wait in NCCL's set-up; a local directory or the toy has nothing to fetch."""
    import huggingface_hub
    if model == "local":
        model = str(tmp_path / "model")
        os.makedirs(model)
    events = []
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **k: events.append(("fetch", repo)))
    monkeypatch.setattr(train.plan, "check", lambda cfg, **k: None)  # would read the config
    monkeypatch.setattr(train, "worker_count", lambda cfg: 2)
    monkeypatch.setattr(train, "launch", lambda *a, **k: events.append("launch") or 0)
    train.main(["--model", model, "--out", str(tmp_path / "run"), "--steps", "1", "--prompts-per-step", "2"])
    assert events == [("fetch", repo) for repo in fetched] + ["launch"]


def test_a_torchrun_worker_refuses_fewer_prompts_than_ranks(tmp_path, monkeypatch, capsys):
    """Under torchrun (RANK and WORLD_SIZE set) every worker refuses before the process group exists."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(train, "WORLD", 4, raising=False)  # parallel read WORLD_SIZE at import
    with pytest.raises(SystemExit) as e:
        train.main(["--prompts-per-step", "3", "--steps", "1", "--out", str(tmp_path / "run"), *SMALL[2:]])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: --prompts-per-step 3 ") and "--prompts-per-step >= 4" in err, err
    assert not os.path.exists(tmp_path / "run")


def test_every_rank_takes_rank_0s_view_of_the_run_folder(tmp_path, monkeypatch):
    """Whether OUT exists decides when the lock's collective runs (before or after loading): a rank
    that saw it differently (rank 0's tracker makes OUT soon after) would mismatch collectives."""
    events = []

    class Stop(Exception):
        pass

    def lock(out):
        events.append("lock")
        raise Stop
    monkeypatch.setattr(checkpoint, "all_gather", lambda obj: [True])  # rank 0 saw the folder; this rank does not
    monkeypatch.setattr(checkpoint, "hold_lock", lock)
    monkeypatch.setattr(train.data, "load_rows", lambda *a, **k: events.append("load") or [])
    cfg = config.resolve_args(["--steps", "1", "--out", str(tmp_path / "run"), *SMALL])
    with pytest.raises(Stop):
        train.run(cfg)
    assert events == ["lock"]


def test_every_step_row_has_the_sampler_gap_and_the_rollout_entropy(tmp_path):
    """On the CPU toy the sampler is the fp32 policy itself, so the gap is float noise; the entropy
    is a mean over the rollout's tokens, between 0 and log(vocabulary)."""
    import math
    from transformers import AutoTokenizer
    run = str(tmp_path / "run")
    train.main(["--steps", "2", "--eval-n", "0", "--out", run, "--prompts-per-step", "2", "--group-size", "2",
                "--max-new-tokens", "16"])
    steps = [r for r in rows(run) if not r.get("eval")]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["sampler_gap"] < 1e-5 and r["sampler_kl_k3"] < 1e-8 and abs(r["sampler_ratio_max"] - 1) < 1e-4
        assert 0 < r["entropy"] < math.log(len(AutoTokenizer.from_pretrained(toy.BASE_DIR)))


def test_a_local_model_folder_on_cpu_runs_on_one_thread_like_the_toy(tmp_path, monkeypatch):
    # A model folder (here the toy's own, by path) used to keep torch's threads on a CPU: a step of
    # the toy's size then ran about 10x slower unless OMP_NUM_THREADS=1 was set by hand.

    class Loaded(Exception):
        pass

    def stop(*a, **k):
        raise Loaded
    monkeypatch.setattr(train, "RunFolder", stop)   # stop right after the device and threads are set
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(Loaded):
            train.main(["--model", toy.BASE_DIR, "--data", "toy", "--eval-data", "toy", "--grader", "math",
                        "--instruction=", "--max-prompt-tokens", "0", "--steps", "1", "--out", str(tmp_path / "run")])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def error_lines(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [x for x in err.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("Loading weights")]


def test_a_new_run_that_finds_another_in_its_folder_refuses_and_leaves_it(tmp_path, monkeypatch, capsys):
    """Two new runs given one --out: run A starts and ends while B loads its data (made certain here:
    B's first data.load_rows runs A to the end). B takes the free lock, finds A's files, and stops."""
    run, real, first = str(tmp_path / "run"), train.data.load_rows, {}

    def a_runs_meanwhile(*a, **k):
        if not first:
            first["A"] = None
            train.main(["--steps", "1", "--save-every", "1", "--out", run, *SMALL])
            first["A"] = snapshot(run)
            capsys.readouterr()
        return real(*a, **k)
    monkeypatch.setattr(train.data, "load_rows", a_runs_meanwhile)
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "1", "--save-every", "1", "--seed", "7", "--out", run, *SMALL])
    (err,) = error_lines(capsys)
    assert e.value.code == 2 and err.startswith(f"error: {run} was taken by another run while this one loaded"), err
    assert f"--resume {run}" in err
    assert {"config.json", "metrics.jsonl", os.path.join("checkpoints", "step_000001", "model.safetensors"),
            os.path.join("checkpoints", "step_000001", "state.pt")} <= set(first["A"])
    assert snapshot(run) == first["A"]   # A's config (seed 0), logs and step 1, byte for byte


def test_a_resume_on_changed_data_refuses_in_one_line(tmp_path, capsys):
    import hashlib
    import data
    problems = data.load_rows("toy", split="train")[:16]
    path = write_jsonl(tmp_path / "d.jsonl", problems)
    run = str(tmp_path / "run")
    train.main(["--steps", "1", "--out", run, "--data", path, "--eval-data", "toy", *SMALL])
    with open(path, "rb") as f:
        assert json.load(open(os.path.join(run, "config.json")))["data_sha256"] == hashlib.sha256(f.read()).hexdigest()
    before = snapshot(run)
    write_jsonl(path, problems[::-1])   # the same problems in another order: the saved cursor means other rows
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", run, "--steps", "2"])
    (err,) = error_lines(capsys)
    assert e.value.code == 2 and err.startswith(f"error: --resume {run}: {path} changed since the run began"), err
    assert "put the run's data back, or start a new run with another --out" in err
    assert snapshot(run) == before


EVIL = """import os
open(os.environ["RLCM_MARKER"], "w").write("ran")
from transformers import Qwen2ForCausalLM


class EvilForCausalLM(Qwen2ForCausalLM):
    pass
"""


@pytest.mark.slow   # train.py in a subprocess
def test_trust_remote_code_is_never_taken_from_a_saved_config(run_copy, tmp_path):
    cfg_path = os.path.join(run_copy, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["trust_remote_code"] = True
    json.dump(cfg, open(cfg_path, "w"))
    for ckpt in checkpoint.checkpoints(run_copy):
        with open(os.path.join(ckpt, "modeling_evil.py"), "w") as f:
            f.write(EVIL)
        c = json.load(open(os.path.join(ckpt, "config.json")))
        c["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
        json.dump(c, open(os.path.join(ckpt, "config.json"), "w"))
    marker = tmp_path / "marker"
    ENV.update(RLCM_MARKER=str(marker), HF_MODULES_CACHE=str(tmp_path / "modules"))
    try:
        r = train_py("--resume", run_copy, "--steps", "3")
        assert r.returncode == 2 and not marker.exists()
        err = r.stderr.strip()
        assert len(err.splitlines()) == 1 and "--trust-remote-code" in err and "Traceback" not in err, err
        r = train_py("--resume", run_copy, "--steps", "3", "--trust-remote-code")
        assert r.returncode == 0, r.stderr[-2000:]
        assert marker.read_text() == "ran"   # allowed when the flag is given now
    finally:
        ENV.pop("RLCM_MARKER"), ENV.pop("HF_MODULES_CACHE")
    assert json.load(open(cfg_path))["trust_remote_code"] is True


def test_resume_drops_a_cut_off_metrics_line(run_copy, capsys):
    with open(os.path.join(run_copy, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "accur')
    train.main(["--resume", run_copy, "--steps", "3"])
    assert "dropped a cut-off last line" in capsys.readouterr().err
    assert [r["step"] for r in metric_rows(run_copy) if not r.get("eval")] == [1, 2, 3]


def test_resume_skips_a_checkpoint_without_state_pt(run_copy, capsys):
    os.remove(os.path.join(run_copy, "checkpoints", "step_000002", "state.pt"))
    train.main(["--resume", run_copy, "--steps", "2"])
    out = capsys.readouterr()
    assert "skipping incomplete checkpoint" in out.out + out.err and "missing state.pt" in out.out + out.err
    assert "resuming" in out.out and "from step 1" in out.out
    steps = [r["step"] for r in metric_rows(run_copy) if not r.get("eval")]
    assert steps == [1, 2]   # step 2 was logged again, once
    assert checkpoint.missing(os.path.join(run_copy, "checkpoints", "step_000002"), resume=True) == []


def test_resume_with_a_truncated_latest_safetensors_falls_back(run_copy, capsys):
    path = os.path.join(run_copy, "checkpoints", "step_000002", "model.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    assert checkpoint.missing(os.path.dirname(path)) == ["model.safetensors (cut short)"]
    train.main(["--resume", run_copy, "--steps", "2"])
    assert "from step 1" in capsys.readouterr().out


def test_resume_applies_and_records_changed_lr_and_steps(run_copy, capsys):
    train.main(["--resume", run_copy, "--steps", "3", "--lr", "1e-3"])
    printed = capsys.readouterr().out
    assert "changed on resume" in printed and f"lr {config.TOY['lr']} -> 0.001" in printed and "steps 2 -> 3" in printed
    cfg = json.load(open(os.path.join(run_copy, "config.json")))
    assert cfg["steps"] == 3 and cfg["lr"] == 1e-3 and cfg["resume"] is None
    (row,) = [r for r in metric_rows(run_copy) if r["step"] == 3 and not r.get("eval")]
    assert row["lr"] == pytest.approx(1e-3)   # warm-up (3 steps) is over at step 3: the new rate in full
    # a plain --resume later remembers both
    train.main(["--resume", run_copy])
    assert "at step 3 already (--steps 3): nothing to train" in capsys.readouterr().out


def test_resume_applies_a_changed_weight_decay_over_the_restored_optimizers(run_copy):
    """The optimizer state restored from state.pt holds the decay it was saved with (the toy's 0.0);
    --weight-decay given with --resume replaces it, as --lr replaces the rate."""
    train.main(["--resume", run_copy, "--steps", "3", "--weight-decay", "0.05"])
    assert json.load(open(os.path.join(run_copy, "config.json")))["weight_decay"] == 0.05
    latest = checkpoint.latest_checkpoint(run_copy)
    state = torch.load(os.path.join(latest, "state.pt"), weights_only=True)
    assert latest.endswith("3") and [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.05]


def test_resume_lr_during_warmup_is_scaled_like_the_rest(run_copy, capsys):
    shutil.rmtree(os.path.join(run_copy, "checkpoints", "step_000002"))
    train.main(["--resume", run_copy, "--steps", "2", "--lr", "3e-3"])
    (row,) = [r for r in metric_rows(run_copy) if r["step"] == 2 and not r.get("eval")]
    assert row["lr"] == pytest.approx(3e-3 * 2 / 3)   # warm-up 3: factor (1 + 1) / 3 at the second step


def test_save_every_0_saves_at_the_end_and_eval_n_0_evaluates_nothing(tmp_path):
    run = str(tmp_path / "run")
    train.main(["--steps", "2", "--out", run, *SMALL, "--save-every", "0", "--eval-n", "0"])
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["run", "step_000002"]
    assert [r["step"] for r in metric_rows(run)] == [1, 2]   # no held-out rows


def test_steps_0_does_nothing_and_says_so(tmp_path, capsys):
    train.main(["--steps", "0", "--out", str(tmp_path / "run")])
    assert "--steps 0: nothing to train" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "run")


def refused_pickle(run):
    ckpt = checkpoint.latest_checkpoint(run)
    torch.save({"step": 2, "hook": os.system}, os.path.join(ckpt, "state.pt"))   # a global: refused
    return ["--resume", run, "--steps", "3"]


def truncated_model(tmp_path):
    model = str(tmp_path / "model")
    shutil.copytree(toy.BASE_DIR, model)
    path = os.path.join(model, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    return ["--model", model, "--data", "toy", "--eval-data", "toy"]


TRAIN_CASES = {   # name: (argv from (tmp_path, run_copy), words in the one line)
    "group-size 1": (lambda t, r: ["--group-size", "1"], "--group-size 1: must be >= 2"),
    "group-size 0": (lambda t, r: ["--group-size", "0"], "--group-size 0: must be >= 2"),
    "prompts-per-step 0": (lambda t, r: ["--prompts-per-step", "0"], "--prompts-per-step 0: must be >= 1"),
    "prompts-per-step -3": (lambda t, r: ["--prompts-per-step", "-3"], "--prompts-per-step -3: must be >= 1"),
    "k 0": (lambda t, r: ["--k", "0"], "--k 0: must be >= 1"),
    "max-new-tokens 0": (lambda t, r: ["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    "lr nan": (lambda t, r: ["--lr", "nan"], "--lr nan: must be > 0"),
    "lr -1": (lambda t, r: ["--lr", "-1"], "--lr -1.0: must be > 0"),
    "temperature 0": (lambda t, r: ["--temperature", "0"], "--temperature 0.0: must be > 0"),
    "top-p 1.5": (lambda t, r: ["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    "save-every -1": (lambda t, r: ["--save-every", "-1"], "--save-every -1: must be >= 0"),
    "eval-n -1": (lambda t, r: ["--eval-n", "-1"], "--eval-n -1: must be >= 0"),
    "keep 0": (lambda t, r: ["--keep", "0"], "--keep 0: must be >= 1"),
    "out is a file": (lambda t, r: ["--out", write(t / "f", "x")], "is a file, not a folder"),
    "out not writable": (lambda t, r: ["--out", "/proc/1/run"], "is not writable"),
    "broken config.json": (lambda t, r: ["--resume", os.path.dirname(write(os.path.join(r, "config.json"), "{broken"))],
                           "config.json is unreadable (JSONDecodeError"),
    "truncated safetensors": (lambda t, r: truncated_model(t), "weights file is damaged"),
    "corrupt parquet": (lambda t, r: ["--data", write(t / "d.parquet", b"PAR1 not really")],
                        "is not a readable parquet file"),
    "non-UTF-8 data": (lambda t, r: ["--data", write(t / "d.jsonl", b'{"problem": "\xff\xfe", "answer": "1"}\n')],
                       "is not UTF-8 text (byte 0xff at offset 13)"),
    "data is a folder": (lambda t, r: ["--data", str(t)], "file not found"),
    "mistyped extension": (lambda t, r: ["--data", str(t / "train.jsnol")], "file not found"),
    "missing model dir": (lambda t, r: ["--model", str(t / "no-model")], "model directory"),
    "missing HF model": (lambda t, r: ["--model", "no-such-org/no-such-model-xyz"],
                         "not in the local Hugging Face cache"),
    "100,000-char prompt": (lambda t, r: ["--data", jsonl(t / "d.jsonl", [{"problem": "1" * 100_000, "answer": "1"}])],
                            "do not fit the model's context of 256 tokens (row 0"),
    "refused pickle": (lambda t, r: refused_pickle(r), "was not loaded (that could run code)"),
    "seed changed on resume": (lambda t, r: ["--resume", r, "--seed", "7"], "--seed cannot change on resume"),
}


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_refuses_in_one_line_and_makes_no_folder(case, tmp_path, run_copy, capsys):
    make, words = TRAIN_CASES[case]
    argv = make(tmp_path, run_copy)
    resume = "--resume" in argv
    before = snapshot(run_copy)
    out = [] if resume or "--out" in argv else ["--out", str(tmp_path / "new")]
    with pytest.raises(SystemExit) as e:
        train.main(argv + out + ["--steps", "3"])
    err = one_line(capsys)
    assert e.value.code == 2 and err.startswith("error: ") and words in err, err
    assert "weights_only" not in err
    assert not os.path.exists(tmp_path / "new")
    if resume:
        assert snapshot(run_copy) == before


@pytest.mark.slow   # train.py killed and resumed
def test_ctrl_c_keeps_the_last_checkpoint_and_prints_the_resume_command(tmp_path):
    run = str(tmp_path / "run")
    args = [sys.executable, os.path.join(ROOT, "train.py"), "--steps", "40", "--save-every", "1", *SMALL]
    proc = subprocess.Popen(args + ["--out", run], env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    first = os.path.join(run, "checkpoints", "step_000001")
    deadline = time.time() + 300
    while not os.path.isdir(first) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("interrupted:")
    assert f"continue with: python train.py --resume {run}" in last
    ckpts = checkpoint.checkpoints(run)
    assert ckpts and all(checkpoint.missing(c, resume=True) == [] for c in ckpts)
    assert not os.path.exists(os.path.join(run, files.LOCK))
    n = checkpoint.step_of(ckpts[-1]) + 1
    r = train_py("--resume", run, "--steps", str(n))
    assert r.returncode == 0, r.stderr[-2000:]
    assert [x["step"] for x in metric_rows(run) if not x.get("eval")] == list(range(1, n + 1))


def test_a_resumed_run_prints_the_held_out_line_with_the_start_from_its_log(run_copy, capsys):
    start = [r["eval_accuracy"] for r in metric_rows(run_copy) if r.get("eval") and r["step"] == 0]
    train.main(["--resume", run_copy, "--steps", "3"])
    end = [r["eval_accuracy"] for r in metric_rows(run_copy) if r.get("eval") and r["step"] == 3]
    assert len(start) == len(end) == 1
    line = f"held-out accuracy: {start[0]:.3f} at the start -> {end[0]:.3f} at step 3\n"
    assert line in capsys.readouterr().out


def test_a_resume_on_another_held_out_set_says_its_last_line_compares_two_sets(run_copy, tmp_path, capsys):
    # red team 5, case 15: "A at the start -> B" compared the start's 8 problems with 4, or another file's
    other_file = jsonl(tmp_path / "held.jsonl", data.load_rows("toy", split="train", limit=8))
    for step, flags in ((3, ["--eval-n", "4"]), (4, ["--eval-n", "8", "--eval-data", other_file]), (5, [])):
        train.main(["--resume", run_copy, "--steps", str(step), *flags])
        (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("held-out accuracy:")]
        assert line.endswith(f"at step {step} (two different held-out sets: --eval-n or --eval-data changed "
                             "on resume)"), line   # at step 5 too: 8 problems as at the start, but other ones
