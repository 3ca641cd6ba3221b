"""(model, tokenizer) for any --model value, a LoRA checkpoint merged into its base, any failure one
UserError line:

    model, tok = load_model("deepseek-r1-distill-qwen-7b", torch.bfloat16)
"""
import os

import torch

from harness import lora
from harness.checkpoint import CONFIG, is_adapter, resolve_model
from harness.files import UserError, first_line

def load_model(name, dtype=torch.float32, trust_remote_code=False):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model(name)
    if is_adapter(path):  # a --lora-rank checkpoint: its base (and its tokenizer), the adapter merged in
        model, tok = load_model(lora.base_of(path), dtype, trust_remote_code)
        # merged into a weight another layer shares (a tied LM head), it would change that layer too: unmerged
        keep = lora.tied(model, lora.read_config(path).get("target_modules") or [])
        try:
            return (lora.load_adapter(model, path, trainable=False) if keep else lora.merged(model, path)), tok
        except (RuntimeError, ValueError) as e:   # peft's size mismatch or unknown module: pages of text
            raise UserError(f"{path}: its adapter does not fit its base ({first_line(e)}): restore "
                            f"{CONFIG} from a copy of the run") from None
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        check_shapes(path, trust_remote_code)
        # use_kernels=False: by default transformers swaps layers for kernels from the hub
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, use_kernels=False)
    except UserError:
        raise
    except (OSError, ValueError, KeyError, SafetensorError, RuntimeError) as e:   # safetensors: "unable to open file"
        if path != name and not os.path.lexists(path):
            raise UserError(f"cannot load model {name!r}: its checkpoint {path} was removed while loading "
                            "(the run is still saving and keeps only the last --keep): try again") from None
        first = first_line(e, 300)
        where = "" if path == name else f" ({path})"
        hint = ("a weights file is damaged (cut short?): copy it again" if isinstance(e, SafetensorError)
                else "offline? download it first (hf download ID) or pass a local directory with weights")
        raise UserError(f"cannot load model {name!r}{where}: {first} -- {hint}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def check_shapes(path, trust_remote_code=False):
    """UserError before any weight is allocated when a local model's safetensors hold a tensor of
    another shape than its config.json builds."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors")) if os.path.isdir(path) else []
    if not files:
        return
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            want = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(
                cfg, trust_remote_code=trust_remote_code).state_dict().items()}
    except Exception:  # an unusual config: from_pretrained says what is wrong with it
        return
    for n in files:
        with safe_open(os.path.join(path, n), "pt") as f:
            for key in f.keys():
                shape = tuple(f.get_slice(key).get_shape())
                if want.get(key, shape) != shape:
                    raise UserError(f"{os.path.join(path, n)}: {key} has shape {list(shape)} but "
                                    f"{os.path.join(path, 'config.json')} builds {list(want[key])}: the weights "
                                    "and the config are of different models; restore the matching config.json")
