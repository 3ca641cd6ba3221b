"""config.py: a config file's values, and a resumed run's config.json, pass the command line's checks."""
import json
import os
import shutil

import pytest

import config
import train
from runs import one_line_past_bars as one_line, one_step_run, write  # noqa: F401 (fixture: base_run)


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



def test_every_flag_says_what_it_does_and_its_default():
    """`--help` of train.py and evaluate.py: every flag has help, and the help names its numeric
    defaults (train.py's parser holds None: its numbers come from the worlds; evaluate.py's from argparse)."""
    import evaluate
    worlds = (config.COMMON, config.TOY, config.REAL)
    for parser, where in ((config.build_parser(), worlds), (evaluate.build_parser(), None)):
        for a in parser._actions:
            helped = parser._get_formatter()._expand_help(a) if a.help else ""
            assert helped.strip(), f"{a.option_strings} has no help"
            values = [d.get(a.dest) for d in where] if where else [a.default]
            numbers = [v for v in values if isinstance(v, (int, float, tuple)) and not isinstance(v, bool)]
            assert all(str(v) in helped for v in numbers), (a.option_strings, numbers, helped)
