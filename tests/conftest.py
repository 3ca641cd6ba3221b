import os
import shutil
import sys

import pytest

# Tests never touch the network: every loader must work from local paths and models built in code.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(items):
    """Files with end-to-end (slow) tests first, each file's tests in their order: pytest.ini's two
    workers take whole files, so the long ones start early and the workers end together."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A 2-step toy run with a checkpoint after each step (copy it before changing it)."""
    import train
    from runs import SMALL
    run = str(tmp_path_factory.mktemp("base") / "run")
    train.main(["--steps", "2", "--save-every", "1", "--out", run, *SMALL])
    return run


@pytest.fixture
def run_copy(base_run, tmp_path):
    dst = str(tmp_path / "run")
    shutil.copytree(base_run, dst)
    return dst


@pytest.fixture
def nan_model(tmp_path):
    """The toy base model with one NaN weight in its last MLP."""
    from safetensors.torch import load_file, save_file
    import toy
    path = str(tmp_path / "nan")
    shutil.copytree(toy.BASE_DIR, path)
    weights = os.path.join(path, "model.safetensors")
    sd = load_file(weights)
    key = next(k for k in sd if k.endswith("mlp.down_proj.weight"))
    sd[key][0, 0] = float("nan")
    save_file(sd, weights, metadata={"format": "pt"})
    return path
