import ast
import glob
import os
import re
import subprocess
import sys

import pytest
import torch

import reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imported_modules(filename):
    """Top-level names of every module a file imports (absolute and relative)."""
    tree = ast.parse(open(os.path.join(ROOT, filename)).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


@pytest.mark.parametrize("leaf", ["metrics.py", "reward.py", "grpo.py", "probe.py"])
def test_leaves_import_nothing_from_the_project(leaf):
    project = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))}
    project |= {"toy", "data", "rollout", "label", "score", "train", "evaluate", "metrics", "reward", "grpo", "probe"}
    imported = _imported_modules(leaf)
    assert "." not in imported
    assert not imported & project, f"{leaf} imports project modules {imported & project}"


@pytest.mark.parametrize("copyable", ["reward.py"])
def test_copyable_files_import_only_torch_and_stdlib(copyable):
    imported = _imported_modules(copyable)
    assert "torch" in imported
    for name in imported - {"torch"}:
        assert name in sys.stdlib_module_names, f"{copyable} imports {name}, not torch or the standard library"


def test_reward_py_copied_alone_runs_its_documented_examples(tmp_path):
    """reward.py in an empty folder, run in isolated mode (nothing of the project importable): its
    docstrings' examples (doctest) give the numbers they print, and there are some."""
    (tmp_path / "reward.py").write_text(open(os.path.join(ROOT, "reward.py"), encoding="utf-8").read())
    out = subprocess.run([sys.executable, "-I", "-m", "doctest", "-v", "reward.py"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = re.search(r"^(\d+) passed and 0 failed", out.stdout, re.M)
    assert ran and int(ran.group(1)) >= 8, out.stdout[-2000:]


def test_labels_within_float_noise_of_1_or_0_keep_their_side():
    """Y_b = 1 - 1e-7 (a mean's float noise) is solvable and 1e-7 unsolvable; 1 - 1e-3 (a share of K
    = 1000) and 1e-3 count on neither side, like 0.5."""
    conf = torch.tensor([[0.9, 0.2, 0.6]])
    assert reward.margin_reward(conf, torch.tensor([[1 - 1e-7, 1e-7, 0.5]])).tolist() == pytest.approx([0.7])
    assert reward.margin_reward(conf, torch.tensor([[1 - 1e-3, 1e-3, 0.5]])).tolist() == [0.0]
    assert reward.corner_margin(conf, torch.tensor([[1 - 1e-3, 0.0, 0.5]])).tolist() == pytest.approx([0.8])


EVALUATION = ("evaluate", "evaluation")  # evaluate.py and the package of its machinery


@pytest.mark.parametrize("core", ["reward", "grpo", "probe", "label", "baselines"])
def test_importing_a_core_module_loads_no_evaluation_code(core):
    """A learner's `import baselines` (or any core file) must not pull in the evaluation modules: run in
    a fresh interpreter, since this one has imported them all."""
    code = f"import sys, {core}; print(' '.join(m for m in sys.modules if m.split('.')[0] in {EVALUATION!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [], f"import {core} loads {out.stdout.split()}"


def test_margin_hand_computed():
    m = reward.margin_reward(torch.tensor([[0.9, 0.7, 0.2]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert m.tolist() == pytest.approx([0.6])
    # 0 < Y < 1 counts on neither side
    m = reward.margin_reward(torch.tensor([[0.9, 0.5, 0.1]]), torch.tensor([[1.0, 0.5, 0.0]]))
    assert m.tolist() == pytest.approx([0.8])


def test_margin_corners():
    conf = torch.tensor([[0.9, 0.7, 0.2], [0.3, 0.1, 0.5], [0.4, 0.6, 0.9]])
    labels = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.5], [0.25, 0.5, 0.75]])
    assert reward.margin_reward(conf, labels).tolist() == [0.0, 0.0, 0.0]
    # only solvable: mean C = 0.6; only unsolvable: 1 - mean(0.3, 0.1) = 0.8; neither: 0
    assert reward.corner_margin(conf, labels).tolist() == pytest.approx([0.6, 0.8, 0.0])
    # only unsolvable: -mean(0.3, 0.1) = -0.2
    assert reward.final_margin(conf, labels).tolist() == pytest.approx([0.6, -0.2, 0.0])


@pytest.mark.parametrize("rule, want", [("margin_reward", 0.8), ("corner_margin", 0.8), ("final_margin", 0.0)])
def test_both_sides_present(rule, want):
    """The margin, except for Final-Margin (released alpha_both = 0), which scores only one-sided
    traces: it is 0 exactly when both sides exist."""
    m = getattr(reward, rule)(torch.tensor([[0.9, 0.1, 0.5]]), torch.tensor([[1.0, 0.0, 0.5]]))
    assert m.tolist() == pytest.approx([want])


def test_released_unit_test_values():
    """The released conf_diff tests: margin_corner=True gives C (.9, .7) all correct -> 0.8 and
    C (.3, .1) all incorrect -> 1 - 0.2 = 0.8; conf_diff_v1 / v3 (tau 0) give -0.2 for the latter;
    both margin 0 without corner handling; an empty budget list gives 0."""
    both = torch.tensor([[0.9, 0.7], [0.3, 0.1]])
    y = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert reward.corner_margin(both, y).tolist() == pytest.approx([0.8, 0.8])
    assert reward.final_margin(both, y).tolist() == pytest.approx([0.8, -0.2])
    # released conf_diff_v3 (tau 0.4, alphas 3/5/7): only-correct 5 * (0.9 - 0.4), only-incorrect
    # 7 * (0.4 - 0.1); with the Final-Margin script's tau 0 and alphas 0/1/1 these are 0.9 and -0.1
    one = reward.final_margin(torch.tensor([[0.9], [0.1]]), torch.tensor([[1.0], [0.0]]))
    assert one.tolist() == pytest.approx([0.9, -0.1])
    assert reward.margin_reward(both, y).tolist() == [0.0, 0.0]
    # released: preds [0.8, 0.3], [0.6, 0.4] with accuracies [1, 0], [0, 1] -> 0.5, -0.2
    two = reward.margin_reward(torch.tensor([[0.8, 0.3], [0.6, 0.4]]), torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert two.tolist() == pytest.approx([0.5, -0.2])
    empty = reward.corner_margin(torch.tensor([[0.9, 0.0], [0.9, 0.2]]), torch.tensor([[0.0, 0.0], [1.0, 0.0]]),
                                 mask=torch.tensor([[0, 0], [1, 1]]))
    assert empty.tolist() == pytest.approx([0.0, 0.7])


def test_final_margin_ablation_values():
    """Budget 1.0 only: one prefix; +C when every forced answer is right, -C when all wrong, 0 mixed."""
    conf = torch.tensor([[0.7], [0.2], [0.9]])
    labels = torch.tensor([[1.0], [0.0], [0.5]])
    assert reward.final_margin(conf, labels).tolist() == pytest.approx([0.7, -0.2, 0.0])


def test_margin_mask_drops_padding_prefixes():
    conf = torch.tensor([[0.9, 0.2, 0.0], [0.8, 0.6, 0.1]])
    labels = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # row 0: padded third prefix (label 0, conf 0) must not pull the unsolvable mean down
    assert reward.margin_reward(conf, labels, mask).tolist() == pytest.approx([0.7, 0.8 - 0.35])
    assert reward.margin_reward(conf, labels).tolist() == pytest.approx([0.9 - 0.1, 0.8 - 0.35])
    # Final-Margin: the padded prefix would make a second side (then 0); masked, only +C is left
    one = torch.tensor([[0.9, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[1, 0]])
    assert reward.final_margin(*one).tolist() == pytest.approx([0.9])
    assert reward.corner_margin(*one).tolist() == pytest.approx([0.9])


def test_brier_reward():
    conf = torch.tensor([[0.9, 0.5, 0.0], [0.2, 0.0, 0.0]])
    labels = torch.tensor([[1.0, 0.25, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = reward.brier_reward(conf, labels, mask)
    assert out.tolist() == pytest.approx([-(0.01 + 0.0625 + 0.0) / 3, -0.04])
    # labels follow conf's dtype (and device): float64 labels give a float32 reward for float32 conf
    assert reward.brier_reward(conf, labels.double(), mask).dtype == torch.float32


def test_total_reward_is_signed():
    correct = torch.tensor([1.0, 0.0])
    calib = torch.tensor([0.5, -0.5])
    assert reward.total_reward(correct, calib).tolist() == pytest.approx([1.05, -1.05])
    assert reward.total_reward(correct, calib, lam=0.0).tolist() == [1.0, -1.0]
    assert reward.total_reward([True, False], [0.0, 0.0], lam=0.3).tolist() == [1.0, -1.0]


def test_labels_on_the_tolerance_itself_count_on_their_side():
    """A label exactly 1e-6 from 1 (or from 0) is solvable (unsolvable): "within" includes the bound.
    C = (0.9, 0.1) -> margin 0.8 either way."""
    assert reward.margin_reward([[0.9, 0.1]], [[1 - reward.EPS, 0]]).item() == pytest.approx(0.8)
    assert reward.margin_reward([[0.9, 0.1]], [[1, reward.EPS]]).item() == pytest.approx(0.8)


def test_integer_correctness_keeps_the_margin_and_float64_stays_float64():
    """correct given as ints (a list of 0/1) is made float before lam * margin is added: R = 2c - 1
    + 0.1 * (0.5, -0.5) = (1.05, -1.05), not the margin cast to an int. Float64 inputs stay float64."""
    assert reward.total_reward([1, 0], [0.5, -0.5], lam=0.1).tolist() == pytest.approx([1.05, -1.05])
    conf = torch.tensor([[0.9, 0.1]], dtype=torch.float64)
    assert reward.margin_reward(conf, [[1, 0]]).dtype == torch.float64
