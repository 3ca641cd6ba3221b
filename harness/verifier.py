"""The math-verify worker pool behind grade.answers_match: math-verify (sympy) can loop on model
text, so it runs in worker processes (this module run with -m) bounded by their CPU time:
docs/reference.md, "grade.py's time bound"."""
import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # -m runs from the repository
START_TIMEOUT_S = 60     # a new worker not ready by then (importing sympy: unbudgeted): warned
REPLY_S = 0.25           # CPU time past its budget for a worker to stop and answer, or be killed
WALL_S = 30              # no verdict in this wall time (a stopped or starved worker): wrong, warned
TICK_S = 0.05            # how often the parent reads the worker's CPU time while it waits


class _Worker:
    """One math-verify process; requests are JSON lines [pred, gold, seconds], answers "1" / "0"."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.verifier"], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
        self.buf, self.ready = b"", False

    def line(self, until):
        """The worker's next output line, or None by `until` or when it has exited."""
        fd, poll = self.proc.stdout.fileno(), select.poll()  # poll: no limit on fd numbers
        poll.register(fd, select.POLLIN)
        while b"\n" not in self.buf:
            left = until - time.monotonic()
            if left <= 0 or not poll.poll(left * 1000) or not (chunk := os.read(fd, 4096)):
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def cpu_s(self):
        """CPU seconds the worker used (utime + stime, /proc/PID/stat); wall time without /proc."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
            return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
        except OSError:
            return time.monotonic()

    def ask(self, pred, gold, seconds, timer=None):
        """math-verify's verdict within `seconds` of the worker's CPU time, or None; the worker's
        own timer (`timer`: a test's) stops it first, WALL_S last."""
        request = memoryview((json.dumps([pred, gold, timer or seconds]) + "\n").encode())
        limit, backstop = self.cpu_s() + seconds + REPLY_S, time.monotonic() + WALL_S
        try:
            while request:
                request = request[os.write(self.proc.stdin.fileno(), request):]
        except OSError:  # it has exited
            return None
        answer = None
        while answer is None and self.proc.poll() is None and self.cpu_s() < limit:
            if time.monotonic() > backstop:
                print(f"grade: math-verify gave no verdict in {WALL_S} s of wall time (an overloaded or "
                      "stopped process?): graded wrong", file=sys.stderr)
                return None
            answer = self.line(min(time.monotonic() + TICK_S, backstop))
        return None if answer is None else answer == "1"

    def kill(self):
        self.proc.kill()
        self.proc.wait()


_idle, _lock, _unavailable = [], threading.Lock(), []


def _take():
    """A ready worker (an idle one, or a new one started and waited for); None if none can start."""
    with _lock:
        if _unavailable:
            return None
        worker = ([w for w in _idle if w.ready] or _idle or [None])[-1]  # a ready one before one starting
        if worker is not None:
            _idle.remove(worker)
    try:
        worker = worker or _Worker()
        until = time.monotonic() + START_TIMEOUT_S
        reply = "ready" if worker.ready else worker.line(until)
        while reply is None and worker.proc.poll() is None and time.monotonic() >= until:  # late, not failed
            print(f"grade: the math-verify worker is not ready after {START_TIMEOUT_S} s (a loaded or stopped "
                  "host?): waiting for it", file=sys.stderr)
            until = time.monotonic() + START_TIMEOUT_S
            reply = worker.line(until)
    except (OSError, AttributeError) as e:  # cannot start a process; no select.poll (Windows)
        worker, reply = None, f"{type(e).__name__}: {e}"
    if reply == "ready":
        worker.ready = True
        return worker
    if worker is not None:
        worker.kill()
    with _lock:
        if not _unavailable:
            _unavailable.append(reply)
            print(f"grade: the math-verify worker did not start ({reply or 'no reply'}): "
                  "answers are compared by normalised text and numbers only", file=sys.stderr)
    return None


def start():
    """A worker started now, so that its sympy import (seconds) is not in the first grade's time."""
    with _lock:
        _idle.append(_Worker())


def verify(pred, gold, seconds):
    """math-verify's verdict on two answers in `seconds` of a worker's CPU time, else False."""
    worker = _take()
    if worker is None:
        return False
    ok = worker.ask(pred, gold, seconds)
    if ok is None:  # still computing (a C loop the timer cannot stop) or dead: replace it
        worker.kill()
        try:
            worker = _Worker()  # starts now, so that it is ready by the next call
        except OSError:
            return False
    with _lock:
        _idle.append(worker)
    return bool(ok)


@atexit.register
def _stop_workers():
    while _idle:
        _idle.pop().kill()


WARM_UP = ((r"(3, \pi/2)", r"\left( 3, \frac{\pi}{2} \right)"), ("x+1", "1+x"), (r"\frac{1}{2}", "0.5"),
           ("x^2+2x+1", "(x+1)^2"), ("3", r"\log_2 8"))


class _Deadline(BaseException):
    """The worker's timer: a BaseException, which math-verify's `except Exception` lets by."""


def _serve():
    """The worker: answer requests [pred, gold, seconds] from stdin with 1 / 0 until it closes."""
    import functools
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        import logging
        from math_verify import LatexExtractionConfig, parse, verify
        from math_verify import parser as mv_parser
        from sympy.core.cache import clear_cache
        logging.disable(logging.WARNING)  # math-verify warns that its timeout is off: ours is on
    except Exception as e:
        print(f"{type(e).__name__}: {e}".replace("\n", " "), flush=True)
        return

    def stop(signum, frame):
        raise _Deadline

    signal.signal(signal.SIGPROF, stop)
    latex = [LatexExtractionConfig()]
    clears = [f.cache_clear for f in vars(mv_parser).values() if hasattr(f, "cache_clear")] + [clear_cache]

    def parsed(text):
        return parse("\\boxed{" + text + "}", extraction_config=latex, parsing_timeout=None)

    @functools.lru_cache(maxsize=4096)  # a pair is graded K times per prefix: a repeat is free
    def same(pred, gold, seconds):
        for clear in clears:  # empty caches: a grade near the budget never depends on earlier ones
            clear()
        try:
            try:
                signal.setitimer(signal.ITIMER_PROF, seconds)  # CPU time: load does not change it
                g, p = parsed(gold), parsed(pred)
                return bool(g and p and verify(g, p, timeout_seconds=None))
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        except (_Deadline, Exception):  # a timeout or a parser bug on model text: a wrong answer
            return False

    # each kind's first comparison imports parts of sympy: before "ready", off any answer's budget
    for pred, gold in WARM_UP:
        same(pred, gold, START_TIMEOUT_S)
    print("ready", flush=True)
    for request in sys.stdin:
        print(int(same(*json.loads(request))), flush=True)


if __name__ == "__main__":
    _serve()
