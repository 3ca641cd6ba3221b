"""One worker per GPU (or `--nproc N` on CPU) from a plain `python train.py` or `python evaluate.py`.

Each worker is a fresh `python train.py ARGS` with torchrun's variables set; under torchrun nothing
is launched. How workers log, fail and stop: docs/reference.md, "The launcher".
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time


def worker_count(cfg):
    """Processes to start here: 0 when already a worker (under torchrun or launched by us)."""
    if "RANK" in os.environ:
        return 0
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.get("nproc") and gpus and cfg["nproc"] > gpus:
        from harness.files import UserError
        raise UserError(f"--nproc {cfg['nproc']}: this machine shows only {gpus} GPUs (one worker per GPU)")
    return cfg.get("nproc") or gpus or 1


def _die_with_parent():
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: a killed launcher leaves its workers running
        pass


def tail(path, lines=25):
    """The last traceback (or the last `lines` lines) of a log file."""
    with open(path, errors="replace") as f:
        text = f.read().replace("\r", "\n").splitlines()
    starts = [i for i, line in enumerate(text) if line.startswith("Traceback")]
    text = text[starts[-1]:] if starts else text
    return "\n".join([line for line in text if line.strip()][-lines:])


def worker_env(rank, nproc, port):
    """The environment of worker `rank`: torchrun's variables, and a share of this machine's cores
    (unless OMP_NUM_THREADS is set), since every rank fits the probe on the CPU at the same time."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = {"OMP_NUM_THREADS": str(max(1, cores // nproc)), **os.environ}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    return env


def launch(script, argv, nproc):
    """Run `python script *argv` as nproc ranks; return the exit code (0, or the failed worker's)."""
    from harness.parallel import free_port
    logs = tempfile.mkdtemp(prefix="rlcm-workers-")
    port = str(free_port())
    procs, exits, failed, shown = [], {}, threading.Event(), []

    def watch(rank, proc):
        code = proc.wait()
        exits[rank] = (time.monotonic(), code)
        if code != 0:
            failed.set()

    for rank in range(nproc):
        log = open(os.path.join(logs, f"rank{rank}.log"), "w")
        err = subprocess.PIPE if rank == 0 else log
        proc = subprocess.Popen([sys.executable, script, *argv], env=worker_env(rank, nproc, port),
                                stdout=None if rank == 0 else log,
                                stderr=err, preexec_fn=_die_with_parent)
        procs.append((proc, log))
        threading.Thread(target=watch, args=(rank, proc), daemon=True).start()

    def relay(proc, log):
        # rank 0's stderr goes to the terminal until some worker fails
        for chunk in iter(lambda: os.read(proc.stderr.fileno(), 4096), b""):
            log.write(chunk.decode(errors="replace"))
            log.flush()
            if not failed.is_set():
                shown.append(chunk.decode(errors="replace"))
                sys.stderr.write(shown[-1])
                sys.stderr.flush()

    relay_thread = threading.Thread(target=relay, args=procs[0], daemon=True)
    relay_thread.start()
    interrupted = False
    try:
        while len(exits) < nproc and not failed.is_set():
            time.sleep(0.05)
    except KeyboardInterrupt:  # the workers got the same Ctrl-C (one process group)
        interrupted = True
        failed.set()
    if failed.is_set():
        for proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc, _ in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    relay_thread.join(5)
    for _, log in procs:
        log.close()
    if interrupted:
        print(f"interrupted; all workers stopped (logs: {logs})", file=sys.stderr)
        return 130
    bad = sorted((t, rank, code) for rank, (t, code) in exits.items() if code != 0)
    if not bad:
        shutil.rmtree(logs, ignore_errors=True)
        return 0 if len(exits) == nproc else 130
    _, rank, code = bad[0]
    text = tail(os.path.join(logs, f"rank{rank}.log"))
    last = text.splitlines()[-1] if text else ""
    # a user error: its one line (rank 0's is already shown); evaluate.py's reads "evaluate.py: error: ..."
    if (code == 2 and last.startswith("error:")) or last.startswith(f"{os.path.basename(script)}: error:"):
        if last not in "".join(shown):
            print(last, file=sys.stderr)
    else:
        print(f"\nerror: worker {rank} of {nproc} failed (exit code {code}); the other workers were "
              f"stopped. Its last lines (all logs: {logs}):\n{text}", file=sys.stderr)
    return code
