"""config.py: a config file's values pass the flags' limits; every flag says what it does."""
import json
import os

import pytest

import config
import train
from runs import one_line_past_bars as one_line, write


def test_a_config_files_values_pass_the_flags_limits(tmp_path, capsys):
    cfg = {**config.COMMON, **config.TOY, "keep": 0}
    path = write(tmp_path / "cfg.json", json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        train.main(["--config", path, "--out", str(tmp_path / "new")])
    assert e.value.code == 2 and one_line(capsys) == "error: --keep 0: must be >= 1"
    assert not os.path.exists(tmp_path / "new")


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
    """A run saved by an older version (here with the removed --probe-labels and --log-samples):
    its config still loads, and one line names what is ignored. A current run's config names nothing."""
    saved = {**config.COMMON, **config.TOY, "model": "toy", "probe_labels": "shuffled", "log_samples": 8}
    path = write(tmp_path / "old.json", json.dumps(saved))
    cfg = config.resolve_args(["--config", path, "--out", str(tmp_path / "new")])
    err = capsys.readouterr().err
    assert f"--config {path}: settings this version no longer has are ignored: " \
           "probe_labels='shuffled', log_samples=8" in err
    assert "probe_labels" not in cfg and "log_samples" not in cfg
    current = {k: v for k, v in cfg.items() if k not in config.NOT_SAVED}
    config.resolve_args(["--config", write(tmp_path / "now.json", json.dumps(current)),
                         "--out", str(tmp_path / "again")])
    assert "no longer has" not in capsys.readouterr().err
