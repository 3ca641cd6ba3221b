"""--lora-rank R: the policy trains a LoRA adapter (peft) on its frozen base. How it is injected,
merged and saved: docs/reference.md, "LoRA checkpoints". peft is imported only with --lora-rank."""
import os
import re
from collections import Counter

import torch

from harness.files import UserError, first_line, identity, read_json, write_json

ADAPTER = "default"  # peft's adapter name, dropped from the saved keys as peft does
BASE, WEIGHTS = "base.json", "adapter_model.safetensors"
CONFIG = "adapter_config.json"  # an adapter checkpoint holds this for config.json


def is_adapter(path):
    return os.path.isfile(os.path.join(path, CONFIG))


def has_adapter(model):
    """Whether a model carries a LoRA adapter: peft marks the model it adapts."""
    return hasattr(model, "peft_config")


def targets(text):
    """--lora-targets: "all-linear" (the decoder's, not the LM head) or a list ("q_proj,v_proj")."""
    return text if text == "all-linear" else [t.strip() for t in text.split(",") if t.strip()]


def adapter_params(model, rank, target_text):
    """Parameters of a rank-`rank` adapter on the decoder layers: r x (in + out) each linear."""
    wanted = targets(target_text)
    return sum(rank * (m.in_features + m.out_features) for name, m in model.model.layers.named_modules()
               if isinstance(m, torch.nn.Linear) and (wanted == "all-linear" or name.split(".")[-1] in wanted))


def merged_copy(model, dtype=torch.bfloat16):
    """The generation copy of an adapted `model`: no peft layers, in `dtype`, the adapter merged."""
    import copy
    from peft.tuners.lora import LoraLayer
    plain = copy.deepcopy(model).eval().requires_grad_(False)
    for name, m in list(plain.named_modules()):
        if isinstance(m, LoraLayer):
            parent, _, leaf = name.rpartition(".")
            setattr(plain.get_submodule(parent), leaf, m.base_layer)
    del plain.peft_config  # a plain model now (has_adapter is False)
    for p in plain.parameters():  # not buffers: the rotary frequencies stay fp32 (parallel.wrap)
        p.data = p.data.to(dtype)
    merge_into(plain, model)
    return plain


@torch.no_grad()
def merge_into(plain, model, gathered=None):
    """Write each adapted linear of `model` into `plain` as W + s B A (s = alpha / rank), in fp32
    cast once (merging into the policy and unmerging would drift its bf16 base). A sharded `model`
    passes `gathered`, {name: full tensor} of one group's adapters whose W is already in `plain`."""
    from peft.tuners.lora import LoraLayer
    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        dst = plain.get_submodule(name).weight
        if gathered is None:
            W, A, B = m.base_layer.weight, m.lora_A[ADAPTER].weight, m.lora_B[ADAPTER].weight
        elif f"{name}.lora_A.{ADAPTER}.weight" in gathered:
            W, A, B = dst, gathered[f"{name}.lora_A.{ADAPTER}.weight"], gathered[f"{name}.lora_B.{ADAPTER}.weight"]
        else:
            continue
        dst.copy_(torch.addmm(W.float(), B.float(), A.float(), alpha=m.scaling[ADAPTER]))


def add_adapter(model, cfg, base_path):
    """The model with a fresh adapter (lora_B zero: it starts equal to the base), base frozen."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=cfg["lora_rank"], lora_alpha=cfg["lora_alpha"], lora_dropout=0.0,
                        target_modules=targets(cfg["lora_targets"]))
    model = get_peft_model(model, config).base_model.model
    model.peft_config[ADAPTER].base_model_name_or_path = base_path  # peft had the model's name here
    return model


def check_fits(model, ckpt):
    """UserError (one line) unless the adapter in `ckpt` fits `model`: the rank in its config and
    its tensors' shapes, read before peft builds anything (rank 60000 would allocate first)."""
    from safetensors import safe_open
    r, path = read_config(ckpt).get("r"), os.path.join(ckpt, WEIGHTS)
    modules, bad = dict(model.named_modules()), None
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        bad = f"rank r {r!r} is no positive integer"
    elif os.path.isfile(path):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                name, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
                m, shape = modules.get(name), list(f.get_slice(key).get_shape())
                linear = isinstance(m, torch.nn.Linear)
                want = linear and ([r, m.in_features] if kind[0] == "A" else [m.out_features, r])
                if shape != want:
                    bad = f"{key} is {shape}, " + (f"rank {r} on {name} takes {want}" if linear
                                                   else f"the base has no linear layer {name}")
                    break
    if bad:
        raise UserError(f"{ckpt}: its adapter does not fit its base ({bad}): restore {CONFIG} and "
                        f"{WEIGHTS} from a copy of the run")


def load_adapter(model, ckpt, trainable=True):
    """The model with the adapter saved in checkpoint `ckpt` (check_fits first)."""
    from peft import PeftModel
    check_fits(model, ckpt)
    return PeftModel.from_pretrained(model, ckpt, is_trainable=trainable).base_model.model


def merged(model, ckpt):
    """The base `model` with checkpoint `ckpt`'s adapter merged into its weights."""
    from peft import PeftModel
    check_fits(model, ckpt)
    return PeftModel.from_pretrained(model, ckpt).merge_and_unload()


def save(folder, model, state):
    """Write the adapter in peft's format (keys without the adapter name) and base.json."""
    from safetensors.torch import save_file
    model.peft_config[ADAPTER].task_type = "CAUSAL_LM"   # AutoPeftModelForCausalLM takes it as is
    model.peft_config[ADAPTER].save_pretrained(folder)
    weights = {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v.detach().contiguous()
               for k, v in state.items()}
    save_file(weights, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
    # base.json: the base (a folder or a hub id) by path, path from FOLDER and content (base_of)
    base = model.peft_config[ADAPTER].base_model_name_or_path
    rel = os.path.relpath(base, folder) if os.path.isdir(base) else None
    write_json(os.path.join(folder, BASE), dict(path=base, relative=rel, identity=identity(base)))


def read_config(ckpt):
    """CKPT/adapter_config.json; UserError when it is not JSON or names no base."""
    path = os.path.join(ckpt, CONFIG)
    try:
        cfg = read_json(path)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({first_line(e)}): restore it from a copy of the run") from None
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if not isinstance(base, str) or not base:
        raise UserError(f"{path} names no base model (base_model_name_or_path): restore it from a copy of the run")
    return cfg


def base_of(ckpt):
    """The base an adapter checkpoint was trained on (base.json: the first path holding a model of
    its identity); UserError when it is gone or changed, or names an adapter."""
    named = read_config(ckpt)["base_model_name_or_path"]
    try:
        rec = read_json(os.path.join(ckpt, BASE))
        want, paths = rec["identity"], [rec["relative"] and os.path.join(ckpt, rec["relative"]), rec["path"], named]
    except FileNotFoundError:   # an older checkpoint: the base as its config names it
        want, paths = None, [named]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{os.path.join(ckpt, BASE)} is damaged ({first_line(e)}): restore it from a copy "
                        "of the run") from None
    for path in filter(None, paths):   # an adapter is no base (one naming itself would recurse)
        if not is_adapter(path) and (want is None or identity(path) == want):
            return os.path.normpath(path) if os.path.isdir(path) else path
    if want is None:
        raise UserError(f"{os.path.join(ckpt, CONFIG)}: its base {named} is an adapter checkpoint, not a model: "
                        "restore the file from a copy of the run")
    raise UserError(f"{ckpt}: the base its adapter was trained on ({rec['path']}, identity {want}) is gone or "
                    "holds another model now: restore that model there, or use another checkpoint")


def tied(model, wanted):
    """The modules among `wanted` (targets) whose weight another shares (tie_word_embeddings)."""
    if wanted == "all-linear":
        return []
    if isinstance(wanted, str):   # peft reads any other string as a regex on the full name
        picked = lambda name: re.fullmatch(wanted, name) is not None  # noqa: E731
    else:
        picked = lambda name: name in wanted or name.split(".")[-1] in wanted  # noqa: E731
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))  # names per tensor
    return [name for name, m in model.named_modules() if picked(name)
            and isinstance(getattr(m, "weight", None), torch.nn.Parameter) and uses[id(m.weight)] > 1]
