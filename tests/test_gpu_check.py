"""tests/gpu_check.py: its dry run (tiny widths on the CPU) runs every check, so the GPU check cannot
rot between GPU runs, and leaves three files in its --out; its plan runs world8 first and fits 8
minutes of one H100 with the start-up; one failing check is reported while the others still run; a
check the time box has no room for is skipped; world8's rank 0 of a fake world of 8 holds its shards
and stays within the plan."""
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import gpu_check
import label
from harness import staticcache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "..", "shared", "fixtures", "r1_distill_qwen_7b")


@pytest.mark.slow   # every check in a subprocess, three of them running train.py or evaluate.py
@pytest.mark.skipif(not os.path.isdir(FIXTURE), reason="needs the 7B config and tokenizer fixture")
def test_the_dry_run_runs_every_check_and_brings_back_three_files(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu_check.py"), "--all", "--dry-run",
                           "--config", FIXTURE, "--out", str(out)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # what comes back from a GPU machine: the JSON lines, the summary and the log; the toy runs elsewhere
    assert sorted(os.listdir(out)) == ["gpu_check.jsonl", "gpu_check.log", "gpu_check.txt"]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert (out / "gpu_check.jsonl").read_text().splitlines() == lines
    assert done.stdout.endswith((out / "gpu_check.txt").read_text())
    rows = {r["check"]: r for r in map(json.loads, lines)}
    assert list(rows) == [name for name, *_ in gpu_check.CHECKS]
    assert not [r for r in rows.values() if "error" in r or "skipped" in r]
    plan_line = gpu_check.device_plan(gpu_check.CHECKS, gpu_check.DEVICE_SECONDS - gpu_check.START_UP)[1]
    assert done.stdout.startswith(plan_line) and (out / "gpu_check.txt").read_text().splitlines()[1] == plan_line
    s = {**gpu_check.SIZES, **gpu_check.DRY}
    n_rows = s["prompts"] * s["group"]
    build = rows["build"]
    assert build["params"] == build["plan_params"] and build["vocab"] == 152064
    # one CPU process samples with the policy: the plan's copy is 0 and the fp32 weights are all it holds
    assert build["plan_gib"]["generation copy"] == 0 and build["ratio"] == pytest.approx(1.0, abs=0.01)
    assert "nccl" in build  # torch's NCCL (None on the CPU)
    roll = rows["rollout"]
    # EOS is off: every row decodes every one of its new tokens; one live length (64), its step recorded
    # once; the buffers are the plan's KV cache term to the byte
    assert roll["tokens"] == n_rows * s["rollout_new"] and roll["min_len"] == s["rollout_new"]
    assert roll["captures"] == 1 and roll["live_lengths"] == [64] and roll["kv_vs_plan"] == 1.0
    assert roll["ms_step_no_scores_warm"] > 0
    lengths = torch.linspace(s["shortest"], s["longest"], n_rows).long().tolist()
    cuts = sum(len(label.cuts_of(m)) for m in lengths)
    lab = rows["labels"]
    assert lab["forced_prompts"] == cuts and lab["features"] == cuts and lab["features_finite"]
    # one shape alive at a time, within the plan's label K/V term; each shape records a step at least
    assert lab["shapes_max_alive"] == 1 and 0 < lab["kv_vs_plan"] <= 1 and lab["captures"] >= lab["shapes_made"]
    for name in ("build", "rollout", "labels"):
        assert rows[name]["expected_gib"] > 0 and rows[name]["ratio"] > 0, name
    dec = rows["decode"]
    assert list(dec["paths"]) == ["static-sdpa", "fused", "fused-compiled"]
    for name, path in dec["paths"].items():
        # the timed call replays what its warm-up recorded; three steps of the warm-up profiled
        assert path["warm_up_captures"] >= 1 and path["captures"] == 0 and path["ms_step"] > 0, name
        assert path["top_kernels"] and all(ms > 0 for _, ms in path["top_kernels"]), name
        assert path["of_floor"] is None and path["of_copy_floor"] > 0 and path["flex_kernel"] is None, name
    # the attention that ran, named: SDPA's op on the CPU (its kernel on a GPU), flex's for the fused step
    assert "scaled_dot_product" in dec["paths"]["static-sdpa"]["attention_kernels"][0][0]
    assert all("Flex" in dec["paths"][p]["attention_kernels"][0][0] for p in ("fused", "fused-compiled"))
    # the CPU has no card bandwidth to read: the floor is the measured copy's
    assert dec["card_tbs"] is None and dec["floor_ms"]["card"] is None and dec["floor_ms"]["copy"] > 0
    fp32 = rows["fp32_tokens"]
    assert list(fp32["paths"]) == ["fused", "fused-compiled"] and fp32["finished_early"] >= 1
    for path in fp32["paths"].values():
        assert path["same_tokens"] and path["max_logprob_diff"] < 1e-4
    fsdp = rows["toy_fsdp"]
    assert [r["step"] for r in fsdp["steps"]] == [1, 2] and fsdp["checkpoint"] == "step_000002"
    assert all(r["ratio_mean"] == pytest.approx(1.0) for r in fsdp["steps"])  # one update per batch
    assert fsdp["expected_gib"] > 0 and fsdp["ratio"] > 0
    ev = rows["toy_eval"]
    assert ev["model"] == "toy" and ev["device"] == "cpu" and ev["confidence"] == "probe-posthoc"
    assert ev["n"] == 4 * 2 and ev["early_exit"] and ev["probe_val_bce"] > 0


@pytest.mark.slow   # builds the dry run's model and decodes with it
@pytest.mark.skipif(not os.path.isdir(FIXTURE), reason="needs the 7B config and tokenizer fixture")
def test_a_decode_path_that_fails_leaves_the_other_paths_numbers(tmp_path, monkeypatch):
    real = staticcache.compiled

    def no_inductor(fn, device):  # the small ops' compile fails (a GPU machine without a C compiler, say)
        if fn is not staticcache.flex_attention:
            raise RuntimeError("inductor could not compile")
        return real(fn, device)

    monkeypatch.setattr(staticcache, "compiled", no_inductor)
    monkeypatch.setattr(gpu_check, "CHECKS", [c for c in gpu_check.CHECKS if c[0] in ("build", "decode")])
    assert gpu_check.main(["--all", "--dry-run", "--config", FIXTURE, "--out", str(tmp_path)]) == 0
    dec = json.loads((tmp_path / "gpu_check.jsonl").read_text().splitlines()[1])
    assert dec["paths"]["fused-compiled"] == {"error": "RuntimeError: inductor could not compile"}
    assert all(dec["paths"][p]["ms_step"] > 0 for p in ("static-sdpa", "fused"))
    assert "== decode fused-compiled" in (tmp_path / "gpu_check.log").read_text()


@pytest.mark.slow   # builds the dry run's model sharded under a fake world of 8
@pytest.mark.skipif(not os.path.isdir(FIXTURE), reason="needs the 7B config and tokenizer fixture")
def test_world8_runs_rank_0_of_eight_within_the_plan_and_leaves_no_process_group(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "CHECKS", [c for c in gpu_check.CHECKS if c[0] == "world8"])
    assert gpu_check.main(["--all", "--dry-run", "--config", FIXTURE, "--out", str(tmp_path)]) == 0
    w8 = json.loads((tmp_path / "gpu_check.jsonl").read_text().splitlines()[0])
    assert w8["world"] == 8 and list(w8["phases"]) == ["build", "rollout", "labels", "update"]
    # rank 0 holds an eighth of the fp32 weights (4 N / 8) and of AdamW's two moments (8 N / 8): the
    # plan's training state (16 N / 8) less the gradients, freed after the step; padding rows aside
    assert w8["weights_gib"] == pytest.approx(w8["plan_state_gib"] / 4, rel=0.01)
    assert w8["adam_gib"] == pytest.approx(w8["plan_state_gib"] / 2, rel=0.01)
    # the rollout's static buffers are the plan's KV shape; the labels' widest chunk, its length
    assert w8["kv_shape"] == w8["plan_kv_shape"] and w8["label_shapes"][-1][1] == w8["plan_label_shape"][1]
    recipe = gpu_check.DRY["recipe"]
    assert w8["micro_batches"] == 1 and w8["micro_tokens"] == recipe["micro_tokens"]
    assert 0 < w8["grad_norm"] < float("inf")
    # the bf16 copy (fp32 on the CPU) is whole on every rank, beside rank 0's shard; the peak is within
    # the plan's peak less its runtime (which the CPU's bytes do not count either)
    assert w8["phases"]["build"]["peak_gib"] >= w8["plan_gib"]["generation copy"] + w8["weights_gib"]
    assert 0 < w8["ratio"] <= 1 and w8["reserved_gib"] is None  # the CPU has no allocator to reserve
    assert w8["update_tok_s"] == pytest.approx(w8["micro_tokens"] / w8["phases"]["update"]["seconds"], abs=1)
    assert not torch.distributed.is_initialized() and gpu_check.parallel.WORLD == 1


@pytest.mark.slow   # as the test above
@pytest.mark.skipif(not os.path.isdir(FIXTURE), reason="needs the 7B config and tokenizer fixture")
def test_world8_updates_where_the_fake_group_leaves_reduce_scatter_outputs_unset(tmp_path, monkeypatch):
    def unset(output, input, *args, **kwargs):  # torch 2.11's fake group: the output as it was
        output.fill_(float("nan"))  # what uninitialized memory may hold

    import torch.distributed as dist
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        monkeypatch.setattr(dist, name, unset, raising=False)
    monkeypatch.setattr(gpu_check, "CHECKS", [c for c in gpu_check.CHECKS if c[0] == "world8"])
    assert gpu_check.main(["--all", "--dry-run", "--config", FIXTURE, "--out", str(tmp_path)]) == 0
    w8 = json.loads((tmp_path / "gpu_check.jsonl").read_text().splitlines()[0])
    assert 0 < w8["grad_norm"] < float("inf") and w8["adam_gib"] > 0


def test_a_failing_check_is_one_error_line_and_the_others_still_run(tmp_path, capsys):
    def broken(ctx):
        raise ValueError("no such phase")

    checks = [("broken", broken, 0), ("needs_it", lambda ctx: {"x": ctx["model"]}, 0),
              ("fine", lambda ctx: {"value": 3, "headline": "three"}, 0)]
    rows = gpu_check.run_checks(checks, gpu_check.Context(), str(tmp_path))
    assert [r["check"] for r in rows if "error" in r] == ["broken", "needs_it"]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == rows
    line = broken.__code__.co_firstlineno + 1
    assert rows[0] == {"check": "broken", "error": f"ValueError: no such phase (at tests/test_gpu_check.py:{line})"}
    assert rows[1]["error"].startswith("RuntimeError: needs 'model' from an earlier check, which failed")
    assert rows[2] == {"check": "fine", "value": 3, "headline": "three"}
    assert (tmp_path / "gpu_check.jsonl").read_text().splitlines() == [json.dumps(r) for r in rows]
    assert "Traceback" in (tmp_path / "gpu_check.log").read_text()
    table = gpu_check.summary(rows, 12.0).splitlines()
    assert table[1].startswith("plan on one H100: ")
    assert table[4].startswith("broken") and "ERROR ValueError: no such phase" in table[4]
    assert table[6].split()[-1] == "three"


def test_a_failed_check_leaves_no_static_buffers_with_the_sampler(tmp_path, capsys):
    sampler = torch.nn.Linear(1, 1)
    d = staticcache._DECODERS[sampler] = object.__new__(staticcache.StaticDecoder)  # no model to build it from
    d.shape, d.key = SimpleNamespace(fused=None), (32, 7168)  # the labels' buffers

    def out_of_memory(ctx):
        raise torch.OutOfMemoryError("CUDA out of memory")

    rows = gpu_check.run_checks([("labels", out_of_memory, 0)], gpu_check.Context(sampler=sampler), str(tmp_path))
    assert rows[0]["error"].startswith("OutOfMemoryError") and staticcache._DECODERS[sampler].shape is None


def test_a_check_without_room_in_the_time_box_is_skipped_and_the_next_that_fits_runs(tmp_path, capsys):
    checks = [("quick", lambda ctx: {}, 1), ("long", lambda ctx: {}, 3600), ("quick_again", lambda ctx: {}, 1)]
    rows = gpu_check.run_checks(checks, gpu_check.Context(), str(tmp_path), deadline=time.monotonic() + 60)
    assert [list(r) for r in rows] == [["check"], ["check", "skipped"], ["check"]]
    assert rows[1]["skipped"].endswith("it needs about 3600 s")


def test_the_plan_runs_world8_first_and_fits_8_minutes_of_one_h100_with_its_start_up():
    names = [name for name, *_ in gpu_check.CHECKS]
    assert names[:4] == ["world8", "build", "decode", "fp32_tokens"]
    assert not {"update", "score", "toy_lora"} & set(names)  # an 80 GB H100 has no room for the first
    seconds, line = gpu_check.device_plan(gpu_check.CHECKS, gpu_check.DEVICE_SECONDS - gpu_check.START_UP)
    print(line)
    assert seconds <= gpu_check.DEVICE_SECONDS == 8 * 60 and "world8 75 + build 15 + decode 150 + fp32_tokens" in line
    # as run_checks skips: a check the box has no room for does not stop a later one that fits
    checks = [("a", None, 100), ("b", None, 300), ("c", None, 50)]
    seconds, line = gpu_check.device_plan(checks, 200)
    assert seconds == gpu_check.START_UP + 150 and line.endswith("a 100 + c 50 = 270 s of device time (4.5 of 8 min); "
                                                                 "if time is left: b 300")


def test_the_flex_kernel_inductor_chose_is_read_from_its_debug_line():
    import importlib
    import inspect
    import logging
    decoding = importlib.import_module("torch._inductor.kernel.flex.flex_decoding")  # where torch decides
    assert '"Use flex decoding %s' in inspect.getsource(decoding)
    with gpu_check.flex_kernel() as chosen:
        for use in (True, False):
            decoding.log.debug("Use flex decoding %s, force_flex_attention=%s", use, False)
    decoding.log.debug("Use flex decoding %s, force_flex_attention=%s", True, False)  # after the block: unread
    assert chosen == ["flex decoding", "flex attention"]
    assert not decoding.log.isEnabledFor(logging.DEBUG)  # the level is back


def test_the_plan_ratio_is_measured_over_the_sum_of_the_plan_terms():
    row = gpu_check.versus_plan({}, 3 * gpu_check.GiB, {"a": 1 * gpu_check.GiB, "b": 3 * gpu_check.GiB})
    assert row == {"plan_gib": {"a": 1.0, "b": 3.0}, "expected_gib": 4.0, "ratio": 0.75}


def config_folder(path):
    """What --config needs: the model's config.json and tokenizer (their contents unread here)."""
    path.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (path / name).write_text("{}")
    return str(path)


def test_the_exit_code_says_a_check_failed_and_only_three_files_are_written(tmp_path, monkeypatch):
    config, out = config_folder(tmp_path / "config"), tmp_path / "out"
    monkeypatch.setattr(gpu_check, "CHECKS", [("fine", lambda ctx: {}, 0)])
    assert gpu_check.main(["--all", "--config", config, "--out", str(out)]) == 0
    monkeypatch.setattr(gpu_check, "CHECKS", [("fine", lambda ctx: {}, 0), ("broken", lambda ctx: 1 / 0, 0)])
    assert gpu_check.main(["--all", "--config", config, "--out", str(out)]) == 1
    assert sorted(os.listdir(out)) == ["gpu_check.jsonl", "gpu_check.log", "gpu_check.txt"]


def test_the_summary_names_the_packages_it_measured_with(tmp_path, monkeypatch):
    import peft
    import transformers
    monkeypatch.setattr(gpu_check, "CHECKS", [("fine", lambda ctx: {}, 0)])
    assert gpu_check.main(["--all", "--config", config_folder(tmp_path / "config"), "--out", str(tmp_path)]) == 0
    first = (tmp_path / "gpu_check.txt").read_text().splitlines()[0]
    assert first.endswith(f"measured with torch {torch.__version__}, transformers {transformers.__version__}, "
                          f"peft {peft.__version__}"), first


def test_without_a_config_folder_the_check_says_what_to_pass_in_one_line(tmp_path, monkeypatch, capsys):
    """A user's clone has no prepared folder: --config names one holding the 7B's config.json and tokenizer."""
    monkeypatch.setattr(gpu_check, "CHECKS", [("fine", lambda ctx: {}, 0)])
    out = tmp_path / "out"
    for argv, says in [([], "error: --config DIR is needed: a folder with the model's config.json and tokenizer"),
                       (["--config", str(tmp_path)], f"error: no config.json in {tmp_path}: pass --config DIR, ")]:
        assert gpu_check.main(["--all", "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(says) and "hf download" in err[0], err
    assert not out.exists()
