"""Grade model-written Python by running it against LiveCodeBench-style tests in a confined child.

    ok = run_tests(extract_code(response), tests, fn_name=None)   # True when every test passes

A test is `{"input": str, "output": str, "testtype": "stdin" | "functional"}` (data.lcb_tests).
The child, what it isolates and --unconfined-code: docs/reference.md, "The code sandbox"."""
import base64
import binascii
import functools
import io
import json
import os
import pickle
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from decimal import Decimal

from harness.sandbox_child import LINE_BYTES

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
PROJECT = os.path.dirname(os.path.dirname(CHILD))
with open(CHILD) as _f:
    CHILD_SOURCE = _f.read()    # run as `python -c`: the child's code names no host path
HF_CACHES = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")
UNSHARE = "unshare"             # util-linux
START_S = 60                    # a child has this long to confine itself and say "ready"
LATE_S = 1                      # a reply may come this long after the child's own alarm would fire
NAMESPACES = ("--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TESTS_BYTES = 1 << 30           # what private tests may inflate to: real ones are tens of MB
allow_unconfined = False        # evaluate.py --unconfined-code: unconfined where namespaces fail
hide = []                       # what else programs must not see (evaluate.py: models, data, --out)
_warned = []                    # the reason, once the unconfined warning is printed
_FENCE = re.compile(r"^[ \t]*```[^\n`]*\n(.*?)^[ \t]*```", re.M | re.S)


class SandboxUnavailable(OSError):
    """The child cannot be confined here; the message is one line that says what to do."""


def extract_code(response):
    """The code of the last complete fenced block after the thinking (up to the last `</think>`)."""
    blocks = _FENCE.findall(response.rpartition("</think>")[2])
    return blocks[-1] if blocks else None


def run_tests(code, tests, fn_name=None, per_test_s=6.0):
    """True when the code passes every test; no code (None) fails. One child process per call."""
    functional = tests[0]["testtype"] == "functional"
    if code is None:
        return False
    confined = check()
    total_s = (per_test_s + 1) * len(tests) + 5
    deadline = [time.monotonic() + max(START_S, total_s)]   # until "ready": not a wrong answer
    workdir = tempfile.mkdtemp(prefix="sandbox-")   # confined: the mount point of the child's root
    read_fd, write_fd = os.pipe()
    payload = {"code": code, "inputs": [t["input"] for t in tests], "functional": functional,
               "fn_name": fn_name, "per_test_s": per_test_s, "cpu_s": int(total_s) + 1,
               "out_fd": write_fd, "confined": confined, "root": workdir, "hide": _hidden()}
    try:
        child = subprocess.Popen(_command(workdir, confined), cwd=workdir, env=ENV, stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write_fd,),
                                 start_new_session=True)
    finally:
        os.close(write_fd)  # the child holds its own copy; EOF on read_fd then means it is gone
    try:
        with suppress(BrokenPipeError):
            child.stdin.write(json.dumps(payload).encode())
            child.stdin.close()
        lines = _lines_until(read_fd, deadline)
        if next(lines, None) != {"ready": True}:   # sent before any solution code runs
            raise SandboxUnavailable(f"sandbox: a child stopped before running the program "
                                     f"({_why_not.__wrapped__() or 'run it again'})")
        for i, test in enumerate(tests):
            # each reply is due per_test_s after the one before, by this clock, whatever the program
            # did to its alarm; the first functional one also waits for the code to load (its alarm)
            deadline[0] = time.monotonic() + per_test_s * (2 if functional and not i else 1) + LATE_S
            if not isinstance(msg := next(lines, None), dict) or not _passes(msg, test, functional):
                return False
        # LiveCodeBench's guard: the solution (its namespace's PID 1) must leave no process
        return not (confined and any(_children(inner) for inner in _children(child.pid)))
    finally:
        _stop(child, confined)
        os.close(read_fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _hidden():
    """What the child must not see: the grader's folder, this project, the HF cache, `hide`."""
    paths = []
    with suppress(OSError):  # a folder since removed holds nothing
        paths.append(os.getcwd())
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    paths += [PROJECT, os.path.join(cache, "huggingface"), *map(os.environ.get, HF_CACHES), *hide]
    return sorted({os.path.realpath(p) for p in paths if p})


def _command(root, confined):
    """The child's command line: under `unshare` (a grader not root first maps itself to 65534)."""
    child = [sys.executable, "-I", "-B", "-c", CHILD_SOURCE]
    if not confined:
        return child
    user = () if os.geteuid() == 0 else ("--map-user=65534", "--map-group=65534", "--keep-caps")
    return [UNSHARE, *user, *NAMESPACES, "--", *child]


def _children(pid):
    """The processes that `pid` (any of its threads) started, still there, zombies included."""
    found = []
    with suppress(OSError):  # gone, or a kernel without /proc/PID/task/TID/children
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(p) for p in f.read().split()]
    return found


def _stop(child, confined):
    """Kill the child and everything it started: confined, the namespace's PID 1 (the namespace goes
    with it); then the group and `unshare` itself."""
    for pid in _children(child.pid) if confined else ():
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:  # still unshare's child once the pidfd is open: the pid was not reused (fd is it)
            if pid in _children(child.pid):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                with suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=5)
                    return
        finally:
            os.close(fd)
    for kill in (lambda: os.killpg(child.pid, signal.SIGKILL), child.kill):
        with suppress(ProcessLookupError, PermissionError):
            kill()
    child.wait()


@functools.cache
def _why_not():
    """None when a child can confine itself here, else why not (one line)."""
    root = tempfile.mkdtemp(prefix="sandbox-")
    payload = {"code": "", "inputs": [], "functional": False, "fn_name": None, "per_test_s": 1,
               "cpu_s": 5, "out_fd": 1, "confined": True, "root": root, "hide": _hidden()}
    try:
        done = subprocess.run(_command(root, True), input=json.dumps(payload).encode(), env=ENV, cwd=root,
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if done.stdout.startswith(b'{"ready": true}'):
        sys.stderr.write(done.stderr.decode(errors="replace"))  # once: "sandbox: no seccomp filter"
        return None
    said = done.stderr.decode(errors="replace").strip().splitlines()
    return said[-1][:300] if said else f"exit status {done.returncode}"


def check():
    """True: run confined. False: run unconfined, as allowed. Else SandboxUnavailable: none runs."""
    if (why := _why_not()) is None:
        return True
    if not allow_unconfined:
        fix = ("Install util-linux's unshare" if UNSHARE in why and "No such file" in why else
               "Allow unprivileged user namespaces" if "unshare" in why else "Fix that")
        raise SandboxUnavailable(f"sandbox: cannot confine programs in namespaces here ({why}); no code was run. "
                                 f"{fix}, or accept running model-written code unconfined with evaluate.py "
                                 "--unconfined-code")
    if not _warned:
        _warned.append(why)
        print(f"sandbox: running model-written code UNCONFINED (--unconfined-code; {why})", file=sys.stderr)
    return False


def grade_many(jobs, workers=2):
    """run_tests(**job) per job (code, tests, fn_name[, per_test_s]), `workers` at a time."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_tests(**job), jobs))


def _lines_until(fd, deadline):
    """Yield the child's JSON lines (None for one that does not parse) until EOF or deadline[0]
    (the caller may move it); a line longer than LINE_BYTES ends it (None): a flood costs that."""
    buf, start = bytearray(), 0
    while True:
        while (end := buf.find(b"\n", start)) >= 0:
            try:
                yield json.loads(bytes(buf[:end]))
            except Exception:  # not JSON, or nested past the recursion limit ("[" * 100000): a fail
                yield None
            del buf[:end + 1]
            start = 0
        if len(buf) > LINE_BYTES:
            yield None
            return
        start = len(buf)
        left = max(deadline[0] - time.monotonic(), 0)  # past it, a line already sent still counts
        if not select.select([fd], [], [], left)[0] or not (chunk := os.read(fd, 1 << 20)):
            return
        buf.extend(chunk)


def _passes(msg, test, functional):
    """Whether one child report matches the test's expected output."""
    if functional:
        return "ret" in msg and msg["ret"] == json.loads(test["output"])
    return isinstance(msg.get("out"), str) and same_output(msg["out"], test["output"])


def same_output(got, want):
    """stdout comparison: as many stripped lines, each equal or equal as Decimal tokens."""
    got, want = got.strip(), want.strip()
    if got.count("\n") != want.count("\n"):  # before anything is built: a cost the gold's bounds
        return False
    for g, w in zip(got.split("\n"), want.split("\n")):
        g, w = g.strip(), w.strip()
        if g == w:
            continue
        want_tokens = w.split()
        got_tokens = g.split(None, len(want_tokens))  # one more than the gold's at most
        try:
            if len(got_tokens) != len(want_tokens) or any(
                    Decimal(a) != Decimal(b) for a, b in zip(got_tokens, want_tokens)):
                return False
        except ArithmeticError:  # a token that is not a number (decimal.InvalidOperation)
            return False
    return True


class _RefuseClasses(pickle.Unpickler):
    """An unpickler that builds only plain values: it refuses any class or function named."""

    def find_class(self, module, name):
        raise ValueError(f"it asks for {module}.{name}, refused: a test blob holds only JSON text")


def decode_private_tests(blob):
    """LiveCodeBench's private tests: JSON, or base64(zlib(pickle(json string))) read without
    running code, refused when it inflates past TESTS_BYTES (counted in 16 MB chunks, not kept)."""
    with suppress(ValueError):
        return json.loads(blob)
    try:
        packed = rest = base64.b64decode(blob)
        inflate, size = zlib.decompressobj(), 0
        while rest and size <= TESTS_BYTES:
            size += len(inflate.decompress(rest, 1 << 24))
            rest = inflate.unconsumed_tail
        raw = zlib.decompress(packed) if size <= TESTS_BYTES else None
    except (binascii.Error, zlib.error):
        raise ValueError("private tests: neither JSON nor base64(zlib(pickle(json)))") from None
    if raw is None:
        raise ValueError(f"private tests inflate to over {TESTS_BYTES >> 20} MB (a zlib bomb?)")
    try:
        text = _RefuseClasses(io.BytesIO(raw)).load()
    except Exception as e:  # a malformed pickle fails in many ways, a refused class in ours
        raise ValueError(f"private tests: not a readable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(text, str):
        raise ValueError(f"private tests: the pickle holds a {type(text).__name__}, not a JSON string")
    return json.loads(text)
