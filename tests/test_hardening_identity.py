"""Identity by content (red team 3: H6-H11): a model's samples, a run's "done", the post-hoc probe's
cache and a LoRA adapter's base are keyed by what they are, so nothing is reused or mislabelled."""
import json
import os
import shutil

import pytest

import train
from test_hardening import SMALL, base_run, one_line, run_copy, snapshot  # noqa: F401 (fixtures)


def test_a_link_in_place_of_checkpoints_is_refused_and_the_other_run_is_untouched(base_run, tmp_path, capsys):
    # H9: at a7c59f5 the resume read x's step 2, saved steps 3-4 into x and pruned x's steps 1-2.
    x, y = str(tmp_path / "x"), str(tmp_path / "y")
    shutil.copytree(base_run, x)
    shutil.copytree(base_run, y)
    shutil.rmtree(os.path.join(y, "checkpoints"))
    os.symlink(os.path.join("..", "x", "checkpoints"), os.path.join(y, "checkpoints"))
    before = snapshot(x)
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", y, "--steps", "4", "--save-every", "1", "--keep", "1"])
    assert e.value.code == 2
    line = one_line(capsys)
    assert line.startswith(f"error: {os.path.join(y, 'checkpoints')} is a link (to ../x/checkpoints)"), line
    assert snapshot(x) == before and sorted(os.listdir(os.path.join(x, "checkpoints"))) == [
        "step_000001", "step_000002"]


GPQA_ROW = {"Question": "Which gas do plants absorb?", "Correct Answer": "Carbon dioxide", "Incorrect Answer 1": "Oxygen",
            "Incorrect Answer 2": "Helium", "Incorrect Answer 3": "Neon"}


def test_a_local_gpqa_file_is_built_as_the_hubs_gpqa(tmp_path):
    # H6: at a7c59f5 gpqa=FILE gave {'problem': 'Which gas do plants absorb?', 'answer': 'Carbon dioxide'}:
    # no options, the answer text as gold (a response naming the right letter scored 0).
    import data
    from evaluation import benchmarks
    path = tmp_path / "gpqa.jsonl"
    path.write_text(json.dumps(GPQA_ROW) + "\n")
    name, rows, _ = benchmarks.load_benchmark(f"gpqa={path}")
    assert name == "gpqa" and rows == [{"problem": "Which gas do plants absorb?\n\nA) Helium\nB) Carbon dioxide\n"
                                                   "C) Oxygen\nD) Neon", "answer": "B"}]
    assert (rows[0]["problem"], rows[0]["answer"]) == data._choices(GPQA_ROW, 0, data.BENCHMARKS["gpqa"])
    path.write_text(json.dumps({k: v for k, v in GPQA_ROW.items() if k != "Incorrect Answer 2"}) + "\n")
    with pytest.raises(data.DataError, match=f"^{path}: row 0 has no 'Incorrect Answer 2' field: a gpqa file"):
        benchmarks.load_benchmark(f"gpqa={path}")


def test_a_cut_between_the_posthoc_caches_two_files_never_pairs_another_protocols_probe(tmp_path, monkeypatch, capsys):
    # H8: at a7c59f5 the report (.json, with the protocol) and the probe (.pt) were two files: after a
    # kill between them a new .pt sat beside the old .json, and the old protocol got the other probe.
    import torch
    from evaluation import posthoc
    import probe as probe_lib
    from harness import files
    import test_hardening_inputs as hi
    cache = hi.cache_files(tmp_path)            # protocol A's probe and report, both in c.pt
    files.write_json(cache + ".json", {"protocol": posthoc.cache_protocol(hi.PROTOCOL, [], "")})
    other = probe_lib.Probe(8)
    with torch.no_grad():
        other.net[0].weight.fill_(0.5)
    # the state a kill after the first write of the old layout left: another protocol's probe in c.pt,
    # A's report in c.json (here the probe comes with its own protocol, as posthoc_probe writes it)
    probe_lib.save(cache + ".pt", other)
    torch.save(dict(torch.load(cache + ".pt"), report=json.dumps({"protocol": dict(hi.PROTOCOL, n=8)})), cache + ".pt")
    with pytest.raises(hi.Refit):               # protocol A is fitted again, not answered with n=8's probe
        hi.cached_probe(cache, monkeypatch)
    probe_lib.save(cache + ".pt", probe_lib.Probe(8))
    torch.save(dict(torch.load(cache + ".pt"), report=json.dumps({"protocol": posthoc.cache_protocol(
        hi.PROTOCOL, [], "")})), cache + ".pt")
    prb, report = hi.cached_probe(cache, monkeypatch)   # A's own file: used as it is
    assert report["protocol"]["n"] == 1 and prb.net[0].weight.abs().max().item() != 0.5


FAST = ["--benchmarks", "toy,toy-long,toy-sub", "--limit", "6", "--n-samples", "2", "--max-new-tokens", "56", "--threads", "1",
        "--confidence", "logits"]


def retrain_in_place(folder):
    """The model in `folder` replaced by another of the same shapes (its embedding rows reversed), as a
    run deleted and trained again to the same step leaves it."""
    from safetensors.torch import load_file, save_file
    p = os.path.join(folder, "model.safetensors")
    sd = load_file(p)
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].flip(0).contiguous()
    save_file(sd, p, metadata={"format": "pt"})


def test_a_model_trained_again_in_place_is_evaluated_again_not_given_the_old_samples(tmp_path, capsys):
    # H7: at a7c59f5 a model was its path: the second evaluation into E printed the first model's
    # numbers (all its samples reused), and reproduce.py's eval_entry called it "evaluated already".
    import evaluate
    import toy_warm
    from study import comparison
    model = str(tmp_path / "model")
    shutil.copytree(toy_warm.base_model(), model)
    first = evaluate.main(["--model", model, "--out", str(tmp_path / "e"), *FAST])["model"]
    assert comparison.eval_entry(str(tmp_path / "e"), "model", evaluate.model_id(model))["model_id"] == first["model_id"]
    retrain_in_place(model)
    capsys.readouterr()
    again = evaluate.main(["--model", model, "--out", str(tmp_path / "e"), *FAST])
    assert "is of the model that was in" in capsys.readouterr().err
    fresh = evaluate.main(["--model", model, "--out", str(tmp_path / "e2"), *FAST])["model"]
    assert list(again) == ["model"] and again["model"]["benchmarks"] == fresh["benchmarks"]
    assert fresh["benchmarks"]["toy"]["acc"] != first["benchmarks"]["toy"]["acc"]
    assert again["model"]["model_id"] != first["model_id"] and again["model"]["model_id"].startswith(
        os.path.realpath(model) + "#")
    assert comparison.eval_entry(str(tmp_path / "e"), "model", first["model_id"]) is None   # the old model's: gone


@pytest.mark.parametrize("key, value", [("model", "runs/other"), ("data", "toy-sub")])
def test_reproduce_refuses_a_config_file_that_changes_the_model_or_the_data(tmp_path, key, value):
    # H11: at a7c59f5 --train-args "--config FILE" passed (argparse's model was None before and after)
    # and every method trained from FILE's model while the table said toy_base.
    import reproduce
    import config
    from harness.files import UserError
    cfg = dict(config.resolve_args(["--out", str(tmp_path / "x")]), **{key: value})
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    argv = ["--methods", "grpo", "--seeds", "0", "--out", str(tmp_path / "rep")]
    with pytest.raises(UserError, match=f"^--train-args --config {path} --steps 1: --{key} is reproduce.py's to set"):
        reproduce.parse_args(argv + ["--train-args", f"--config {path} --steps 1"])
    # L7: the same value as a flag (at a7c59f5 --data toy-sub was accepted)
    with pytest.raises(UserError, match=f"--{key} is reproduce.py's to set for each method and seed"):
        reproduce.parse_args(argv + ["--train-args", f"--{key} {value}"])
    assert not os.path.exists(tmp_path / "rep")
