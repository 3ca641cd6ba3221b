"""The scripts under study/ start as a user runs them, as a file (`python study/bench.py`), not only
as a module (`python -m study.bench`): run as a file, Python puts study/, not the repository root, on
the path, and the project's modules would not be found."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", ["bench", "premises"])
def test_a_script_run_as_a_file_prints_its_help(script):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    p = subprocess.run([sys.executable, os.path.join("study", f"{script}.py"), "--help"], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"usage: {script}.py ")
