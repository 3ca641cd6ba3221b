"""tests/gpu_check.py: its dry run (tiny widths on the CPU) runs every check, so the GPU check cannot
rot between GPU runs; and one failing check is reported while the others still run."""
import json
import os
import subprocess
import sys

import pytest
import torch

import gpu_check
import label

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "..", "shared", "fixtures", "r1_distill_qwen_7b")


@pytest.mark.slow   # every check in a subprocess
@pytest.mark.skipif(not os.path.isdir(FIXTURE), reason="needs the 7B config and tokenizer fixture")
def test_the_dry_run_runs_every_check_and_prints_one_json_line_each(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu_check.py"), "--all", "--dry-run",
                           "--config", FIXTURE, "--out", str(out)], capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "gpu_check.jsonl").read_text().splitlines() == lines
    rows = {r["check"]: r for r in map(json.loads, lines)}
    assert list(rows) == [name for name, _ in gpu_check.CHECKS]
    assert not [r for r in rows.values() if "error" in r or "skipped" in r]
    s = {**gpu_check.SIZES, **gpu_check.DRY}
    n_rows = s["prompts"] * s["group"]
    assert rows["build"]["params"] == rows["build"]["plan_params"]
    assert rows["build"]["vocab"] == 152064
    # EOS is off: every row decodes every one of its new tokens
    assert rows["rollout"]["tokens"] == n_rows * s["new"] and rows["rollout"]["min_len"] == s["new"]
    # the second rollout (the next step's) replays the first one's steps: 16 + 15 positions live at
    # most, one live length (64)
    assert rows["rollout"]["captures"] == [1, 0] and rows["rollout"]["live_lengths"] == [64]
    assert rows["rollout"]["same_samples"] and rows["rollout"]["empty_cache_calls"] == 0
    lengths = torch.linspace(s["shortest"], s["new"], n_rows).long().tolist()
    cuts = sum(len(label.budgets(m)) for m in lengths)
    lab = rows["labels"]
    assert lab["forced_prompts"] == cuts and lab["features"] == rows["score"]["features"] == cuts
    assert lab["features_finite"]
    # the last shape is kept with the model for the next call of its shape
    assert lab["shapes_max_alive"] == 1 <= lab["shapes_made"] and lab["shapes_alive_after"] == 1
    assert "KV cache" in lab["plan_gib"] and "peak" in rows["update"]["plan_gib"]
    assert rows["score"]["finite"] and 0 < rows["update"]["grad_norm"] < float("inf")
    dec = rows["decode"]
    assert dec["static"]["tokens"] == dec["static-full"]["tokens"] == dec["dynamic"]["tokens"] == n_rows * s["new"]
    assert dec["static"]["full_bytes"] >= 1 and dec["static-full"]["mb_step"] >= dec["static"]["mb_step"]
    assert dec["generate"]["vs_generate"] == 1.0 and dec["static"]["floor_ms"] > 0
    toy = rows["toy_fsdp"]
    assert [r["step"] for r in toy["steps"]] == [1, 2] and toy["checkpoint"] == "step_000002"
    assert all(r["ratio_mean"] == pytest.approx(1.0) for r in toy["steps"])  # one update per batch


def test_a_failing_check_is_one_error_line_and_the_others_still_run(tmp_path, capsys):
    def broken(ctx):
        raise ValueError("no such phase")

    checks = [("broken", broken), ("needs_it", lambda ctx: {"x": ctx["model"]}),
              ("fine", lambda ctx: {"value": 3})]
    assert gpu_check.run_checks(checks, gpu_check.Context(), str(tmp_path)) == ["broken", "needs_it"]
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    line = broken.__code__.co_firstlineno + 1
    assert rows[0] == {"check": "broken", "error": f"ValueError: no such phase (at tests/test_gpu_check.py:{line})"}
    assert rows[1]["error"].startswith("RuntimeError: needs 'model' from an earlier check, which failed")
    assert rows[2] == {"check": "fine", "value": 3}
    assert (tmp_path / "gpu_check.jsonl").read_text().splitlines() == [json.dumps(r) for r in rows]
    assert "Traceback" in (tmp_path / "gpu_check.log").read_text()


def test_the_exit_code_says_a_check_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "CHECKS", [("fine", lambda ctx: {})])
    assert gpu_check.main(["--all", "--out", str(tmp_path)]) == 0
    monkeypatch.setattr(gpu_check, "CHECKS", [("fine", lambda ctx: {}), ("broken", lambda ctx: 1 / 0)])
    assert gpu_check.main(["--all", "--out", str(tmp_path)]) == 1
