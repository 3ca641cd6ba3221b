"""A LoRA checkpoint and its base (red team 3: H10, L8, M7, L4, M8): an adapter resumes and is
evaluated on the base it was trained on, found by content; a damaged adapter_config.json is one line."""
import json
import os
import shutil

import pytest

import train
from harness import adapter, checkpoint, files, lora, models
from harness.files import UserError
from test_hardening import SMALL, base_run, one_line  # noqa: F401 (fixture)

# the toy world's data for a --model folder (a folder gets the real-model defaults)
TOYW = ["--data", "toy", "--eval-data", "toy", "--max-new-tokens", "24", "--max-prompt-tokens", "0", "--instruction=",
        "--lr", "1e-3"]


@pytest.fixture(scope="module")
def lora_pair(base_run, tmp_path_factory):
    """ROOT/a (a 2-step run) and ROOT/l (a 1-step LoRA run on a, started with --model a cwd-relative)."""
    root = tmp_path_factory.mktemp("pair")
    shutil.copytree(base_run, root / "a")
    here = os.getcwd()
    os.chdir(root)
    try:
        train.main(["--model", "a", "--lora-rank", "4", "--steps", "1", "--save-every", "1", "--out", "l", *SMALL,
                    *TOYW])
    finally:
        os.chdir(here)
    return str(root)


@pytest.fixture
def pair(lora_pair, tmp_path):
    """A copy of lora_pair elsewhere (a clone moved whole): ROOT/a, ROOT/l."""
    shutil.copytree(lora_pair, tmp_path / "moved")
    return str(tmp_path / "moved")


def test_a_lora_run_resumes_on_the_base_it_was_trained_on_not_the_runs_latest(pair, capsys, monkeypatch):
    # H10: at a7c59f5 the resume loaded --model a again, now a's step 3, while its checkpoints named step 2.
    monkeypatch.chdir(pair)   # where the run was started (its config.json names --model a, cwd-relative)
    a, l = "a", "l"
    step2 = os.path.join(a, "checkpoints", "step_000002")
    train.main(["--resume", a, "--steps", "3", "--save-every", "1", "--keep", "10"])
    assert checkpoint.resolve_model(a).endswith("step_000003")
    loaded, real = [], models.load_model
    monkeypatch.setattr(models, "load_model", lambda name, *a, **k: loaded.append(name) or real(name, *a, **k))
    train.main(["--resume", l, "--steps", "2", "--save-every", "1"])
    assert [os.path.realpath(n) for n in loaded] == [os.path.realpath(step2)]
    ckpt = os.path.join(l, "checkpoints", "step_000002")
    with open(os.path.join(ckpt, "base.json")) as f:
        assert json.load(f)["identity"] == files.identity(step2)
    assert os.path.realpath(lora.base_of(ckpt)) == os.path.realpath(step2)
    shutil.rmtree(step2)   # the base pruned (--keep): one line, not the run's newer step
    capsys.readouterr()
    with pytest.raises(UserError, match=f"^{ckpt}: the base its adapter was trained on .* is gone or holds another model"):
        models.load_model(l)


def test_a_lora_checkpoint_finds_its_base_from_another_folder_and_a_moved_clone(pair, tmp_path, monkeypatch):
    # L8: at a7c59f5 the adapter recorded its base as typed ("a/checkpoints/step_000002", cwd-relative):
    # evaluated from another folder, or after the clone moved, "model directory ... does not exist".
    monkeypatch.chdir(tmp_path)
    ckpt = checkpoint.latest_checkpoint(os.path.join(pair, "l"))
    assert os.path.realpath(lora.base_of(ckpt)) == os.path.realpath(os.path.join(pair, "a", "checkpoints", "step_000002"))
    model, _ = models.load_model(os.path.join(pair, "l"))
    assert type(model).__name__ == "Qwen2ForCausalLM"


def edit_config(ckpt, **change):
    path = os.path.join(ckpt, adapter.CONFIG)
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(change)
    for k in [k for k, v in change.items() if v is None]:
        del cfg[k]
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


DAMAGE = {   # what is done to adapter_config.json (an older checkpoint's: no base.json), the line's words
    "base is itself": (lambda c: edit_config(c, base_model_name_or_path=os.path.abspath(c)), "is an adapter checkpoint"),
    "no base": (lambda c: edit_config(c, base_model_name_or_path=None), "names no base model"),
    "r 4 -> 8": (lambda c: edit_config(c, r=8), "r 8, but"),
    "r 100000": (lambda c: edit_config(c, r=100000), "r 100000, but"),
    "not JSON": (lambda c: open(os.path.join(c, adapter.CONFIG), "w").write("{bad"), "cannot be read (Expecting"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_adapter_config_is_one_line_naming_it(pair, case, monkeypatch):
    # M7 (base is itself: RecursionError; no base: KeyError; r 8: pages of size mismatch; r 100000: 4 GB
    # allocated first) and L4 (not JSON: "Expecting property name ..." naming no file) at a7c59f5.
    monkeypatch.chdir(pair)   # where the run was started: its cwd-relative base resolves (L8 aside)
    ckpt = checkpoint.latest_checkpoint("l")
    if os.path.exists(os.path.join(ckpt, "base.json")):   # as an older version saved it
        os.remove(os.path.join(ckpt, "base.json"))
    damage, words = DAMAGE[case]
    damage(ckpt)
    with pytest.raises(UserError) as e:
        models.load_model(ckpt)
    assert str(e.value).startswith(os.path.join(ckpt, adapter.CONFIG)) and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_lora_on_a_tied_layer_is_refused_before_training(tmp_path, capsys):
    # M8: at a7c59f5 --lora-targets lm_head trained on the toy (tied embeddings), and evaluate.py's merge
    # changed the input embedding too (logits off by up to 2.3 from the trained policy).
    with pytest.raises(SystemExit) as e:
        train.main(["--lora-rank", "4", "--lora-targets", "lm_head", "--steps", "1", "--out", str(tmp_path / "r"),
                    *SMALL])
    assert e.value.code == 2
    line = one_line(capsys)
    assert line.startswith("error: --lora-targets lm_head: lm_head shares its weight with another layer"), line
    assert not os.path.exists(tmp_path / "r")


def test_an_adapter_on_a_tied_layer_is_evaluated_as_it_was_trained(tmp_path):
    # M8 (evaluation): at a7c59f5 checkpoint.load_model merged an lm_head adapter into the weight the
    # input embedding shares: logits off by up to 2.32 from the policy that was trained.
    import torch
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    base, tok = models.load_model("toy")
    policy = lora.add_adapter(base, dict(lora_rank=4, lora_alpha=32.0, lora_targets="lm_head"),
                              checkpoint.resolve_model("toy"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)   # a trained adapter (lora_B starts at zero)
    lora.save(ckpt, policy, {n: p for n, p in policy.named_parameters() if p.requires_grad})
    tok.save_pretrained(ckpt)
    evaluated, _ = models.load_model(ckpt)
    ids = torch.tensor([tok.encode("3+4+2=")])
    with torch.no_grad():
        diff = (policy.eval()(ids).logits - evaluated.eval()(ids).logits).abs().max().item()
    assert diff < 1e-5, diff
