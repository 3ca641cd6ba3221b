"""config.py: a config file's values pass the flags' limits; every flag says what it does."""
import json
import os
import shutil

import pytest

import config
import train
from runs import one_line_past_bars as one_line, one_step_run, write  # noqa: F401 (base_run)


def config_file(tmp_path, **change):
    cfg = {**config.COMMON, **config.TOY, "steps": 1, "budgets": [0.25, 0.5, 0.75], **change}
    return write(tmp_path / "cfg.json", json.dumps(cfg))


CONFIG_CASES = {   # the changed key and value: the one line, past "error: FILE: "
    "reward nonsense": (dict(reward="nonsense"), 'reward "nonsense" is refused: must be one of rlcm, grpo'),
    "agg seq-mean": (dict(agg="seq-mean"), 'agg "seq-mean" is refused: must be one of token-mean, '),
    "grader xyz": (dict(grader="xyz"), "grader \"xyz\" is refused: must be one of strict, math"),
    "corner": (dict(corner="x"), 'corner "x" is refused: must be one of zero'),
    "group_size 2.5": (dict(group_size=2.5), "group_size 2.5 is refused: must be an integer"),
    "steps string": (dict(steps="45"), 'steps "45" is refused: must be an integer'),
    "lam string": (dict(lam="0.1"), 'lam "0.1" is refused: must be a number'),
    "budgets 5.0": (dict(budgets=[5.0]), "budgets [5.0] is refused: must be a list of fractions in (0, 1]"),
    "budgets string": (dict(budgets="0.5"), 'budgets "0.5" is refused: must be a list of fractions'),
    "grad_ckpt 1": (dict(grad_ckpt=1), "grad_ckpt 1 is refused: must be true or false"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_file_values_are_checked_like_flags(case, tmp_path, capsys):
    """A value its flag would refuse (a choice, a type) is one line naming the key, exit 2, before
    anything loads: "reward": "nonsense" trained plain GRPO for its steps with exit 0 on af7d60d."""
    change, words = CONFIG_CASES[case]
    path = config_file(tmp_path, **change)
    with pytest.raises(SystemExit) as e:
        train.main(["--config", path, "--out", str(tmp_path / "new")])
    line = one_line(capsys)
    assert e.value.code == 2 and line.startswith(f"error: {path}: {words}"), line
    assert not os.path.exists(tmp_path / "new")


def test_a_config_files_values_pass_the_flags_limits(tmp_path, capsys):
    path = config_file(tmp_path, keep=0)
    with pytest.raises(SystemExit) as e:
        train.main(["--config", path, "--out", str(tmp_path / "new")])
    assert e.value.code == 2 and one_line(capsys) == "error: --keep 0: must be >= 1"
    assert not os.path.exists(tmp_path / "new")


def test_a_resumed_config_json_is_checked_too(base_run, tmp_path, capsys):
    """A run saved with agg seq-mean (an older version's) resumed with no line and trained another
    aggregation while config.json still said seq-mean."""
    run = str(tmp_path / "run")
    shutil.copytree(base_run, run)
    path = os.path.join(run, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    write(path, json.dumps(dict(cfg, agg="seq-mean")))
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", run, "--steps", "2"])
    assert e.value.code == 2
    assert one_line(capsys) == (f'error: {path}: agg "seq-mean" is refused: must be one of token-mean, '
                                "token-mean-per-micro-batch, as --agg")


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


def test_the_flags_the_size_cuts_removed_are_refused(capsys):
    """Gone with their code (the commits that removed them say why): each is argparse's error, exit 2."""
    import evaluate
    gone = [(config.build_parser().parse_args, f, []) for f in
            ("--log-samples", "--eval-probe-n", "--probe-batch", "--problem-field", "--answer-field")]
    gone += [(evaluate.parse_args, f, ["--model", "toy"])
             for f in ("--plan", "--gpu-mem", "--threads", "--toy-world")]
    for parse, flag, more in gone:
        with pytest.raises(SystemExit) as e:
            parse([*more, flag, "1"])
        assert e.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err
    for agg in ("seq-mean", "seq-sum-norm"):   # --agg keeps the two token-means
        with pytest.raises(SystemExit) as e:
            config.build_parser().parse_args(["--agg", agg])
        assert e.value.code == 2 and f"invalid choice: '{agg}'" in capsys.readouterr().err


def test_a_saved_setting_this_version_no_longer_has_is_named_not_dropped_unseen(tmp_path, capsys):
    """--config of an older version's run (here with the removed --probe-labels and --log-samples):
    one line names what differs from what this version does, and the last commit that had it; the
    others (at the value this version acts as) go unsaid. A current run's config names nothing."""
    saved = {**config.COMMON, **config.TOY, "model": "toy", "probe_labels": "shuffled", "log_samples": 8,
             "eval_probe_n": 32}
    path = write(tmp_path / "old.json", json.dumps(saved))
    cfg = config.resolve_args(["--config", path, "--out", str(tmp_path / "new")])
    err = capsys.readouterr().err
    assert err == (f"--config {path}: settings this version no longer has are ignored: "
                   "probe_labels='shuffled' (last in a0ee24b), log_samples=8 (last in d51ef88)\n")
    assert "probe_labels" not in cfg and "log_samples" not in cfg
    current = {k: v for k, v in cfg.items() if k not in config.NOT_SAVED}
    config.resolve_args(["--config", write(tmp_path / "now.json", json.dumps(current)),
                         "--out", str(tmp_path / "again")])
    assert "no longer has" not in capsys.readouterr().err


@pytest.mark.parametrize("dropped", [dict(probe_labels="shuffled"), dict(reward_fn="mine.py:ok")])
def test_a_run_with_a_dropped_setting_resumes_as_what_it_was_or_not_at_all(dropped, base_run, tmp_path,
                                                                           capsys):
    """A run saved with a setting this version dropped, at another value than this version acts as,
    would resume as another experiment: one line naming it and the last commit that had it, exit 2.
    At the value this version acts as it resumes, and config.json keeps the key."""
    run = str(tmp_path / "run")
    shutil.copytree(base_run, run)
    path = os.path.join(run, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    write(path, json.dumps(dict(cfg, **dropped)))
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", run, "--steps", "3"])
    (key, value), = dropped.items()
    assert e.value.code == 2 and one_line(capsys) == (
        f"error: --resume {run}: the run has settings this version no longer has: {key}={value!r} "
        f"(last in {config.DROPPED[key][1]}); resume it with that version, or start a new run")
    write(path, json.dumps(dict(cfg, **{key: config.DROPPED[key][0]}, eval_n=0)))
    train.main(["--resume", run, "--steps", "3"])
    with open(path) as f:
        after = json.load(f)
    assert after[key] == config.DROPPED[key][0] and after["steps"] == 3


def test_a_config_json_of_no_run_is_refused(tmp_path, capsys):
    """--resume of a model's folder read its config.json's keys as settings an older version had."""
    import toy
    with pytest.raises(SystemExit) as e:
        train.main(["--config", os.path.join(toy.BASE_DIR, "config.json"), "--out", str(tmp_path / "new")])
    line = one_line(capsys)
    assert e.value.code == 2 and "is no setting train.py ever had: is it a run's config.json?" in line, line
