"""The child of harness/sandbox.py: it confines itself, then runs one solution on each test input.

    unshare [--map-user=65534 --map-group=65534 --keep-caps] --mount --net --pid --ipc --uts --fork \\
        --kill-child -- python -I -B -c "$(cat sandbox_child.py)"   # the payload (JSON) on stdin

Before any solution code runs: `expendable`, `confine`, `refuse_syscalls`, `_limit` and `_guard`
(docs/reference.md, "The code sandbox"). Standard library only, for `python -I`."""
import errno
import io
import json
import os
import signal
import struct
import sys
from contextlib import suppress

MEMORY_BYTES = 2 << 30          # address space of one process (RLIMIT_AS)
OPEN_FILES = 32                 # RLIMIT_NOFILE
TASKS = 32                      # processes and threads in its own user namespace (RLIMIT_NPROC)
TMP_BYTES = 64 << 20            # the private /tmp, and the largest file (RLIMIT_FSIZE)
OUTPUT_CHARS = 1 << 24          # longer stdout than this per test counts as wrong
LINE_BYTES = 2 * OUTPUT_CHARS + 4096  # the longest report line; the grader reads no further
UID = 65534                     # the child's user and group id inside its user namespace
PRELUDE = "".join(f"from {m} import *\nimport {m}\n" for m in (
    "string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
    "statistics", "itertools", "functools", "operator", "io", "sys", "json")) + (
    "from builtins import *\nfrom typing import *\nsys.setrecursionlimit(50000)\n")
TOPS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")  # what Python and its libraries need
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 4, 24, 38, 47
KEYCTL = {"x86_64": 250, "i686": 288, "aarch64": 219, "riscv64": 219, "loongarch64": 219,  # keyctl's number
          "ppc64le": 271, "ppc64": 271, "s390x": 280}
KEYCTL_JOIN_SESSION_KEYRING = 1
# System calls no test program needs, refused with EPERM by a seccomp filter: name -> (x86_64, aarch64)
REFUSED = {
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282), "ptrace": (101, 117),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "unshare": (272, 97),
    "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "chroot": (161, 51), "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "swapon": (167, 224), "swapoff": (168, 225),
    "reboot": (169, 142), "acct": (163, 89), "quotactl": (179, 60), "fanotify_init": (300, 262),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "pidfd_getfd": (438, 438), "kcmp": (312, 272)}
ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # machine -> (REFUSED column, AUDIT_ARCH_*)
SOCKET, AF_UNIX = (41, 198), 1  # socket(): a family other than AF_UNIX (vsock: no namespace) gets EPERM
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def expendable():
    """The OOM killer's first choice, and a session keyring of its own in place of the grader's."""
    import ctypes
    # a read-only /proc (some containers): the OOM killer then goes by size alone
    with suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    machine = os.uname().machine
    if machine not in KEYCTL:
        raise OSError(f"sandbox: keyctl's system call number on {machine} is not known to sandbox_child.py, "
                      "so a program would share the grader's session keyring: add it to KEYCTL")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(ctypes.c_long(KEYCTL[machine]), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None) < 0:
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EPERM):  # no keys in the kernel, or keyctl refused (Docker's
            # seccomp profile) to this process and so to the program: no keyring to share
            raise OSError(err, f"sandbox: cannot join a session keyring of its own: {os.strerror(err)}")


def confine(root, hide=()):
    """Make `root` (an empty folder) the child's read-only world, with nothing of `hide` (resolved
    paths) in it, then drop uid and capabilities."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def call(name, *args):
        if getattr(libc, name)(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sandbox: {name}{args[:2]}: {os.strerror(err)}")

    def mount(src, dst, fstype, flags, data=None):
        call("mount", src.encode(), dst.encode(), fstype and fstype.encode(), flags, data and data.encode())

    def bind(src, dst):  # read-only; a remount must keep the flags the source mount already has
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        mount(src, dst, None, MS_BIND)
        keep = os.statvfs(src).f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME
                                         | os.ST_NODIRATIME | os.ST_RELATIME)
        mount("none", dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)

    def inside(path, trees):
        return any((path + "/").startswith(tree + "/") for tree in trees)

    mount("sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.chdir(root)
    # No /proc: its mountinfo would name the host paths bound and hidden here. /tmp first, so that a
    # Python installed under /tmp is bound inside the child's own /tmp.
    os.mkdir("tmp")
    mount("tmp", "tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMP_BYTES},mode=1777")
    bound = []
    for top in TOPS:
        if os.path.islink("/" + top):
            os.symlink(os.readlink("/" + top), top)
        elif os.path.isdir("/" + top):
            bind("/" + top, top)
            bound.append("/" + top)
    needs = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}  # e.g. in /opt
    for need in sorted(needs):
        if not inside(need, bound):
            bind(need, need.lstrip("/"))
            bound.append(need)
    # What the grader hides and lies in a bound tree (a checkout under /usr/local/src): an empty
    # tmpfs over a folder, an empty file over a file; what Python needs from inside one bound again.
    hidden = []
    open("empty", "x").close()
    for path in sorted(hide):  # a folder before what it holds, which its tmpfs then hides
        if path in bound or not inside(path, bound) or not os.path.lexists(path[1:]):
            continue
        if os.path.isdir(path[1:]):
            mount("hidden", path[1:], "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=755")
        else:
            bind("empty", path[1:])
        hidden.append(path)
    os.unlink("empty")
    for need in sorted(needs):
        if inside(need, hidden):
            bind(need, need.lstrip("/"))
    for path in hidden:
        if os.path.isdir(path[1:]):
            mount("none", path[1:], None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("none", ".", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    if os.getuid() == 0:  # a root grader: no user namespace yet; become the real uid 65534
        os.setgroups([])
        os.setresgid(UID, UID, UID)
        os.setresuid(UID, UID, UID)
    call("prctl", PR_SET_DUMPABLE, 1, 0, 0, 0)  # a uid change made /proc/self root's: it must write its maps
    # A user namespace of its own: the process limit counts only the child's tasks, whatever the
    # grader's uid (before chroot: the kernel refuses one in a chroot; maps go via the host /proc).
    call("unshare", CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{UID} {UID} 1"), ("gid_map", f"{UID} {UID} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    os.chroot(".")
    os.chdir("/tmp")
    call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    call("prctl", PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability the kernel knows
    header, caps = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # v3, pid 0: all 0
    call("capset", header, caps)
    call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with unshare (reset by setuid)
    os.setsid()  # a group of its own: kill(0, ...) from the solution reaches nothing outside


def refuse_syscalls(machine=None):
    """A seccomp filter (classic BPF): REFUSED, sockets of a family other than AF_UNIX and calls of
    another ABI (x32, 32-bit) fail with EPERM; one line says so where machine or kernel cannot."""
    import ctypes
    machine = machine or os.uname().machine
    column, arch = ARCHES.get(machine, (None, None))
    why = f"no system call table for {machine} in sandbox_child.REFUSED"
    if column is not None:
        numbers = sorted({row[column] for row in REFUSED.values()})
        n, ld, jeq, jge, ret = len(numbers), 0x20, 0x15, 0x35, 0x06   # BPF_LD|W|ABS, JMP|JEQ/JGE|K, RET
        program = [(ld, 0, 0, 4), (jeq, 0, n + 6, arch), (ld, 0, 0, 0), (jge, n + 4, 0, 0x40000000)]
        program += [(jeq, n - i + 3, 0, number) for i, number in enumerate(numbers)]   # to the last line
        program += [(jeq, 0, 2, SOCKET[column]), (ld, 0, 0, 16), (jeq, 0, 1, AF_UNIX)]  # socket's arg 0
        program += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x50000 | errno.EPERM)]   # allow; errno EPERM
        code = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *line) for line in program))
        fprog = ctypes.create_string_buffer(struct.pack("HP", len(program), ctypes.addressof(code)))
        libc = ctypes.CDLL(None, use_errno=True)
        private = libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
        if private and libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0) == 0:
            return
        why = f"prctl: {os.strerror(ctypes.get_errno())}"
    print(f"sandbox: no seccomp filter ({why}): programs may call io_uring, bpf, ptrace and the like",
          file=sys.stderr)


class _Timeout(BaseException):
    """The per-test alarm: a BaseException, which the solution's `except Exception` lets by."""


def _limit(cpu_s, confined):
    """Resource limits (soft = hard). Unconfined: no file writes, and no process limit (it would
    count the grader's own processes)."""
    import resource
    limits = [("RLIMIT_CPU", cpu_s), ("RLIMIT_AS", MEMORY_BYTES), ("RLIMIT_NOFILE", OPEN_FILES),
              ("RLIMIT_CORE", 0), ("RLIMIT_FSIZE", TMP_BYTES if confined else 0)]
    for name, value in limits + ([("RLIMIT_NPROC", TASKS)] if confined else []):
        resource.setrlimit(getattr(resource, name), (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file write then fails with an error, not a kill
    resource.setrlimit = resource.prlimit = None


def _guard(stdin_text):
    """LiveCodeBench-style: destructive calls, files beyond `open(0)`, sockets refused by name."""
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
        for name in ("kill killpg system popen putenv unsetenv remove removedirs rmdir unlink "
                     "rename renames replace truncate ftruncate open link symlink mkdir makedirs "
                     "chmod fchmod lchmod chown fchown lchown chroot chdir fchdir getcwd setuid "
                     "setgid fork forkpty vfork execv execve execl execle execlp execlpe execvp "
                     "execvpe spawnv spawnve spawnl spawnle spawnlp spawnlpe spawnvp spawnvpe "
                     "posix_spawn posix_spawnp setsid setpgid setpgrp").split():
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


def main():
    """Confine (unless told not to), say "ready", run the solution: one JSON line per test input."""
    import builtins
    payload = json.loads(sys.stdin.buffer.read())
    root, hide = payload.pop("root"), payload.pop("hide")
    out_fd, write, dumps = payload["out_fd"], os.write, json.dumps

    def send(msg):
        data = (dumps(msg, ensure_ascii=False) + "\n").encode(errors="replace")
        if len(data) > LINE_BYTES:
            data = b'{"error": "output too long"}\n'
        while data:
            data = data[write(out_fd, data):]

    def timed(fn):
        """fn() under the per-test alarm: ("ok", value), ("exit", None) on exit, ("error", why)."""
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

    expendable()
    if payload["confined"]:
        confine(root, hide)
    del root, hide  # host paths: nothing the program can reach (gc, frames) holds them
    refuse_syscalls()
    signal.signal(signal.SIGALRM, on_alarm)
    current_input = [""]
    _limit(payload["cpu_s"], payload["confined"])
    _guard(current_input)
    status, compiled = timed(lambda: compile(payload["code"], "<solution>", "exec"))
    send({"ready": True})  # the grader times each reply from here
    if status != "ok":
        return send({"error": f"compile: {compiled}"})

    def module(name):  # a fresh one: LiveCodeBench's prelude, then the solution
        scope = {"__name__": name, "__builtins__": builtins}
        exec(PRELUDE, scope)
        exec(compiled, scope)
        return scope

    if payload["functional"]:
        def load():
            scope, name = module("__solution__"), payload["fn_name"]
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
        status, error = timed(lambda: module("__main__"))
        sys.stdout = real_stdout
        printed = out.buffer.getvalue()
        if status == "error":
            send({"error": error})
        elif len(printed) > OUTPUT_CHARS:
            send({"error": "output too long"})
        else:
            send({"out": printed.decode("utf-8", errors="replace")})


if __name__ == "__main__":
    main()
