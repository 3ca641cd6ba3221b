"""Models and runs: what a --model value names and loading it (a LoRA checkpoint merged; sharded
over ranks), checkpoints written whole, and a training run's folder (lock, resume, exit codes)."""
import json
import os
import random
import shutil
import struct
import sys
import zipfile
from contextlib import ExitStack, contextmanager

import numpy as np
import torch
import torch.distributed as dist

from harness import files, lora
from harness.files import UserError, first_line, fresh_name
from harness.lora import ADAPTER, CONFIG, add_adapter, base_of, is_adapter, load_adapter
from harness.parallel import (MASTER, PREEMPTED, all_gather, load_optimizer, rebuild_buffers,
                              refresh_sampler, teardown, wrap)

PREFIX = "step_"
# --model toy: the toy world's committed warm start (toy.BASE_DIR; the machinery never imports toy)
TOY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "toy_base")
ALIASES = {
    "deepseek-r1-distill-qwen-7b": "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "qwen3-4b-instruct": "Qwen/Qwen3-4B-Instruct-2507",
    # the authors' released RLCM checkpoints (the paper's 7B at step 600, the 4B at step 240)
    "rlcm-7b": "Melodramas/RLCM-DeepSeek-R1-Distill-Qwen-7B",
    "rlcm-4b": "Melodramas/RLCM-Qwen3-4B-Instruct",
}


def resolve_model(name):
    """Alias, HF id, model dir, checkpoint dir or run dir (-> its latest complete checkpoint)."""
    if name == "toy":
        if not os.path.exists(os.path.join(TOY_DIR, "model.safetensors")):
            raise UserError(f"--model toy: {TOY_DIR} is missing; rebuild it with python toy.py")
        return TOY_DIR
    if name in ALIASES:
        return ALIASES[name]
    if os.path.isdir(os.path.join(name, "checkpoints")):
        ckpt = latest_checkpoint(name)
        if ckpt is None:
            raise UserError(f"run directory {name} has no complete checkpoint under checkpoints/")
        return ckpt
    if os.path.isdir(name):
        return name
    # owner/name is an HF id unless `owner` is a local folder (runs/typo: say so, not ask the hub)
    if name.count("/") == 1 and name[0] not in "./" and not os.path.isdir(name.split("/")[0]):
        return name
    if "/" in name:
        raise UserError(f"model directory {name} does not exist")
    raise UserError(f"model {name!r} is not a directory, an HF id (owner/name) or an alias "
                    f"({', '.join(['toy', *ALIASES])})")


def check_available(name):
    """UserError before any data is read for a model that cannot load (offline, not cached)."""
    path = resolve_model(name)
    if os.path.isdir(path):
        return
    from huggingface_hub import constants, try_to_load_from_cache
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(path, "config.json"), str):
        raise UserError(f"model {name!r} ({path}) is not in the local Hugging Face cache and the hub is "
                        f"offline (HF_HUB_OFFLINE): download it first (hf download {path}) or pass a local directory")


def fetch(name):
    """Download an HF model before the workers start (rank 0 would, while the others wait)."""
    path = resolve_model(name)
    from huggingface_hub import constants, snapshot_download
    if os.path.isdir(path) or constants.HF_HUB_OFFLINE:
        return
    try:
        snapshot_download(path, ignore_patterns=["*.bin", "*.pth", "*.pt", "*.h5", "*.msgpack", "*.onnx", "*.gguf"])
    except (OSError, ValueError) as e:
        raise UserError(f"cannot download model {name!r} ({path}): {first_line(e, 300)} -- check "
                        "the name, the network and your access (hf auth login), or pass a local "
                        "directory") from None


def load_model(name, dtype=torch.float32, trust_remote_code=False):
    """(model, tokenizer) of a --model value, a LoRA checkpoint merged; failures: one UserError."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model(name)
    if is_adapter(path):  # a --lora-rank checkpoint: its base and tokenizer, the adapter merged in
        model, tok = load_model(base_of(path), dtype, trust_remote_code)
        # kept unmerged on a weight another layer shares (a tied LM head): merging changes both
        keep = lora.tied(model, lora.read_config(path).get("target_modules") or [])
        try:
            return (load_adapter(model, path, trainable=False) if keep else lora.merged(model, path)), tok
        except UserError:
            raise
        except (RuntimeError, ValueError) as e:  # peft's size mismatch, unknown module (pages long)
            raise UserError(f"{path}: its adapter does not fit its base ({first_line(e)}): restore "
                            f"{CONFIG} from a copy of the run") from None
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        # use_kernels=False: by default transformers swaps layers for kernels from the hub
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, use_kernels=False)
    except UserError:
        raise
    except (OSError, ValueError, KeyError, SafetensorError, RuntimeError) as e:
        if path != name and not os.path.lexists(path):
            raise UserError(f"cannot load model {name!r}: its checkpoint {path} was removed while loading "
                            "(the run is still saving and keeps only the last --keep): try again") from None
        first = first_line(e, 300)
        where = "" if path == name else f" ({path})"
        hint = ("a weights file is damaged (cut short?): copy it again" if isinstance(e, SafetensorError)
                else "its weights do not fit its config.json: restore the matching one"
                if "ignore_mismatched_sizes" in first   # transformers' refusal, its report above
                else "offline? download it first (hf download ID) or pass a local directory with weights")
        raise UserError(f"cannot load model {name!r}{where}: {first} -- {hint}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def with_adapter(model, cfg, ckpt=None, fresh=False):
    """The policy of a --lora-rank run: checkpoint `ckpt`'s adapter (a resume: on the base it was
    trained on), or a fresh one (also with `fresh`: its shape, on the meta device)."""
    base = base_of(ckpt) if ckpt else resolve_model(cfg["model"])
    shared = [] if ckpt else lora.tied(model, lora.targets(cfg["lora_targets"]))
    if shared:
        raise UserError(f"--lora-targets {cfg['lora_targets']}: {', '.join(shared)} shares its "
                        "weight with another layer (tie_word_embeddings): merging the adapter for "
                        "evaluation would change both; adapt other modules")
    try:
        model = load_adapter(model, ckpt) if ckpt and not fresh else add_adapter(model, cfg, base)
    except ValueError as e:
        raise UserError(f"--lora-targets {cfg['lora_targets']}: {first_line(e)}") from None
    # the base's absolute path (a cwd-relative one breaks in another folder); base.json records more
    model.peft_config[ADAPTER].base_model_name_or_path = os.path.abspath(base) if os.path.isdir(base) else base
    return model


def load_sharded(name, device, logprobs, offload=False, trust_remote_code=False, grad_ckpt=None,
                 adapt=None):
    """(policy, sampler, lm, tokenizer) on every rank; rank 0 alone reads the weights and broadcasts
    them to the meta-built, sharded model. adapt(model, meta) adds the LoRA adapter, fp32 like the
    base: an FSDP2 unit of mixed dtypes fails (verl #3470)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    full = {}
    if MASTER:
        model, tok = load_model(name, torch.float32, trust_remote_code)
        full = (adapt(model, meta=False) if adapt else model).state_dict()
        del model
    dist.barrier()  # rank 0 has resolved (and downloaded) the model
    path = resolve_model(name)
    if not MASTER:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                              trust_remote_code=trust_remote_code)
    if adapt:
        lm = adapt(lm, meta=True)
    lm.config.use_cache = False
    if grad_ckpt:
        grad_ckpt(lm)
    policy, sampler = wrap(lm, device, logprobs, offload)
    policy.to_empty(device="cpu" if offload else device)  # offloaded shards live on the host
    set_model_state_dict(lm, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    rebuild_buffers(lm, device)  # buffers are not offloaded: they stay where the compute runs
    sampler.to_empty(device=device)
    refresh_sampler(sampler, policy, frozen=True)
    rebuild_buffers(sampler, device)
    return policy, sampler, lm, tok


def step_of(ckpt):
    return int(os.path.basename(ckpt)[len(PREFIX):])


def checkpoints(run_dir):
    """Published checkpoint directories of a run (step_NNNNNN, no .tmp), oldest first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, n) for n in sorted(os.listdir(root))
            if n.startswith(PREFIX) and n[len(PREFIX):].isdigit()]


def _safetensors_ok(path):
    """The header parses and the file is as long as the header says (a cut-off copy is not)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        return os.path.getsize(path) == 8 + n + end
    except (OSError, ValueError, KeyError, TypeError, struct.error, MemoryError, OverflowError):
        return False


def _zip_ok(path):
    """torch.save files are zip archives: a cut-off one has no readable central directory."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (OSError, zipfile.BadZipFile):
        return False


def missing(ckpt, resume=False):
    """What a checkpoint lacks to load as a model (resume: state.pt, probe.pt too); [] if none."""
    try:
        names = os.listdir(ckpt)
    except OSError:   # a file, or removed meanwhile
        return ["the folder"]
    config = CONFIG if is_adapter(ckpt) else "config.json"
    need = (config, "state.pt", "probe.pt") if resume else (config,)
    lack = [n for n in need if not os.path.isfile(os.path.join(ckpt, n))]
    lack += [f"{n} (cut short)" for n in ("state.pt", "probe.pt")
             if os.path.isfile(os.path.join(ckpt, n)) and not _zip_ok(os.path.join(ckpt, n))]
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    lack += [f"{n} (cut short)" for n in weights if not _safetensors_ok(os.path.join(ckpt, n))]
    return lack if weights else lack + ["model.safetensors"]


def latest_checkpoint(run_dir, say=None, resume=False):
    """The newest complete checkpoint; `say` names each newer incomplete one and what it lacks."""
    say = say or (lambda msg: print(msg, file=sys.stderr))
    for ckpt in reversed(checkpoints(run_dir)):
        lack = missing(ckpt, resume)
        if not lack:
            return ckpt
        if not os.path.lexists(ckpt):   # pruned by the run's writer meanwhile: a newer one exists
            return latest_checkpoint(run_dir, say, resume)
        say(f"skipping incomplete checkpoint {ckpt}: missing {', '.join(lack)}")
    return None


@contextmanager
def reading(path):
    """Turn a damaged or refused torch file into one UserError line (torch's own message for a
    refused pickle advises weights_only=False, which would run whatever code the file holds)."""
    import pickle
    try:
        yield
    except pickle.UnpicklingError:
        raise UserError(f"{path} holds objects other than tensors and plain data, so it was not "
                        "loaded (that could run code): it was not written by this code") from None
    except (RuntimeError, EOFError, KeyError, zipfile.BadZipFile) as e:
        raise UserError(f"{path} is damaged ({first_line(e)}): use an earlier checkpoint") from None


def rng_state():
    _, keys, pos, *_ = np.random.get_state()
    # numpy's state as a tensor, so that torch.load(weights_only=True) can read it back
    state = {"torch": torch.get_rng_state(), "numpy": torch.from_numpy(keys.astype(np.int64)),
             "numpy_pos": int(pos), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"]))
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(folder):
    """fsync each file under folder, then the folders: a crash after the rename finds them whole."""
    for d, _, names in os.walk(folder, topdown=False):
        for n in names:
            _fsync(os.path.join(d, n))
        _fsync(d)


def save_checkpoint(run_dir, step, write, keep=2):
    """write(tmp_dir) fills a fresh folder, published atomically; then all but the last `keep` (0:
    all) complete ones at or below `step` are pruned. A failed write (disk full): one UserError."""
    from safetensors import SafetensorError
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"{PREFIX}{step:06d}")
    os.makedirs(root, exist_ok=True)
    for n in os.listdir(root):   # left by a killed save (we hold the run's lock: no one else saves)
        if n.startswith(PREFIX) and n.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    tmp = fresh_name(final)
    os.mkdir(tmp)
    try:
        write(tmp)
        _sync_tree(tmp)   # on disk before the rename publishes it and any older one is pruned
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (OSError, RuntimeError, SafetensorError)):   # torch.save says RuntimeError
            raise UserError(f"cannot write checkpoint {final} ({first_line(e)}): is the disk full? "
                            "The checkpoints saved before it are intact") from None
        raise
    if os.path.lexists(final):   # this step's incomplete one, skipped on resume
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    done = [c for c in checkpoints(run_dir) if step_of(c) <= step and not missing(c, resume=True)]
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


OWNER = "run"   # checkpoints/run: the folder of the run these checkpoints belong to


def own_checkpoints(run_dir, check=True):
    """check (a resume): refuse (one line, rank 0's word) checkpoints another run still uses, a
    copied run whose checkpoints/ links to the original's; else (a save) mark them this run's in
    checkpoints/run. A link to a bigger disk, or a moved run, keeps working."""
    root, me, owner = os.path.join(run_dir, "checkpoints"), os.path.realpath(run_dir), None
    if MASTER and os.path.isfile(os.path.join(root, OWNER)):
        with open(os.path.join(root, OWNER), encoding="utf-8") as f:
            owner = f.read().strip()
    theirs = owner and owner != me and os.path.join(owner, "checkpoints")
    shared = bool(theirs and os.path.exists(theirs) and os.path.samefile(theirs, root))
    if check and all_gather(shared)[0]:
        raise UserError(f"--resume {run_dir}: its checkpoints/ is a link to the checkpoints of the "
                        f"run {owner}; resuming would write into and prune them: copy a run with "
                        f"cp -rL, or link {root} to a folder of its own")
    if not check and MASTER and os.path.isdir(root) and owner != me:   # a refusal changes nothing
        with files.replacing(os.path.join(root, OWNER)) as f:
            f.write(me + "\n")


LOCKS = ExitStack()  # the run folder's lock, released by exit_codes() however the run ends


def hold_lock(out, new=False):
    """Rank 0 holds OUT/lock until the run ends. new: the folder was absent at the start; a run
    found there now is refused."""
    err = None
    if MASTER:
        try:
            LOCKS.enter_context(files.locked(out, "training run"))
            found = [f for f in ("config.json", "checkpoints") if os.path.lexists(os.path.join(out, f))]
            if new and found:
                raise UserError(f"{out} was taken by another run while this one loaded (it holds {found[0]}): "
                                f"pass --resume {out} to continue that run, or another --out")
        except UserError as e:
            err = str(e)
    err = all_gather(err)[0]
    if err:
        raise UserError(err)


class RunFolder:
    """cfg["out"] and the checkpoint this run starts from (None: a new run)."""

    def __init__(self, cfg, say, data_digest):
        self.out, self.say = cfg["out"], say
        self.metrics, self.samples, self.heldout = (
            os.path.join(self.out, f) for f in ("metrics.jsonl", "samples.jsonl", "heldout.jsonl"))
        self.existed = all_gather(os.path.isdir(self.out))[0]
        if self.existed:  # locked before its checkpoints are read
            hold_lock(self.out)
        # a --data file changed since it began is refused on resume: its cursor reads other rows
        now = all_gather(data_digest(cfg["data"]) if MASTER else None)[0]
        saved, cfg["data_sha256"] = cfg.get("data_sha256"), now
        if cfg["resume"] and saved and saved != now:
            raise UserError(f"--resume {self.out}: {cfg['data']} changed since the run began "
                            f"(sha256 {saved[:12]} in config.json, now {(now or 'no file')[:12]}): "
                            "put the run's data back, or start a new run with another --out")
        if cfg["resume"]:
            own_checkpoints(self.out)
        self.ckpt = ckpt = latest_checkpoint(self.out, say=say, resume=True)
        if cfg["resume"] and ckpt is None:
            raise UserError(f"--resume {self.out}: the run has no complete checkpoint; start it "
                            "again without --resume")
        if ckpt and not cfg["resume"]:
            raise UserError(f"{self.out} already holds a run: pass --resume {self.out} to continue "
                            "it, or another --out")
        self.done = bool(ckpt) and step_of(ckpt) >= cfg["steps"]
        if self.done:
            say(f"{self.out} is at step {step_of(ckpt)} already (--steps {cfg['steps']}): "
                "nothing to train; pass a larger --steps")

    def lock(self):
        """A new folder is locked only once the data and the model are known to load."""
        if not self.existed:
            hold_lock(self.out, new=True)

    def start(self, cfg):
        """A new run: config.json and empty logs."""
        if MASTER:
            os.makedirs(self.out, exist_ok=True)
            files.write_json(os.path.join(self.out, "config.json"), cfg)
            for path in (self.metrics, self.samples, self.heldout):
                with files.replacing(path):
                    pass

    def restore(self, cfg, policy, opt, sched, load_probe):
        """(probe, probe_opt, step, cursor), the optimizer, scheduler and RNG state restored."""
        with reading(os.path.join(self.ckpt, "state.pt")):
            # mmap: only rank 0 reads the optimizer state (load_optimizer broadcasts it)
            state = torch.load(os.path.join(self.ckpt, "state.pt"), weights_only=True, mmap=True)
            load_optimizer(policy, opt, state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            step, cursor = state["step"], state["cursor"]
        with reading(os.path.join(self.ckpt, "probe.pt")):
            probe, probe_opt = load_probe(os.path.join(self.ckpt, "probe.pt"), cfg["probe_lr"])
        set_rng_state(state["rng"])  # last: building the probe draws from torch's RNG
        lr = cfg["lr"]  # rates given with --resume replace those restored with the optimizer states
        sched.base_lrs = [lr] * len(opt.param_groups)
        for g, fn in zip(opt.param_groups, sched.lr_lambdas):
            g["initial_lr"], g["lr"] = lr, lr * fn(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in opt.param_groups]
        for g in probe_opt.param_groups:
            g["lr"] = cfg["probe_lr"]
        if MASTER:
            for path in (self.metrics, self.samples, self.heldout):
                files.truncate_metrics(path, step)
            saved = read_config(self.out)
            if changed := changes(saved, cfg):   # an older version's keys stay: the run had them
                files.write_json(os.path.join(self.out, "config.json"),
                                 {**saved, **cfg, "resume": None})
                self.say("changed on resume (written to config.json): " +
                         ", ".join(f"{k} {a} -> {b}" for k, a, b in changed))
        self.say(f"resuming {self.out} from step {step}")
        return probe, probe_opt, step, cursor

    def first_accuracy(self, cfg, n):
        """(step 0's held-out accuracy or None, whether of another set) for a resume's last line."""
        rows = files.read_jsonl(self.metrics) if MASTER else []
        first = next((r for r in rows if r.get("eval") and r.get("step") == 0), {})
        other = (first.get("eval_n", n), first.get("eval_data", cfg["eval_data"])) != (n, cfg["eval_data"])
        return first.get("eval_accuracy"), other

    def save(self, at, model, model_sd, tok, save_probe, state, keep):
        """Checkpoint `at` (save_checkpoint; state: state.pt's step, cursor, optimizer, scheduler),
        then RUN/model, the weights to serve (export)."""
        if MASTER:
            if getattr(model.config, "tie_word_embeddings", False):   # gathered: twice in model_sd
                model_sd.pop("lm_head.weight", None)

            def write(tmp):
                if lora.has_adapter(model):
                    lora.save(tmp, model, model_sd)
                else:
                    model.save_pretrained(tmp, state_dict=model_sd)
                tok.save_pretrained(tmp)
                save_probe(os.path.join(tmp, "probe.pt"))
                torch.save(dict(state, rng=rng_state()), os.path.join(tmp, "state.pt"))
            ckpt = save_checkpoint(self.out, at, write, keep=keep)
            own_checkpoints(self.out, check=False)
            export(self.out, ckpt, model, model_sd, tok)


def export(run_dir, ckpt, model, model_sd, tok):
    """RUN/model: checkpoint `ckpt`'s weights as a bf16 Hugging Face folder that transformers and
    vLLM load as they are (config bfloat16, use_cache true; tokenizer, generation config and
    probe.pt beside them; no optimizer state). A LoRA run's adapter is merged into its base."""
    final = os.path.join(run_dir, "model")
    tmp = fresh_name(final)
    os.mkdir(tmp)
    try:
        if lora.has_adapter(model):   # sharded: rank 0 has only the adapter, the base is read again
            sharded = dist.is_initialized()
            (load_model(ckpt, torch.bfloat16)[0] if sharded else lora.merged_copy(model)).save_pretrained(tmp)
        else:
            bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model_sd.items()}
            model.save_pretrained(tmp, state_dict=bf16)
        tok.save_pretrained(tmp)
        shutil.copy(os.path.join(ckpt, "probe.pt"), tmp)
        path = os.path.join(tmp, "config.json")
        files.write_json(path, {**files.read_json(path), "dtype": "bfloat16", "use_cache": True})
        _sync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = fresh_name(final) if os.path.lexists(final) else None
    if old:
        os.replace(final, old)
    os.replace(tmp, final)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def check_out(path, flag="--out", writer=None):
    """A folder we can create or write into: not a file, and its nearest existing parent writable.
    writer "train.py" or "evaluate.py": nor a folder of another kind whose files it overwrites."""
    if os.path.islink(path) and not os.path.exists(path):
        raise UserError(f"{flag} {path} is a link to {os.readlink(path)}, which does not exist: "
                        f"create that folder, or pass another {flag}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path} is a file, not a folder: pass a folder path")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {parent} is not writable; pass a folder you can write to")
    kind, shown = folder_kind(path) if writer and os.path.isdir(path) else ("empty", [])
    if kind not in TAKES.get(writer, ("empty",)):
        what = dict(run="is a training run's folder", model="is a model's folder", evaluation="is "
                    "an evaluation's folder", other="holds files and is no training run's folder")
        takes = ", or an evaluation's" if writer == "evaluate.py" else " (or resumes a run there)"
        fix = (f"evaluate into {os.path.join(path, 'eval')} (the default for --model {path}) or "
               "another folder" if kind == "run" else
               f"{writer} writes only into a new or empty folder{takes}; pass another {flag}")
        raise UserError(f"{flag} {path} {what[kind]} (it has {', '.join(shown[:3])}): {fix}")


# What each writer's --out may already be: train.py only its own runs (a resume, or a new run's
# refusal later), evaluate.py anything but a run or a model (a sweep may share a folder).
TAKES = {"train.py": ("empty", "run"), "evaluate.py": ("empty", "evaluation", "other")}


def folder_kind(path):
    """(kind, the names that show it): run, model, evaluation, empty (a lock at most) or other."""
    names = sorted(set(os.listdir(path)) - {files.LOCK})
    weights = [n for n in names if n.endswith((".safetensors", ".bin"))]
    config = [n for n in ("config.json", CONFIG) if n in names]   # a full model or a LoRA adapter
    for kind, shown in (("run", [n for n in ("metrics.jsonl", "checkpoints") if n in names]),
                        ("model", [*config, *weights] if weights and config else []),
                        ("evaluation", [n for n in ("samples.jsonl", "results.json") if n in names])):
        if shown:
            return kind, shown
    return ("other", names) if names else ("empty", [])


def read_config(run, flag="--resume"):
    """RUN/config.json (or the file RUN: --config) as a dict, or one UserError line."""
    path = run if os.path.isfile(run) else os.path.join(run, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{flag} {run}: no run's config.json there to read; "
                        "pass the --out directory of an earlier run or its config.json")
    try:
        saved = files.read_json(path)
    except (ValueError, OSError) as e:
        raise UserError(f"{flag} {run}: {path} is unreadable ({type(e).__name__}: {e}); "
                        "restore it or start a new run") from None
    if not isinstance(saved, dict):
        raise UserError(f"{flag} {run}: {path} is not a JSON object; restore it or start a new run")
    return saved


def changes(saved, cfg):
    """[(key, saved value, new value)] for saved keys whose value differs in cfg."""
    skip = ("resume", "out", "trust_remote_code")
    return [(k, v, cfg[k]) for k, v in saved.items() if k in cfg and k not in skip and v != cfg[k]]


def interrupted(cfg):
    """The one line printed on Ctrl-C: where the run stands and how to continue it."""
    out = cfg and cfg["out"]
    ckpt = out and os.path.isdir(out) and latest_checkpoint(out, say=lambda m: None, resume=True)
    if not ckpt:
        return "interrupted before the first checkpoint: nothing to resume; run the command again"
    flag = " --trust-remote-code" if cfg["trust_remote_code"] else ""
    return (f"interrupted: {ckpt} is the last checkpoint; continue with: "
            f"python train.py --resume {out}{flag}")


class Preempted(Exception):
    """SIGTERM or SIGUSR1 stopped the run after a step, saved: the line says how to continue."""


@contextmanager
def exit_codes():
    """train.py's main runs inside this: its exit codes, the lock released and the process group
    torn down however it ends. Yields a dict whose "cfg" the Ctrl-C line reads."""
    state, stopped, finished = {}, False, False
    try:
        yield state
        finished = True
    except UserError as e:   # data.DataError and probe.NotAProbe too
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except FloatingPointError as e:
        print(f"stopped: {e}; the last good checkpoint is left untouched", file=sys.stderr)
        sys.exit(3)
    except Preempted as e:
        if MASTER:
            print(f"\n{e}", file=sys.stderr)
        sys.exit(PREEMPTED)
    except KeyboardInterrupt:  # nothing new is finished or saved: the last checkpoint stays
        stopped = True         # the line is printed below, once the progress bar has closed
    finally:
        LOCKS.close()
        teardown(finished)
    if stopped:
        if MASTER:
            print(f"\n{interrupted(state.get('cfg'))}", file=sys.stderr)
        sys.exit(130)
