"""One node of GPUs: the launcher, process setup, FSDP2 sharding, collectives, the generation copy.

Workers get RANK / WORLD_SIZE / LOCAL_RANK from `launch` or torchrun (none: one process, identity
collectives). Layout: docs/design.md, "Scale"; the launcher: docs/reference.md, "The launcher"."""
import contextlib
import copy
import datetime
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from harness.files import UserError
from harness.lora import has_adapter, merge_into, merged_copy

RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
MASTER = RANK == 0
# Rank 0 alone writes each checkpoint (91 GB for the 7B) or, under torchrun, downloads the weights
# while the others wait in a collective: NCCL's 10 minutes would abort them (an hour: 25 MB/s)
TIMEOUT = datetime.timedelta(hours=1)
GROUPED = []  # setup's process group, once made: leave() reads it
PREEMPTED = 75  # train.py's exit after a SIGTERM or SIGUSR1 stop, saved (harness/checkpoint.py)


def setup(offload=False):
    """Init the process group (several ranks, or one for --offload); return this rank's device."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if (WORLD > 1 or offload) and not dist.is_initialized():
        if WORLD == 1:  # a one-rank group, so that FSDP2 can offload to the host
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        # with --offload DTensor's full_tensor, clip_grad_norm_ and full state dicts run collectives
        # on host shards, which NCCL cannot serve (pytorch#148532): gloo's
        backend = "gloo" if device.type == "cpu" else "cuda:nccl,cpu:gloo" if offload else "nccl"
        dist.init_process_group(backend, rank=RANK, world_size=WORLD, timeout=TIMEOUT)
        GROUPED.append(backend)
    return device


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharded(policy):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(policy, FSDPModule)


def teardown(finished=False):
    """Leave the process group. A finished run first waits for every rank, so that none closes its
    connections while another still works; a failed one does not: the others may never come."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def leave():
    """After teardown, a process that made a group exits 0 without the interpreter's finalization:
    FSDP2's meshes keep the gloo group's threads alive past destroy_process_group, and freeing them
    at shutdown can abort a finished rank (pytorch#179291: once in 190 test runs, twice in CI)."""
    if GROUPED:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)


def all_sum(values, device):
    """Sum a list of floats over ranks (identity in one process)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if WORLD > 1:
        dist.all_reduce(t)
    return t.tolist()


def padded(policy, mbs, cfg):
    """grpo.update's micro-batches under FSDP2: this rank's, then a None (2 tokens at weight 0) for
    each one more another rank has, since FSDP2 needs as many forwards and backwards on every rank.
    --offload: FSDP2 would reduce-scatter each one's gradients into the host shards with a blocking
    copy; held unsharded on the GPU instead, they are reduced once, after the last."""
    runs = mbs + [None] * (max(all_gather(len(mbs))) - len(mbs))
    hold = sharded(policy) and cfg.get("offload") and cfg.get("offload_grads", "gpu") == "gpu"
    for j, mb in enumerate(runs):
        if hold:
            policy.set_requires_gradient_sync(j == len(runs) - 1)
        yield mb


def all_gather(obj):
    """List of every rank's `obj` (picklable), in rank order."""
    if WORLD == 1:
        return [obj]
    out = [None] * WORLD
    dist.all_gather_object(out, obj)
    return out


class LogprobModel(torch.nn.Module):
    """The policy as one module whose forward is logprobs (grpo.token_logprobs: lm, ids, mask,
    temperature, chunk_size -> [N, L - 1]): inside the root forward, FSDP2 runs the chunked LM head
    on weights gathered once and reduces its gradient once."""

    def __init__(self, lm, logprobs):
        super().__init__()
        self.lm, self.logprobs = lm, logprobs

    def forward(self, input_ids, attention_mask, temperature=1.0, chunk_size=1024):
        # a fresh tensor, not a view: FSDP2 hooks the output for the backward all-gather
        return self.logprobs(self.lm, input_ids, attention_mask, temperature, chunk_size).clone()


def wrap(lm, device, logprobs, offload=False):
    """(trainable LogprobModel, generation copy) under FSDP2; one process: (lm, the copy), on CPU
    the same fp32 model. A meta lm (load_sharded) gives both unmaterialised; --lora-rank: merged."""
    cuda, sampler = device.type == "cuda", lm
    if has_adapter(lm) and (cuda or dist.is_initialized()):
        sampler = merged_copy(lm, torch.bfloat16 if cuda else torch.float32)
    elif cuda or dist.is_initialized():
        sampler = copy.deepcopy(lm).eval().requires_grad_(False)
        # bf16 weights; the buffers (rotary inv_freq) stay fp32, as from_pretrained leaves them:
        if cuda:  # bf16 frequencies turn position 1000 by 1.2 rad
            for p in sampler.parameters():
                p.data = p.data.to(torch.bfloat16)
    if not dist.is_initialized():  # one process: the policy is the model (grpo.update)
        return lm, sampler
    policy = LogprobModel(lm, logprobs)
    from torch.distributed import fsdp
    mp = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cuda else fsdp.MixedPrecisionPolicy()
    off = fsdp.CPUOffloadPolicy(pin_memory=cuda) if offload else fsdp.OffloadPolicy()
    for module in [*lm.model.layers, policy]:
        fsdp.fully_shard(module, mp_policy=mp, offload_policy=off)
    return policy, sampler


@torch.no_grad()
def rebuild_buffers(model, device):
    """Recompute every non-persistent buffer (rotary inv_freq ...) by building its module anew
    from the config on the CPU (such modules hold no parameters, so this is cheap)."""
    for name, mod in model.named_modules():
        names = [b for b in mod._non_persistent_buffers_set if mod._buffers.get(b) is not None]
        if not names:
            continue
        if not hasattr(mod, "config") or any(True for _ in mod.parameters(recurse=False)):
            raise RuntimeError(f"cannot rebuild the non-persistent buffers {names} of {name}")
        fresh = type(mod)(config=mod.config)
        for b in names:
            mod._buffers[b] = fresh._buffers[b].to(device)
        if hasattr(fresh, "attention_scaling"):
            mod.attention_scaling = fresh.attention_scaling


@torch.no_grad()
def refresh_sampler(sampler, policy, frozen=False):
    """Copy the trained (possibly sharded) weights into the generation copy: those that train, and
    with frozen=True (the first fill) the frozen ones too. Under --lora-rank an adapted linear gets
    W + s B A (lora.merge_into; sharded, its W is gathered again: the merge overwrote it).
    Sharded, each decoder layer (and each other parameter) is one all-gather per dtype on the copy's
    device (`gather_into`), not full_tensor()'s fp32 gather over gloo on the host (--offload)."""
    lm = getattr(policy, "lm", policy)  # one process: the model itself (wrap)
    if sampler is lm:
        return
    if has_adapter(lm) and not sharded(policy):
        merge_into(sampler, lm)
        return
    # remove_duplicate=False: a copy built by to_empty from the meta device has lost its tied
    # embeddings (the LM head is its own tensor), so every name is filled
    params = dict(sampler.named_parameters(remove_duplicate=False))
    layer_of = {id(p): i for i, layer in enumerate(lm.model.layers) for p in layer.parameters()}
    units = {}  # {layer or other parameter: {dtype: [(name, copy's tensor or None, shard)]}}
    for name, p in lm.named_parameters(remove_duplicate=False):
        # the adapter (gathered into a temporary: None, fp32), what trains, an adapted linear's W
        if ".lora_" in name or p.requires_grad or frozen or name.endswith(".base_layer.weight"):
            dst = None if ".lora_" in name else params[name.replace(".base_layer.", ".")]
            unit = units.setdefault(layer_of.get(id(p), name), {})  # one all-gather per dtype
            unit.setdefault(getattr(dst, "dtype", torch.float32), []).append((name, dst, p))
    groups = [(dtype, group) for unit in units.values() for dtype, group in unit.items()]
    if not sharded(policy):
        for _, group in groups:
            for _, dst, p in group:
                dst.copy_(p)  # casts to the copy's dtype
        return
    # one buffer per dtype (its largest group's) serves every group: gloo may hold a collective's
    # tensors past its return, so buffers per group could overlap: a peak of timing, not the plan
    size = {}
    for dtype, group in groups:
        size[dtype] = max(size.get(dtype, 0), sum(slots([p.shape for *_, p in group])[1]))
    device = next(iter(params.values())).device
    buffers = {dt: torch.empty((WORLD + 1) * n, dtype=dt, device=device) for dt, n in size.items()}
    for unit in units.values():
        adapter = {}
        for dtype, group in unit.items():
            gather_into([(adapter.setdefault(name, torch.empty(p.shape, dtype=dtype, device=device))
                          if dst is None else dst, p) for name, dst, p in group], buffers[dtype])
        if adapter:
            merge_into(sampler, lm, adapter)


def slots(shapes):
    """([c, ...], [slot, ...]): each parameter's rows per rank (c = ceil(d0 / W), as FSDP2 shards
    them) and its slot in a group's buffer, c rows."""
    rows = [-(-shape[0] // WORLD) for shape in shapes]
    return rows, [c * math.prod(shape[1:]) for c, shape in zip(rows, shapes)]


def gather_into(pairs, buffer=None):
    """Fill full tensors dst [d0, ...] from the FSDP2 shards of a group, pairs [(dst, DTensor)],
    with one all-gather in their dtype. Rank r holds rows [r c, r c + c), c = ceil(d0 / W): each
    rank writes its rows, padded to c and cast, into one buffer, (W + 1) x the group's slots or
    more (plan.py, "refresh"); pinned host shards under --offload copy without blocking."""
    rows, sizes = slots([dst.shape for dst, _ in pairs])
    at, n = [sum(sizes[:i]) for i in range(len(pairs))], sum(sizes)
    if buffer is None:
        buffer = torch.empty((WORLD + 1) * n, dtype=pairs[0][0].dtype, device=pairs[0][0].device)
    send, gathered = buffer[:n], buffer[n:(WORLD + 1) * n]
    for (dst, p), a in zip(pairs, at):
        local = p.to_local().reshape(-1)
        send[a:a + local.numel()].copy_(local, non_blocking=True)  # the padding rows stay unset
    # gloo takes the flat form only (torch 2.13's name for all_gather_into_tensor, same arguments)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, send)
    gathered = gathered.view(WORLD, -1)
    for (dst, _), a, c in zip(pairs, at, rows):
        for r in range(WORLD):
            part = dst[r * c:(r + 1) * c]  # rank r's rows
            part.copy_(gathered[r, a:a + part.numel()].view(part.shape))


def full_state(policy, opt):
    """(model state dict, optimizer state dict) as full CPU tensors on rank 0 (None elsewhere).
    Under --lora-rank the model's is the adapter's parameters alone: the base is never saved."""
    lm = getattr(policy, "lm", policy)
    if not sharded(policy):
        return (adapter_state(lm) if has_adapter(lm) else lm.state_dict()), opt.state_dict()
    from torch.distributed.checkpoint import state_dict as dsd
    opts = dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = adapter_state(lm) if has_adapter(lm) else dsd.get_model_state_dict(lm, options=opts)
    opt_sd = dsd.get_optimizer_state_dict(policy, opt, options=opts)
    return (model_sd, opt_sd) if MASTER else (None, None)


def adapter_state(lm):
    """{name: full CPU tensor} of the parameters that train (on every rank: full_tensor gathers)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for n, p in lm.named_parameters() if p.requires_grad}


def load_optimizer(policy, opt, state):
    if sharded(policy):
        from torch.distributed.checkpoint import state_dict as dsd
        opts = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        dsd.set_optimizer_state_dict(policy, opt, state, options=opts)
    else:
        opt.load_state_dict(state)


def worker_count(cfg):
    """Processes to start here: 0 when already a worker (under torchrun or launched by us)."""
    if "RANK" in os.environ:
        return 0
    gpus, nproc = torch.cuda.device_count() if torch.cuda.is_available() else 0, cfg.get("nproc")
    if nproc and gpus and nproc > gpus:
        raise UserError(f"--nproc {nproc}: this machine has only {gpus} GPUs (one worker per GPU)")
    return nproc or gpus or 1


def _die_with_parent():
    with contextlib.suppress(OSError):  # not Linux: a killed launcher leaves its workers running
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def tail(path, lines=25):
    """The last traceback (or the last `lines` lines) of a log file."""
    with open(path, errors="replace") as f:
        text = f.read().replace("\r", "\n").splitlines()
    start = max((i for i, line in enumerate(text) if line.startswith("Traceback")), default=0)
    return "\n".join([line for line in text[start:] if line.strip()][-lines:])


def worker_env(rank, nproc, port):
    """The environment of worker `rank`: torchrun's variables, and a share of this machine's cores
    (unless OMP_NUM_THREADS is set), since every rank fits the probe on the CPU at the same time."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cpus // nproc)), **os.environ, "RANK": str(rank),
            "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}


def launch(script, argv, nproc):
    """Run `python script *argv` as nproc ranks; the exit code (0, or the failed worker's)."""
    logs, port = tempfile.mkdtemp(prefix="rlcm-workers-"), str(free_port())
    procs, exits, failed, shown, interrupted = [], {}, threading.Event(), [], threading.Event()

    def watch(rank, proc):
        code = proc.wait()
        exits[rank] = (time.monotonic(), code)
        if code not in (0, PREEMPTED):   # a stopped rank's peers are saving: let them finish
            failed.set()

    def forward(signum, frame):   # a scheduler's notice to this process: every worker stops, saved
        for proc, _ in procs:
            proc.send_signal(signum)

    for rank in range(nproc):
        log = open(os.path.join(logs, f"rank{rank}.log"), "w")
        out, err = (None, subprocess.PIPE) if rank == 0 else (log, log)
        proc = subprocess.Popen([sys.executable, script, *argv], env=worker_env(rank, nproc, port),
                                stdout=out, stderr=err, preexec_fn=_die_with_parent)
        procs.append((proc, log))
        threading.Thread(target=watch, args=(rank, proc), daemon=True).start()

    def relay(proc, log):
        # rank 0's stderr goes to the terminal until a worker fails (after Ctrl-C: to its last line)
        for chunk in iter(lambda: os.read(proc.stderr.fileno(), 4096), b""):
            print(chunk.decode(errors="replace"), end="", file=log, flush=True)
            if not failed.is_set() or interrupted.is_set():
                shown.append(chunk.decode(errors="replace"))
                print(shown[-1], end="", file=sys.stderr, flush=True)

    relay_thread = threading.Thread(target=relay, args=procs[0], daemon=True)
    relay_thread.start()
    handlers = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    until = float("inf")   # after Ctrl-C: 30 s for the workers to stop themselves (a second: none)
    while len(exits) < nproc and (interrupted.is_set() or not failed.is_set()) and time.monotonic() < until:
        try:
            time.sleep(0.05)
        except KeyboardInterrupt:   # the workers got it too (one process group): rank 0 says
            until = time.monotonic() + (0 if interrupted.is_set() else 30)   # how to go on
            interrupted.set()
    for proc, _ in procs:   # still running (failed elsewhere, stopped late): SIGTERM, then SIGKILL
        proc.terminate()    # (a no-op once a process has exited)
    deadline = time.monotonic() + 10
    for proc, _ in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    relay_thread.join(5)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    for _, log in procs:
        log.close()
    bad = sorted((t, rank, code) for rank, (t, code) in exits.items() if code not in (0, PREEMPTED))
    if not bad or interrupted.is_set():   # rank 0 has said how the run stands: no logs needed
        shutil.rmtree(logs, ignore_errors=True)
        codes = {code for _, code in exits.values()}
        return 130 if interrupted.is_set() else PREEMPTED if PREEMPTED in codes else 0
    _, rank, code = bad[0]
    text = tail(os.path.join(logs, f"rank{rank}.log"))
    last = text.splitlines()[-1] if text else ""
    prog = os.path.basename(script)   # evaluate.py's user errors read "evaluate.py: error: ..."
    if (code == 2 and last.startswith("error:")) or last.startswith(f"{prog}: error:"):
        if last not in "".join(shown):   # a user error: its one line, unless rank 0's showed it
            print(last, file=sys.stderr)
    else:
        print(f"\nerror: worker {rank} of {nproc} failed (exit code {code}); the other workers "
              f"were stopped. Its last lines (all logs: {logs}):\n{text}", file=sys.stderr)
    return code
