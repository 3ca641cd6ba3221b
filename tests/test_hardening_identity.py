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
