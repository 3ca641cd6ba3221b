import math
import os
import shutil

import torch
import torch.nn.functional as F
import pytest

import probe as P
import probe as probe_lib
import train
from harness import checkpoint
from harness.files import UserError
from runs import SMALL_NO_EVAL as SMALL, one_line_past_bars as one_line, one_step_run  # noqa: F401 (fixture: base_run)


def separable(m=128, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).float()


def test_probe_shapes_and_sizes():
    mlp = P.Probe(32)
    assert mlp.hidden == 8
    assert sum(p.numel() for p in mlp.parameters()) == 32 * 8 + 8 + 8 + 1
    assert [type(m).__name__ for m in mlp.net] == ["Linear", "ReLU", "Dropout", "Linear"]
    assert mlp.net[2].p == 0.1
    lin = P.Probe(32, hidden=0)
    assert sum(p.numel() for p in lin.parameters()) == 33
    assert mlp(torch.randn(5, 3, 32)).shape == (5, 3) and lin(torch.randn(7, 32)).shape == (7,)


def test_prefix_features_matches_hand_loop():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 6, dtype=torch.float64)
    ends = torch.tensor([[2, 6, 9], [5, 0, -1]])  # 2 < last_k: window clamps at 0; <= 0: padding
    feats, valid = P.prefix_features(hidden, ends, last_k=4)
    assert feats.shape == (2, 3, 6) and feats.dtype == torch.float32
    assert valid.tolist() == [[True, True, True], [True, False, False]]
    for n in range(2):
        for b in range(3):
            e = int(ends[n, b])
            if e <= 0:
                assert (feats[n, b] == 0).all()
                continue
            want = torch.stack([hidden[n, p] for p in range(max(e - 4, 0), e)]).mean(0).float()
            assert torch.allclose(feats[n, b], want, atol=1e-6)
    one, _ = P.prefix_features(hidden, torch.tensor([[3], [9]]), last_k=1)
    assert torch.equal(one[:, 0], torch.stack([hidden[0, 2], hidden[1, 8]]).float())
    with pytest.raises(ValueError, match="exceeds"):
        P.prefix_features(hidden, torch.tensor([[10], [1]]))


def test_fit_lowers_bce_and_predict_in_unit_interval():
    x, y = separable(d=64)
    torch.manual_seed(0)
    probe = P.Probe(64)  # defaults: hidden 16, dropout 0.1, AdamW lr 1e-3
    opt = P.make_optimizer(probe)
    before = F.binary_cross_entropy(P.predict(probe, x), y).item()
    last = P.fit(probe, opt, x, y, passes=16, batch_size=16, seed=0)
    after = F.binary_cross_entropy(P.predict(probe, x), y).item()
    assert after < 0.7 * before and last < 0.7 * before
    assert not probe.training  # predict leaves eval mode on
    p = P.predict(probe, x)
    assert p.shape == (128,) and ((p > 0) & (p < 1)).all()
    assert ((p > 0.5).float() == y).float().mean() > 0.9


def test_fit_soft_targets_train_mode_and_seeded_order():
    x, _ = separable(m=40)
    soft = torch.linspace(0, 1, 40)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(0)
        probe = P.Probe(16, dropout=0.0)
        seen = []
        probe.register_forward_pre_hook(lambda mod, args: seen.append(mod.training))
        P.fit(probe, P.make_optimizer(probe), x, soft, passes=2, batch_size=8, seed=seed)
        assert seen and all(seen)
        runs.append(torch.cat([p.detach().flatten() for p in probe.parameters()]))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        P.fit(P.Probe(16), P.make_optimizer(P.Probe(16)), x, soft + 1)


def test_make_optimizer_defaults():
    opt = P.make_optimizer(P.Probe(8))
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["weight_decay"] == 0.01


def test_save_load_roundtrip(tmp_path):
    x, y = separable()
    torch.manual_seed(0)
    probe = P.Probe(16, hidden=6, dropout=0.3)
    opt = P.make_optimizer(probe)
    P.fit(probe, opt, x, y, passes=2)
    path = tmp_path / "probe.pt"   # the folder exists: a checkpoint's, or the post-hoc cache's
    P.save(str(path), probe, opt)
    assert [f.name for f in path.parent.iterdir()] == ["probe.pt"]  # no temp file left behind
    blob = torch.load(path, weights_only=True)
    assert (blob["dim"], blob["hidden"], blob["dropout"]) == (16, 6, 0.3)
    loaded, opt_state = P.load(str(path))
    assert (loaded.dim, loaded.hidden, loaded.p_drop) == (16, 6, 0.3)
    assert torch.equal(P.predict(loaded, x), P.predict(probe, x))
    # the optimizer resumes exactly: one more identical step gives identical weights
    opt2 = P.make_optimizer(loaded)
    opt2.load_state_dict(opt_state)
    for pr, o in ((probe, opt), (loaded, opt2)):
        torch.manual_seed(1)
        P.fit(pr, o, x[:16], y[:16], passes=1)
    assert torch.equal(P.predict(loaded, x), P.predict(probe, x))
    P.save(str(path), loaded)
    assert P.load(str(path))[1] is None


def test_default_probe_is_the_released_mlp_and_the_flag_gives_the_linear_one():
    import config
    assert config.resolve_args([])["probe_hidden"] is None
    # d -> d/4 -> 1: 4,161 weights for the toy (d 128), 3,213,057 for the 7B (d 3584)
    assert sum(p.numel() for p in P.Probe(128, config.COMMON["probe_hidden"]).parameters()) == 4161
    assert sum(p.numel() for p in P.Probe(3584).parameters()) == 3_213_057
    assert config.resolve_args(["--probe-hidden", "0"])["probe_hidden"] == 0
    with pytest.raises(UserError, match="--probe-hidden -1: must be >= 0"):
        config.resolve_args(["--probe-hidden", "-1"])


def test_linear_probe_fits_a_separable_set_and_round_trips(tmp_path):
    x, y = separable(m=256)
    torch.manual_seed(0)
    probe = P.Probe(16, hidden=0)
    assert isinstance(probe.net, torch.nn.Linear) and sum(p.numel() for p in probe.parameters()) == 17
    opt = P.make_optimizer(probe, lr=1e-2)
    P.fit(probe, opt, x, y, passes=30, batch_size=16, seed=0)
    assert ((P.predict(probe, x) > 0.5).float() == y).float().mean() > 0.95
    w = probe.net.weight[0]  # the labels are x0 + 0.5 * x1 > 0: the weight sits on those two inputs
    assert w[0] > w[1] > 4 * w[2:].abs().max()
    path = str(tmp_path / "probe.pt")
    P.save(path, probe, opt)
    loaded, state = P.load(path)
    assert loaded.hidden == 0 and torch.equal(P.predict(loaded, x), P.predict(probe, x))
    from evaluation import confidence   # evaluate --confidence probe reads the same file
    assert torch.equal(P.predict(confidence.get_probe("probe", None, None, "run", str(tmp_path), None, None,
                                                    None)[0], x), P.predict(probe, x))


def test_probe_hidden_0_trains_resumes_and_stays_linear(tmp_path, capsys):
    import train
    run = str(tmp_path / "run")
    small = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16", "--eval-n", "0",
             "--save-every", "1"]
    train.main(["--steps", "1", "--out", run, "--probe-hidden", "0", *small])
    train.main(["--steps", "2", "--resume", run])
    for at in (1, 2):
        probe, state = P.load(f"{run}/checkpoints/step_00000{at}/probe.pt")
        assert (probe.dim, probe.hidden) == (128, 0) and state is not None
    with pytest.raises(SystemExit) as stop:
        train.main(["--steps", "3", "--resume", run, "--probe-hidden", "32"])
    assert stop.value.code == 2
    assert "--probe-hidden cannot change on resume (saved 0, given 32)" in capsys.readouterr().err


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


def test_predict_refuses_nan_features():
    with pytest.raises(FloatingPointError, match="NaN or inf"):
        probe_lib.predict(probe_lib.Probe(4), torch.tensor([[0.0, math.nan, 0.0, 0.0]]))


def test_training_a_nan_model_with_a_probe_stops_with_exit_3(nan_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--model", nan_model, "--data", "toy", "--eval-data", "toy", "--steps", "1",
                    "--out", str(tmp_path / "run"), *SMALL])
    line = one_line(capsys)
    assert e.value.code == 3 and line.startswith("stopped: the probe's features or confidences are NaN or inf"), line


def test_a_prefix_of_one_token_is_a_real_cut():
    """An end of 1 (the first token alone) is valid and averages that one position; 0 is padding."""
    hidden = torch.arange(12.0).view(1, 6, 2)
    feats, valid = P.prefix_features(hidden, torch.tensor([[1, 0]]), last_k=4)
    assert valid.tolist() == [[True, False]]
    assert feats[0, 0].tolist() == [0.0, 1.0] and feats[0, 1].tolist() == [0.0, 0.0]
