"""scripts/bench.py: the bandwidth floor formula, and one tiny run of every path on the toy model."""
import pytest

from scripts import bench
from harness.checkpoint import UserError
import tiny


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
    rows = {line.split()[0]: line.split() for line in out[2:]}
    assert set(rows) == {"dynamic", "static", "generate"}
    assert rows["generate"][-1] == "1.00x"
    # the two sampler paths draw the same samples, so they generate the same number of tokens
    assert rows["dynamic"][1] == rows["static"][1] and 4 <= int(rows["dynamic"][1]) <= 16


def test_the_7b_shape_reads_its_config_from_the_folder_given(tmp_path):
    # only the checkout travels to a GPU machine: the config comes from --config, never ../shared
    with pytest.raises(UserError, match="no config.json in .*: pass --config DIR"):
        bench.main(["--shape", "7b", "--config", str(tmp_path)])
    if tiny.real_tokenizer() is None:
        pytest.skip("needs the 7B config and tokenizer fixture")
    cfg = bench.cut_config(tiny.REAL_TOKENIZER, 3)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (3, 3584, 4, 152064)
