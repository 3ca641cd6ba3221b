"""Hostile inputs and numeric faults (red team 2: D8, D9, D11, D13, D14, D15, D19): model output,
data files, configs, probe files, chat templates and NaN weights each end in one line naming what is
wrong (a numeric fault in training: "stopped: ..." exit 3), never a traceback or a NaN row."""
import json
import math
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import checkpoint, models
from evaluation import benchmarks, confidence, posthoc, probes
import config
import data
import evaluate
import probe as probe_lib
import prompts as prompts_lib
import toy_warm
import train
from harness.files import UserError
from tests import tiny

SMALL = ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "24", "--eval-n", "0",
         "--gen-batch", "64"]
EVAL = ["--benchmarks", "toy", "--limit", "2", "--n-samples", "1", "--max-new-tokens", "8",
        "--confidence", "logits"]


def write(path, content):
    with open(path, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)
    return str(path)


def one_line(capsys):
    """The one line on stderr (progress bars aside)."""
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.strip() and "it/s]" not in x]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A 1-step toy run with its checkpoint (copy it before changing it)."""
    run = str(tmp_path_factory.mktemp("base") / "run")
    train.main(["--steps", "1", "--out", run, *SMALL])
    return run


@pytest.fixture
def nan_model(tmp_path):
    """The toy base model with one NaN weight in its last MLP."""
    path = str(tmp_path / "nan")
    shutil.copytree(toy_warm.base_model(), path)
    weights = os.path.join(path, "model.safetensors")
    sd = load_file(weights)
    key = next(k for k in sd if k.endswith("mlp.down_proj.weight"))
    sd[key][0, 0] = float("nan")
    save_file(sd, weights, metadata={"format": "pt"})
    return path


# ---- D8: the verbal-confidence parser is linear in the model's text

def test_verbal_confidence_on_100_kb_of_repeated_tags_is_fast_and_reads_the_last_tag():
    start = time.perf_counter()
    conf = confidence.verbal_confidence("<confidence>" * 8500)   # 102 KB, no closing tag
    assert time.perf_counter() - start < 0.1   # 81f6578: 12 s for 96 KB
    assert conf == (0.5, True)
    text = "<confidence>0.7</confidence>" + "<confidence>" * 8500 + "<confidence> 0.3 </confidence> <confidence>0.9"
    assert confidence.verbal_confidence(text) == (0.3, False)   # the last complete tag


# ---- D19 / D13: data files

DATA_CASES = {   # name: (file content, words in the DataError)
    "dict answer": ('[{"problem": "1+2", "answer": {"value": "3"}}]', "row 0 field 'answer'"),
    "bool answer": ('[{"problem": "1+2", "answer": true}]', "row 0 field 'answer' is 'True' (bool)"),
    "NaN answer": ('{"problem": "1+2", "answer": 1}\n{"problem": "1+2", "answer": NaN}\n', "row 1 field 'answer'"),
    "dict problem": ('[{"problem": {"text": "1+2"}, "answer": "3"}]', "row 0 field 'problem'"),
    "non-dict row": ('[{"problem": "1+2", "answer": "3"}, 5, "x"]', "row 1 is 5, not an object"),
    "scalar file": ("5", "holds 5 at the top level, not rows"),
    "null file": ("null", "holds null at the top level"),
    "bad line 5": ("".join('{"problem": "1+2", "answer": "3"}\n' for _ in range(4)) + '{"problem": "1+2", "answer": }\n',
                   "(line 5, column"),
}


@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_data_is_one_line_naming_the_file_and_the_row(case, tmp_path):
    content, words = DATA_CASES[case]
    path = write(tmp_path / "d.jsonl", content)
    with pytest.raises(data.DataError) as e:
        data.load_rows(path)
    assert path in str(e.value) and words in str(e.value), str(e.value)


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    path = write(tmp_path / "d.json", b'\xef\xbb\xbf[{"problem": "1+2", "answer": 3}]')
    assert data.load_rows(path) == [{"problem": "1+2", "answer": "3"}]


# ---- D11: a config file's values pass the command line's checks

def config_file(tmp_path, **change):
    cfg = {**config.COMMON, **config.TOY, "steps": 1, "prompts_per_step": 4, "group_size": 4,
           "max_new_tokens": 24, "eval_n": 0, "budgets": [0.25, 0.5, 0.75], **change}
    return write(tmp_path / "cfg.json", json.dumps(cfg))


CONFIG_CASES = {   # the changed key and value: the one line
    "reward evil": (dict(reward="evil"), '"reward": "evil" in {f}: must be one of rlcm, grpo'),
    "grader xyz": (dict(grader="xyz"), '"grader": "xyz" in {f}: must be one of strict, math'),
    "corner": (dict(corner="x"), '"corner": "x" in {f}: must be one of zero'),
    "group_size 2.5": (dict(group_size=2.5), '"group_size": 2.5 in {f}: must be an integer'),
    "keep 1.5": (dict(keep=1.5), '"keep": 1.5 in {f}: must be an integer'),
    "steps string": (dict(steps="45"), '"steps": "45" in {f}: must be an integer'),
    "lam string": (dict(lam="0.1"), '"lam": "0.1" in {f}: must be a number'),
    "budgets 5.0": (dict(budgets=[5.0]), '"budgets": [5.0] in {f}: must be a list of fractions in (0, 1]'),
    "budgets string": (dict(budgets="0.5"), '"budgets": "0.5" in {f}: must be a list of fractions'),
    "grad_ckpt 1": (dict(grad_ckpt=1), '"grad_ckpt": 1 in {f}: must be true or false'),
    "keep 0": (dict(keep=0), '"keep": 0 in {f}: must be >= 1'),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_file_values_are_checked_like_flags(case, tmp_path, capsys):
    change, words = CONFIG_CASES[case]
    path = config_file(tmp_path, **change)
    with pytest.raises(SystemExit) as e:
        train.main(["--config", path, "--out", str(tmp_path / "new")])
    line = one_line(capsys)
    assert e.value.code == 2 and line.startswith("error: " + words.format(f=path)), line
    assert not os.path.exists(tmp_path / "new")


def test_a_resumed_config_json_is_checked_too(base_run, tmp_path, capsys):
    run = str(tmp_path / "run")
    shutil.copytree(base_run, run)
    path = os.path.join(run, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    write(path, json.dumps(dict(cfg, agg="evil")))
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", run, "--steps", "2"])
    assert e.value.code == 2
    assert one_line(capsys) == f'error: "agg": "evil" in {path}: must be one of token-mean, token-mean-per-micro-batch, seq-mean, seq-sum-norm'


# ---- D13 / D15: probe.pt and the post-hoc cache

def saved_probe(tmp_path, **change):
    prb = probe_lib.Probe(16)
    probe_lib.save(str(tmp_path / "probe.pt"), prb, probe_lib.make_optimizer(prb))
    blob = torch.load(tmp_path / "probe.pt", weights_only=True)
    torch.save(change.pop("whole", None) or {**blob, **change}, tmp_path / "probe.pt")
    return str(tmp_path / "probe.pt")


PROBE_CASES = {
    "a list": (dict(whole=[1, 2, 3]), "(a list, not a dict)"),
    "dropout 2.0": (dict(dropout=2.0), "(dropout 2.0 is not a probability)"),
    "dim 'abc'": (dict(dim="abc"), "(dim 'abc' and hidden 4 are not sizes)"),
    "dim 20000": (dict(dim=20000, hidden=20000), "(its weights are not those of a probe of dim 20000, hidden 20000)"),
    "optimizer a list": (dict(optimizer=[1]), "(its optimizer state is not one)"),
}


@pytest.mark.parametrize("case", PROBE_CASES)
def test_a_damaged_probe_file_is_refused_before_anything_is_built(case, tmp_path, monkeypatch):
    change, words = PROBE_CASES[case]
    path = saved_probe(tmp_path, **change)
    built = []
    monkeypatch.setattr(probe_lib.Probe, "__init__", lambda self, *a, **k: built.append(a) or 1 / 0)
    with pytest.raises(probe_lib.NotAProbe) as e:
        probe_lib.load(path)
    assert str(e.value) == f"{path} is not a probe saved by this code {words}: use an earlier checkpoint"
    assert built == []   # 81f6578: Probe(20000, 20000) was built (1.6 GB) before the weights were compared


def test_resume_with_a_probe_pt_that_is_a_list_is_one_line(base_run, tmp_path, capsys):
    run = str(tmp_path / "run")
    shutil.copytree(base_run, run)
    path = os.path.join(checkpoint.latest_checkpoint(run), "probe.pt")
    torch.save([1, 2, 3], path)
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", run, "--steps", "2"])
    assert e.value.code == 2 and one_line(capsys) == f"error: {path} is not a probe saved by this code " \
        "(a list, not a dict): use an earlier checkpoint"


def test_nan_probe_weights_are_a_numeric_fault_naming_the_file(tmp_path):
    prb = probe_lib.Probe(8)
    with torch.no_grad():
        prb.net[0].weight[0, 0] = float("nan")
    probe_lib.save(str(tmp_path / "p.pt"), prb)
    with pytest.raises(FloatingPointError, match="p.pt holds NaN or inf probe weights"):
        probe_lib.load(str(tmp_path / "p.pt"))


# what posthoc_probe compares with the cached report's protocol
PROTOCOL = dict(stop=[], n=1, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=0)


def cache_files(tmp_path):
    """A good post-hoc cache (probe and report in c.pt) under tmp_path / c, for PROTOCOL and no questions."""
    probe_lib.save(str(tmp_path / "c.pt"), probe_lib.Probe(8),
                   report=json.dumps({"protocol": posthoc.cache_protocol(PROTOCOL, [], "")}))
    return str(tmp_path / "c")


class Refit(Exception):
    """Raised where posthoc_probe starts sampling to fit the probe again."""


def cached_probe(cache, monkeypatch):
    def refit(*a, **k):
        raise Refit
    monkeypatch.setattr(posthoc.shard, "generate_dealt", refit)
    return posthoc.posthoc_probe(cache, None, None, [], "", None, PROTOCOL)


def nan_weights(path):
    blob = torch.load(path, weights_only=True)
    torch.save(dict(blob, state_dict={k: torch.full_like(v, math.nan) for k, v in blob["state_dict"].items()}), path)


CACHE_CASES = {   # what is done to the cache, the file named, words of the reason
    "pt cut in half": (lambda c: os.truncate(c + ".pt", os.path.getsize(c + ".pt") // 2), ".pt", "damaged ("),
    "pt a list": (lambda c: torch.save([1, 2], c + ".pt"), ".pt", "(a list, not a dict)"),
    "pt a pickle payload": (lambda c: torch.save({"x": os.system}, c + ".pt"), ".pt",
                            "(it holds objects other than tensors; not loaded)"),
    "pt NaN weights": (lambda c: nan_weights(c + ".pt"), ".pt", "holds NaN or inf probe weights"),
    "pt without its report": (lambda c: probe_lib.save(c + ".pt", probe_lib.Probe(8)), ".pt",
                              "(it holds no report (an older version's file))"),
    "pt report a list": (lambda c: probe_lib.save(c + ".pt", probe_lib.Probe(8), report="[]"), ".pt",
                         "(it holds no report"),
}


@pytest.mark.parametrize("case", CACHE_CASES)
def test_a_damaged_posthoc_cache_is_named_in_one_line_and_fitted_again(case, tmp_path, capsys, monkeypatch):
    damage, ext, words = CACHE_CASES[case]
    cache = cache_files(tmp_path)
    prb, report = cached_probe(cache, monkeypatch)   # the good cache is used as it is
    assert prb.dim == 8 and report == {"protocol": posthoc.cache_protocol(PROTOCOL, [], "")}
    damage(cache)
    with pytest.raises(Refit):   # 81f6578: TypeError, a torch traceback, or the NaN probe returned
        cached_probe(cache, monkeypatch)
    line = one_line(capsys)
    assert line.startswith(f"warning: post-hoc probe cache {cache}{ext} is damaged") and words in line, line
    assert "weights_only" not in line and line.endswith("fitting the probe again")


# ---- D9: NaN in the model ends as designed

def test_predict_refuses_nan_features():
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        probe_lib.predict(probe_lib.Probe(4), torch.tensor([[0.0, math.nan, 0.0, 0.0]]))


def test_posthoc_fit_on_nan_features_says_so():
    x = torch.randn(40, 8)
    x[3, 1] = math.nan
    with pytest.raises(FloatingPointError, match="post-hoc probe: 1 of 40 features are NaN or inf"):
        posthoc.fit_posthoc(x, torch.rand(40), torch.arange(40) // 4, max_epochs=2)


def test_training_a_nan_model_with_a_probe_stops_with_exit_3(nan_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--model", nan_model, "--data", "toy", "--eval-data", "toy", "--steps", "1",
                    "--out", str(tmp_path / "run"), *SMALL])
    line = one_line(capsys)
    assert e.value.code == 3 and line.startswith("stopped: the probe's features or confidences are NaN or inf"), line


def test_evaluating_a_nan_model_writes_no_nan_rows(nan_model, tmp_path):
    out = tmp_path / "eval"
    for _ in range(2):   # 81f6578: NaN rows appended, then every rerun failed on them
        with pytest.raises(SystemExit) as e:
            evaluate.main(["--model", nan_model, *EVAL, "--out", str(out)])
        assert e.value.code == ("evaluate.py: error: 2 of 2 logit confidences are NaN or inf: the model's "
                                "weights hold NaN or inf")
        assert not os.path.exists(out / "samples.jsonl") or os.path.getsize(out / "samples.jsonl") == 0


# ---- D13: results.json and a run's config.json

def test_results_json_that_is_not_an_object_is_refused_before_sampling(tmp_path):
    out = tmp_path / "eval"
    os.makedirs(out)
    write(out / "results.json", "[]")
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", "toy", *EVAL, "--out", str(out)])
    assert e.value.code == (f"evaluate.py: error: {out / 'results.json'} is not an object of results per model: "
                            "remove it (samples.jsonl keeps every sample)")
    assert not os.path.exists(out / "samples.jsonl")


RUN_CONFIG_CASES = {
    "a list": ("[1, 2]", "is not a JSON object"),
    "budgets 0.75": ('{"budgets": 0.75}', '"budgets": 0.75 in'),
    "instruction 5": ('{"instruction": 5}', '"instruction": 5 in'),
}


@pytest.mark.parametrize("case", RUN_CONFIG_CASES)
def test_a_bad_run_config_is_one_line_when_evaluating_the_run(case, tmp_path):
    content, words = RUN_CONFIG_CASES[case]
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    os.makedirs(ckpt)
    write(tmp_path / "run" / "config.json", content)
    for read in (benchmarks.run_config, probes.run_fractions):
        with pytest.raises(UserError) as e:
            read(str(ckpt))
        assert str(tmp_path / "run") in str(e.value) and words in str(e.value), str(e.value)


# ---- D15: weights that do not fit the config

def test_weights_that_do_not_fit_the_config_are_one_line(tmp_path):
    model = str(tmp_path / "model")
    shutil.copytree(toy_warm.base_model(), model)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    write(os.path.join(model, "config.json"), json.dumps(dict(cfg, vocab_size=5000)))
    with pytest.raises(UserError) as e:
        models.load_model(model)
    assert str(e.value).startswith(f"{model}/model.safetensors: model.embed_tokens.weight has shape [272, ")
    assert "builds [5000, " in str(e.value)


# ---- D14: chat templates that raise, are missing or never end

def templated(template):
    tok = tiny.tokenizer()
    tok.chat_template = template
    return tok


PLAIN = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
TEMPLATE_CASES = {   # template, system prompt, words in the DataError
    "raises on a system turn": ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                                "supported') }}{% endif %}" + PLAIN, "be careful",
                                "(TemplateError: System role not supported): give the model a working "
                                "chat_template or drop --system-prompt"),
    "missing": (None, None, "(ValueError: "),
    "sandbox": ("{{ ''.__class__.__mro__[1].__subclasses__() }}" + PLAIN, None, "(SecurityError: "),
    "never ends": ("{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}" + PLAIN, None,
                   "renders one prompt for over 0.2 s"),
}


@pytest.mark.parametrize("case", TEMPLATE_CASES)
def test_a_chat_template_that_fails_is_one_data_error(case, monkeypatch):
    template, system, words = TEMPLATE_CASES[case]
    monkeypatch.setattr(prompts_lib, "TEMPLATE_SECONDS", 0.2, raising=False)
    start = time.perf_counter()
    with pytest.raises(data.DataError) as e:
        prompts_lib.chat_prompt(templated(template), "1+1", "", system)
    assert words in str(e.value), str(e.value)
    assert time.perf_counter() - start < 5


def test_the_first_prompt_is_rendered_with_the_system_turn_before_any_folder_is_made():
    tok = templated(TEMPLATE_CASES["raises on a system turn"][0])
    rows = [{"problem": "1+1", "answer": "2"}]
    prompts_lib.check_context(tok, rows, "", None, 8, "toy")   # no system turn: renders
    with pytest.raises(data.DataError, match="System role not supported"):
        prompts_lib.check_context(tok, rows, "", None, 8, "toy", system="be careful")
