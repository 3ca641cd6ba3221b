"""Grade model-written Python by running it against LiveCodeBench-style tests in a throwaway child.

    code = extract_code(response)                      # last fenced block after </think>, or None
    ok = run_tests(code, tests, fn_name=None)          # True when every test passes
    oks = grade_many([{"code": c, "tests": t, "fn_name": f}, ...], workers=2)
    tests = decode_private_tests(row["private_test_cases"])

A test is `{"input": str, "output": str, "testtype": "stdin" | "functional"}`. stdin: the code runs
as a script with the input on stdin; its stdout must equal the output line by line after stripping,
each line exactly or else token by token as `Decimal` (LiveCodeBench's `grade_stdio`). functional:
the code defines LeetCode's `class Solution` (or a plain function) with method `fn_name`; the input
is one JSON argument per line, the return value must equal the JSON output (tuples count as lists).
Both modes first run LiveCodeBench's import prelude, so a solution that uses `heapq` or
`defaultdict` without importing them passes as it does there.

How one solution runs. `python -I` runs this file as a child, started with subprocess, in a new
session (its own process group) with a scrubbed environment and a fresh empty working directory
that is removed afterwards. The child reads the code and the test *inputs* from stdin; the expected
outputs never enter it, so the code cannot read them and print them back. Before the code runs it
sets resource limits (CPU seconds, 2 GiB of address space, no file writes, no new processes or
threads, 32 open files, no core dumps) and a guard in the spirit of LiveCodeBench's
`reliability_guard`: destructive and process-spawning calls (os.system, os.kill, os.fork,
os.remove, subprocess.Popen, shutil.rmtree, ...) become None, `open` reads only the test input
(`open(0)`), and the socket modules refuse to make sockets. Each test has an alarm of `per_test_s`;
the child streams one JSON line per test back over a pipe (never pickle), and the parent compares,
stops at the first failure, and kills the whole process group at the end or after the global
timeout `(per_test_s + 1) * n_tests + 5` s.

What this is not: a security boundary against code written to escape it. The guard is Python-level
patching; code that re-imports a module, uses `_io.FileIO`, or reaches libc through ctypes gets
past it (to files, the network, other processes). What holds regardless is the timeouts, the
process-group kill, the throwaway directory, the scrubbed environment and the resource limits, the
limits only as far as the kernel enforces them: it exempts root from the process limit and lets
root raise limits again. Run the evaluation as an ordinary user (or in a container) when grading
code from models you do not trust.
"""
import base64
import binascii
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
from decimal import Decimal

MEMORY_BYTES = 2 << 30          # address space of one child (RLIMIT_AS)
OPEN_FILES = 32                 # RLIMIT_NOFILE
OUTPUT_CHARS = 1 << 24          # longer stdout than this per test counts as wrong (protects the parent)
PRELUDE = "".join(f"from {m} import *\nimport {m}\n" for m in (
    "string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
    "statistics", "itertools", "functools", "operator", "io", "sys", "json")) + (
    "from builtins import *\nfrom typing import *\nsys.setrecursionlimit(50000)\n")
_FENCE = re.compile(r"^[ \t]*```[^\n`]*\n(.*?)^[ \t]*```", re.M | re.S)


def extract_code(response):
    """The code of the last complete fenced block after the thinking (up to the last `</think>`)."""
    blocks = _FENCE.findall(response.rpartition("</think>")[2])
    return blocks[-1] if blocks else None


def run_tests(code, tests, fn_name=None, per_test_s=6.0):
    """True when the code passes every test; no code (None) fails. One child process per call."""
    if not tests:
        raise ValueError("run_tests: no tests given; a problem needs at least one test")
    kinds = {t["testtype"] for t in tests}
    if len(kinds) != 1 or not kinds <= {"stdin", "functional"}:
        raise ValueError(f"run_tests: testtype must be all 'stdin' or all 'functional', got {sorted(kinds)}")
    functional = kinds == {"functional"}
    if not per_test_s > 0:
        raise ValueError(f"run_tests: per_test_s must be positive, got {per_test_s}")
    if functional and not fn_name:
        raise ValueError("run_tests: functional tests need fn_name (the method of class Solution)")
    if code is None:
        return False
    total_s = (per_test_s + 1) * len(tests) + 5
    deadline = time.monotonic() + total_s
    workdir = tempfile.mkdtemp(prefix="sandbox-")
    read_fd, write_fd = os.pipe()
    payload = {"code": code, "inputs": [t["input"] for t in tests], "functional": functional,
               "fn_name": fn_name, "per_test_s": per_test_s, "cpu_s": int(total_s) + 1,
               "out_fd": write_fd}
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        child = subprocess.Popen([sys.executable, "-I", "-B", os.path.abspath(__file__)], cwd=workdir,
                                 env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, pass_fds=(write_fd,), start_new_session=True)
    except BaseException:
        os.close(read_fd)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        os.close(write_fd)  # the child holds its own copy; EOF on read_fd then means it is gone
    try:
        try:
            child.stdin.write(json.dumps(payload).encode())
            child.stdin.close()
        except BrokenPipeError:
            return False
        lines = _lines_until(read_fd, deadline)
        for test in tests:
            msg = next(lines, None)
            if not isinstance(msg, dict) or not _passes(msg, test, functional):
                return False
        return True
    finally:
        # The group first, while the unreaped child still holds its id, then the child itself in
        # case it left the group.
        for kill in (lambda: os.killpg(child.pid, signal.SIGKILL), child.kill):
            try:
                kill()
            except (ProcessLookupError, PermissionError):
                pass
        child.wait()
        os.close(read_fd)
        shutil.rmtree(workdir, ignore_errors=True)


def grade_many(jobs, workers=2):
    """run_tests(**job) for each job (dicts with code, tests, fn_name[, per_test_s]), `workers` at a time."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: run_tests(**job), jobs))


def _lines_until(fd, deadline):
    """Yield the child's JSON lines (None for one that does not parse) until EOF or the deadline."""
    buf, start = bytearray(), 0
    while True:
        end = buf.find(b"\n", start)
        if end >= 0:
            try:
                yield json.loads(bytes(buf[:end]))
            except ValueError:
                yield None
            del buf[:end + 1]
            start = 0
            continue
        start = len(buf)
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return
        buf.extend(chunk)


def _passes(msg, test, functional):
    """Whether one child report matches the test's expected output (LiveCodeBench's rules)."""
    if functional:
        return "ret" in msg and msg["ret"] == json.loads(test["output"])
    return isinstance(msg.get("out"), str) and same_output(msg["out"], test["output"])


def same_output(got, want):
    """stdout comparison: the same number of stripped lines, each equal or equal as Decimal tokens."""
    got_lines = [line.strip() for line in got.strip().split("\n")]
    want_lines = [line.strip() for line in want.strip().split("\n")]
    if len(got_lines) != len(want_lines):
        return False
    for g, w in zip(got_lines, want_lines):
        if g == w:
            continue
        try:
            if [Decimal(x) for x in g.split()] != [Decimal(x) for x in w.split()]:
                return False
        except ArithmeticError:  # a token that is not a number (decimal.InvalidOperation)
            return False
    return True


class _RefuseClasses(pickle.Unpickler):
    """An unpickler that builds only plain values: any class or function the pickle names is refused."""

    def find_class(self, module, name):
        raise ValueError(f"private tests: the pickle asks for {module}.{name}; refused, since a test "
                         "blob holds only a JSON string and loading it must run no code")


def decode_private_tests(blob):
    """LiveCodeBench's private tests: JSON, or base64(zlib(pickle(json string))) read without running code."""
    try:
        return json.loads(blob)
    except ValueError:
        pass
    try:
        raw = zlib.decompress(base64.b64decode(blob))
    except (binascii.Error, zlib.error):
        raise ValueError("private tests: neither JSON nor base64(zlib(pickle(json)))") from None
    try:
        text = _RefuseClasses(io.BytesIO(raw)).load()
    except ValueError:
        raise
    except Exception as e:  # a malformed pickle fails in many ways; say so in one line
        raise ValueError(f"private tests: not a readable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(text, str):
        raise ValueError(f"private tests: the pickle holds a {type(text).__name__}, not a JSON string")
    return json.loads(text)


# The child: everything below runs in the `python -I` process, never in the evaluation.

class _Timeout(BaseException):
    """The per-test alarm; a BaseException so that `except Exception` in the solution does not eat it."""


def _limit(cpu_s):
    """Resource limits of the child, set before any solution code runs (soft = hard)."""
    import resource
    for name, value in (("RLIMIT_CPU", cpu_s), ("RLIMIT_AS", MEMORY_BYTES), ("RLIMIT_FSIZE", 0),
                        ("RLIMIT_NPROC", 0), ("RLIMIT_NOFILE", OPEN_FILES), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file write then fails with an error, not a kill
    resource.setrlimit = resource.prlimit = None


def _guard(stdin_text):
    """Disable destructive calls, file access beyond `open(0)`, and sockets (see the module docstring)."""
    import builtins
    import posix
    import shutil as shutil_
    import socket
    import _posixsubprocess
    import _socket
    import subprocess as subprocess_

    def guarded_open(file, mode="r", *args, **kwargs):
        if file == 0:  # `open(0).read()` reads the test's stdin
            return io.BytesIO(stdin_text[0].encode()) if "b" in mode else io.StringIO(stdin_text[0])
        raise PermissionError(f"sandbox: no file access ({file!r})")

    def refused(*args, **kwargs):
        raise PermissionError("sandbox: no network")

    builtins.open = io.open = guarded_open
    for module in (os, posix):
        for name in ("kill", "killpg", "system", "popen", "putenv", "unsetenv", "remove", "removedirs",
                     "rmdir", "unlink", "rename", "renames", "replace", "truncate", "ftruncate", "open",
                     "link", "symlink", "mkdir", "makedirs", "chmod", "fchmod", "lchmod", "chown",
                     "fchown", "lchown", "chroot", "chdir", "fchdir", "getcwd", "setuid", "setgid",
                     "fork", "forkpty", "vfork", "execv", "execve", "execl", "execle", "execlp",
                     "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp",
                     "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "setsid",
                     "setpgid", "setpgrp"):
            if hasattr(module, name):
                setattr(module, name, None)
    shutil_.rmtree = shutil_.move = shutil_.chown = None
    subprocess_.Popen = None
    _posixsubprocess.fork_exec = None
    for module in (socket, _socket):
        for name in ("socket", "socketpair", "fromfd", "create_connection", "create_server"):
            if hasattr(module, name):
                setattr(module, name, refused)
    for name in ("ctypes", "_ctypes", "resource", "psutil", "multiprocessing", "pty", "tkinter"):
        sys.modules[name] = None
    builtins.help = None


def _child():
    """Run the solution on each input and write one JSON line per test to the result pipe."""
    import builtins
    payload = json.loads(sys.stdin.buffer.read())
    out_fd, write, dumps = payload["out_fd"], os.write, json.dumps

    def send(msg):
        data = (dumps(msg) + "\n").encode()
        while data:
            data = data[write(out_fd, data):]

    def timed(fn):
        """fn() under the per-test alarm: ("ok", value), ("exit", None) on sys.exit, or ("error", why)."""
        signal.setitimer(signal.ITIMER_REAL, payload["per_test_s"])
        try:
            return "ok", fn()
        except _Timeout:
            return "error", "timeout"
        except SystemExit:
            return "exit", None
        except BaseException as e:  # the solution's own failure, reported, never raised
            return "error", type(e).__name__
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def on_alarm(signum, frame):
        raise _Timeout

    signal.signal(signal.SIGALRM, on_alarm)
    current_input = [""]
    _limit(payload["cpu_s"])
    _guard(current_input)
    status, compiled = timed(lambda: compile(payload["code"], "<solution>", "exec"))
    if status != "ok":
        return send({"error": f"compile: {compiled}"})
    if payload["functional"]:
        scope = {"__name__": "__solution__", "__builtins__": builtins}

        def load():
            exec(PRELUDE, scope)
            exec(compiled, scope)
            name = payload["fn_name"]
            return getattr(scope["Solution"](), name) if "Solution" in scope else scope[name]

        status, target = timed(load)
        if status != "ok":
            return send({"error": f"load: {target}"})
        for text in payload["inputs"]:
            status, value = timed(lambda: target(*[json.loads(line) for line in text.split("\n")]))
            try:
                send({"ret": value} if status == "ok" else {"error": value or status})
            except (TypeError, ValueError):
                send({"error": f"return value of type {type(value).__name__} is not JSON"})
        return
    real_stdout = sys.stdout
    for text in payload["inputs"]:
        # A fresh module per test, stdin and stdout as real text streams (with .buffer) over bytes.
        current_input[0] = text
        sys.stdin = io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8")
        sys.stdout = out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
        scope = {"__name__": "__main__", "__builtins__": builtins}

        def script():
            exec(PRELUDE, scope)
            exec(compiled, scope)

        status, error = timed(script)
        sys.stdout = real_stdout
        printed = out.buffer.getvalue()
        if status == "error":
            send({"error": error})
        elif len(printed) > OUTPUT_CHARS:
            send({"error": "output too long"})
        else:
            send({"out": printed.decode("utf-8", errors="replace")})


if __name__ == "__main__":
    _child()
