"""tests/bench.py: the bandwidth floor formula, and one tiny run of every path on the toy model."""
import os
import subprocess
import sys

import pytest

import bench
from harness.files import UserError
import tiny
from runs import ROOT


def test_floor_counts_weights_but_the_input_embedding_and_the_kv_cache():
    model = tiny.model()  # float32, vocab 300, hidden 32, 2 layers, 2 KV heads of dim 8, untied
    params = sum(p.numel() for p in model.parameters())
    weights = (params - 300 * 32) * 4
    kv_per_token = 2 * 2 * 2 * 8 * 4  # (k, v) x layers x KV heads x head dim x bytes
    expected_ms = (weights + 10 * 100 * kv_per_token) / 1e12 * 1e3
    assert bench.floor_ms(model, rows=10, context=100, bandwidth_tbs=1.0) == pytest.approx(expected_ms)
    assert bench.floor_ms(model, 10, 100, 2.0) == pytest.approx(expected_ms / 2)


def test_every_path_runs_and_reports(capsys):
    bench.main(["--prompts", "2", "--samples", "2", "--max-new-tokens", "4", "--repeat", "1"])
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[2:6]}
    assert set(rows) == {"dynamic", "static", "static-full", "generate"}
    assert rows["generate"][-1] == "1.00x"
    # the sampler paths draw the same samples, so they generate the same number of tokens
    assert rows["dynamic"][1] == rows["static"][1] == rows["static-full"][1] and 4 <= int(rows["dynamic"][1]) <= 16
    assert out[6].startswith("static-full / static (live length): ")


def test_the_positions_each_path_attends_over():
    """4 rows after a 3-token prefix, 100 new tokens: decode steps t = 0..98 have 4..102 positions
    written; the static buffers hold bucket(102, 64) = 128, of which the live length attends over
    64 while at most 64 are written (61 steps) and 128 after (38 steps)."""
    assert bench.attended("dynamic", 4, 3, 100) == (4, 53)
    assert bench.attended("static-full", 4, 3, 100) == (4, 128)
    assert bench.attended("static", 4, 3, 100) == (4, pytest.approx((61 * 64 + 38 * 128) / 99))
    assert bench.attended("static", 5, 3, 100)[0] == 5 and bench.attended("static", 17, 3, 100)[0] == 18


def test_the_long_shape_reads_fewer_bytes_on_the_live_length(capsys):
    bench.main(["--shape", "long", "--prompts", "1", "--samples", "2", "--max-new-tokens", "100",
                "--repeat", "1", "--paths", "static,static-full"])
    out = capsys.readouterr().out.splitlines()
    assert "1 prompts x 2 samples, <= 100 new tokens" in out[0]
    rows = {line.split()[0]: line.split() for line in out[2:4]}
    assert rows["static"][1] == rows["static-full"][1] == "200"  # EOS off: every row runs to the end
    ratio = float(rows["static-full"][6]) / float(rows["static"][6])
    assert out[4].endswith("x the bytes read per step")
    assert ratio > 1 and float(out[4].split(", ")[-1].split("x")[0]) == pytest.approx(ratio, abs=0.02)


def test_the_7b_shape_reads_its_config_from_the_folder_given(tmp_path):
    # only the checkout travels to a GPU machine: the config comes from --config, never ../shared
    with pytest.raises(UserError, match="no config.json in .*: pass --config DIR"):
        bench.main(["--shape", "7b", "--config", str(tmp_path)])
    if tiny.real_tokenizer() is None:
        pytest.skip("needs the 7B config and tokenizer fixture")
    cfg = bench.cut_config(tiny.REAL_TOKENIZER, 3)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (3, 3584, 4, 152064)


def test_the_7b_shape_without_a_config_folder_says_what_to_pass(tmp_path):
    """A user's clone has no prepared folder to default to: --config names one with config.json and a tokenizer."""
    with pytest.raises(UserError, match="^--config DIR is needed: a folder with the model's config.json and tokenizer"):
        bench.main(["--shape", "7b"])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="^no tokenizer_config.json in .*: pass --config DIR, .*hf download"):
        bench.main(["--shape", "7b", "--config", str(tmp_path)])


@pytest.mark.parametrize("flags,line", [
    (["--prompts", "0"], "--prompts 0: must be >= 1"),
    (["--samples", "-1"], "--samples -1: must be >= 1"),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--repeat", "0"], "--repeat 0: must be >= 1"),
    (["--device", "cuda:99"], "--device cuda:99: this torch build and machine show"),
    (["--device", "gpu"], "--device gpu: not a device"),
])
def test_bench_checks_its_flags_before_loading_anything(flags, line):
    with pytest.raises(UserError) as e:
        bench.main(flags)
    assert str(e.value).startswith(line)


@pytest.mark.slow   # tests/bench.py in a subprocess, run as a file
def test_bench_flag_error_is_one_line_exit_2():
    p = subprocess.run([sys.executable, os.path.join("tests", "bench.py"), "--repeat", "0"], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.strip() == "error: --repeat 0: must be >= 1"


def test_bench_run_as_a_file_prints_its_help():
    """Run as a file, Python puts tests/, not the repository root, on the path: the project's modules are
    found all the same."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    p = subprocess.run([sys.executable, os.path.join("tests", "bench.py"), "--help"], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: bench.py ")
