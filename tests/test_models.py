"""harness/models.py's load_model: a checkpoint pruned while it loads and weights that do not fit
their config each end in one line."""
import json
import os
import shutil

import pytest
import transformers

import toy
from harness import files, models
from harness.files import UserError
from runs import ckpt, write


def test_a_checkpoint_pruned_while_loading_is_said_plainly(run_copy, monkeypatch):
    load = transformers.AutoTokenizer.from_pretrained

    def pruned_first(path, **kw):   # the training process prunes the checkpoint as we start reading it
        shutil.rmtree(path)
        return load(path, **kw)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", pruned_first)
    with pytest.raises(files.UserError, match=f"its checkpoint {ckpt(run_copy, 2)} was removed while loading"):
        models.load_model(run_copy)


def test_weights_that_do_not_fit_the_config_are_one_line(tmp_path):
    model = str(tmp_path / "model")
    shutil.copytree(toy.base_model(), model)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    write(os.path.join(model, "config.json"), json.dumps(dict(cfg, vocab_size=5000)))
    with pytest.raises(UserError) as e:
        models.load_model(model)
    assert str(e.value).startswith(f"{model}/model.safetensors: model.embed_tokens.weight has shape [272, ")
    assert "builds [5000, " in str(e.value)


def test_a_checkpoint_pruned_while_it_loads_is_one_line(tmp_path, monkeypatch):
    # L5 (C63): at a7c59f5 safetensors' "unable to open file <...> in read-only mode" (a RuntimeError)
    # came out bare, a traceback in evaluate.py, when the run pruned the checkpoint mid-load.
    import shutil
    import transformers
    from harness import models
    from harness.files import UserError
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    shutil.copytree(toy.base_model(), ckpt)

    def pruned(path, **kw):
        shutil.rmtree(ckpt)
        raise RuntimeError(f"unable to open file <{path}/model.safetensors> in read-only mode: No such file")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", pruned)
    with pytest.raises(UserError, match=f"^cannot load model '{tmp_path / 'run'}': its checkpoint {ckpt} was "
                                        "removed while loading"):
        models.load_model(str(tmp_path / "run"))
