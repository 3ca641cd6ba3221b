"""The red team's sandbox escapes (../shared/reviews/red-team-3.md, C1-C16, M5, M9), run through the
code grader as root and as an ordinary user (uid 65534): no connection, no file outside changed, the
grader alive, no process left, the gold not printed; a correct threaded solution passes.

A driver process plays the grader (as evaluate.py does: the benchmark file on its command line, the
gold in its memory, a secret in its environment) and grades every program with run_tests; this test
checks what the programs could have harmed. Programs that cheat print what they found and pass only
if they found the gold; programs that harm attack and then print the right answer.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARM = {  # attack, then print 1 (the right answer)
    "C1 _socket.SocketType": "import _socket\n_socket.SocketType().connect(('127.0.0.1', {port}))",
    "C2 socket.SocketType": "import socket\nsocket.SocketType().connect(('127.0.0.1', {port}))",
    "C3 re-imported _socket": "import sys\ndel sys.modules['socket'], sys.modules['_socket']\nimport socket\n"
                              "socket.create_connection(('127.0.0.1', {port}), timeout=2)",
    "C4 FileIO truncates": "import io\nio.FileIO({a!r}, 'w').close()",
    "C5 mmap writes": "import io, mmap\nf = io.FileIO({b!r}, 'r+')\nm = mmap.mmap(f.fileno(), 0)\n"
                      "m[:6] = b'HACKED'\nm.flush()",
    "C6 posix.unlink": "import sys\ndel sys.modules['posix']\nimport posix\nposix.unlink({c!r})",
    "C6 posix.rename": "import sys\ndel sys.modules['posix']\nimport posix\nposix.rename({d!r}, {d!r} + '.moved')",
    "C7 FileIO creates": "import io\nio.FileIO({x!r}, 'x').close()",
    "C8 raise RLIMIT_FSIZE": "import sys\ndel sys.modules['resource']\nimport resource\n"
                             "resource.setrlimit(resource.RLIMIT_FSIZE, (-1, -1))",
    "C13 pidfd_send_signal": "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)",
    "C14 posix.kill": "import os, sys\ndel sys.modules['posix']\nimport posix\nposix.kill(os.getppid(), 9)\n"
                      "posix.kill(os.getppid(), 15)",
    "C15 fork, setsid, sleep": "import sys, time\ndel sys.modules['posix']\nimport posix\nif posix.fork() == 0:\n"
                               "    posix.setsid()\n    posix.execv('/bin/sleep', ['sleep', '31.337'])\ntime.sleep(0.5)",
    "C16 fork, setsid, shell": "import sys, time\ndel sys.modules['posix']\nimport posix\nif posix.fork() == 0:\n"
                               "    posix.setsid()\n    posix.execv('/bin/sh', ['sh', '-c', 'echo x > {e}; sleep 31.338'])\n"
                               "time.sleep(0.5)",
    "M9 more threads than the task limit": "import threading, time\nts = [threading.Thread(target=time.sleep, "
                                           "args=(1,)) for _ in range(40)]\nfor t in ts:\n    t.start()",
}
CHEAT = {  # print what they found: right only if they found the gold
    "C9 reads the benchmark file": "import io, json\nprint(json.loads(io.FileIO({bench!r}).read())[0]['output'])",
    "C10 /proc/ppid/environ": "import io, os\nprint([e for e in io.FileIO('/proc/%d/environ' % os.getppid()).read()"
                              ".split(b'\\0') if e.startswith(b'RLCM_SECRET=')][0][12:].decode())",
    "C11 /proc/ppid/cmdline and cwd": (
        "import io, os, json, sys\np, given = os.getppid(), sys.stdin.read().strip()\n"
        "for arg in io.FileIO('/proc/%d/cmdline' % p).read().decode().split('\\0'):\n"
        "    if arg.endswith('.json'):\n"
        "        path = arg if arg.startswith('/') else '/proc/%d/cwd/%s' % (p, arg)\n"
        "        for t in json.loads(io.FileIO(path).read()):\n"
        "            if t['input'].strip() == given:\n                print(t['output'])\n"),
    "C12 /proc/ppid/mem": (
        "import io, os, sys, json\np = os.getppid()\n"
        "needle = json.dumps(sys.stdin.read())[:-1].encode() + b'\", \"output\": \"'\nout = 'none'\n"
        "for line in io.FileIO('/proc/%d/maps' % p).read().decode().splitlines():\n"
        "    a, b = [int(x, 16) for x in line.split()[0].split('-')]\n"
        "    if 'rw' not in line.split()[1] or b - a > (256 << 20): continue\n"
        "    try:\n        m = io.FileIO('/proc/%d/mem' % p); m.seek(a); chunk = m.read(b - a)\n"
        "    except OSError: continue\n    i = chunk.find(needle)\n"
        "    if i >= 0:\n        j = i + len(needle); out = chunk[j:chunk.index(b'\"', j)].decode(); break\n"
        "print(out)\n"),
}
THREADED = ("import threading\ndef main():\n    a, b = map(int, input().split())\n    print(a + b)\n"
            "threading.stack_size(1 << 26)\nt = threading.Thread(target=main)\nt.start()\nt.join()\n")
FLOOD = ("import sys, os\nf = sys._getframe()\nwhile 'out_fd' not in f.f_locals:\n    f = f.f_back\n"
         "for _ in range(384):\n    os.write(f.f_locals['out_fd'], b'x' * (1 << 20))\n")
DRIVER = """
import json, os, random, resource, socket, sys
from harness.sandbox import run_tests
bench, folder = sys.argv[1], sys.argv[2]
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
listener.setblocking(False)
names = {n: os.path.join(folder, n) for n in "abcdex"}
tests = json.load(open(bench))
gold = json.dumps({"tests": tests, "fn_name": None})   # held as data.py holds it
one = [{"input": "", "output": "1", "testtype": "stdin"}]
results = {}
for name, code in json.loads(sys.stdin.read()).items():
    code = code.format(port=listener.getsockname()[1], bench=bench, **names)
    if name.startswith("C10"):
        results[name] = run_tests(code, [{"input": "", "output": os.environ["RLCM_SECRET"], "testtype": "stdin"}],
                                  per_test_s=3)
    else:
        results[name] = run_tests(code + "\\nprint(1)\\n" if "print(" not in code else code,
                                  one if "print(" not in code else tests, per_test_s=3)
try:
    listener.accept()
    results["a connection"] = True
except BlockingIOError:
    pass
if sys.argv[3]:
    results["threaded"] = run_tests(sys.argv[3], [{"input": "20 22", "output": "42", "testtype": "stdin"}])
if sys.argv[4]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    results["flood"] = run_tests(sys.argv[4], one)
    results["flood MB kept"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
results["next sample"] = run_tests("print(1)", one)
print(json.dumps(results))
"""


def _python_for(user):
    """An interpreter with which `user` (setpriv arguments, or none) can grade a program here."""
    check = "from harness.sandbox import run_tests\nassert run_tests('print(1)', [{'input': '', 'output': '1', " \
            "'testtype': 'stdin'}])\n"
    for python in (sys.executable, shutil.which("python3", path=os.defpath)):
        if python and subprocess.run([*user, python, "-c", check], cwd=ROOT, env={"PYTHONPATH": ROOT},
                                     capture_output=True).returncode == 0:
            return python
    return None


def _alive(marker):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _grade_as(as_user, programs=(), threaded="", flood=""):
    """Run DRIVER as `as_user` ("root" or "ordinary": uid 65534) in a fresh folder of victims; returns
    (results, the victims' folder, survivors): the caller checks and removes the folder."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root, and setpriv to become uid 65534")
    user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_user == "ordinary" else []
    python = _python_for(user)
    if python is None:
        pytest.skip(f"no Python that {as_user} can run with this checkout ({ROOT})")
    folder = tempfile.mkdtemp(prefix="escapes-")  # writable by the grader's user, whoever it is
    os.chmod(folder, 0o777)
    for name in "abcd":
        with open(os.path.join(folder, name), "w") as f:
            f.write("precious data\n")
        os.chmod(os.path.join(folder, name), 0o666)
    answer = str(random.randrange(10 ** 11, 10 ** 12))
    bench = os.path.join(folder, "bench.json")
    with open(bench, "w") as f:
        json.dump([{"input": "count the widgets 4242\n", "output": answer, "testtype": "stdin"}], f)
    os.chmod(bench, 0o644)
    done = subprocess.run([*user, python, "-c", DRIVER, bench, folder, threaded, flood], cwd=ROOT,
                          input=json.dumps(dict(programs)), capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": ROOT, "PATH": os.environ["PATH"], "RLCM_SECRET": answer})
    survivors = _alive(b"31.33")
    for pid in survivors:
        os.kill(pid, 9)
    if done.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
    assert done.returncode == 0, f"the grader died ({done.returncode}): {done.stderr[-2000:]}"
    results = json.loads(done.stdout.splitlines()[-1])
    assert results["next sample"]
    return results, folder, survivors


@pytest.mark.slow
@pytest.mark.parametrize("as_user", ["root", "ordinary"])
def test_red_team_escapes_fail_and_harm_nothing(as_user):
    results, folder, survivors = _grade_as(as_user, {**HARM, **CHEAT})
    try:
        passed = sorted(name for name in {**HARM, **CHEAT} if results[name])
        # C14: kill(getppid() == 0, ...) signals the solution's own group; as PID 1 of its namespace it
        # ignores that, so the program goes on and prints the right answer, having harmed nothing
        assert passed == ["C14 posix.kill"], passed                 # no other escape worked, no gold printed
        assert "a connection" not in results
        assert not survivors, "a process the solution started outlived the grade"
        for name in "abcd":
            with open(os.path.join(folder, name)) as f:
                assert f.read() == "precious data\n", name
        assert sorted(os.listdir(folder)) == ["a", "b", "bench.json", "c", "d"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_a_threaded_solution_passes_under_any_uid():
    # M9: LiveCodeBench allows threads; the task limit counts only the child's own, whatever the uid
    for as_user in ("root", "ordinary"):
        results, folder, _ = _grade_as(as_user, threaded=THREADED)
        shutil.rmtree(folder, ignore_errors=True)
        assert results["threaded"], f"a correct threaded solution failed as {as_user}"


@pytest.mark.slow
def test_a_flood_of_the_result_pipe_costs_the_grader_little():
    # M5: 384 MiB without a newline on the result pipe; the grader reads at most LINE_BYTES (32 MiB)
    results, folder, _ = _grade_as("root", flood=FLOOD)
    shutil.rmtree(folder, ignore_errors=True)
    assert not results["flood"]
    assert results["flood MB kept"] < 160, f"the grader's peak memory grew {results['flood MB kept']} MB"


# What a grader holds beyond its memory (red-team-4: 1-3): a session keyring with a token in it, the result
# pipe the program inherits, and its folders under a tree the child binds (a checkout under /usr/local/src).
THIEF = """import sys
for m in ("ctypes", "_ctypes"):
    sys.modules.pop(m, None)
import ctypes
libc = ctypes.CDLL(None)
libc.syscall.restype = ctypes.c_long
L, buf = ctypes.c_long, ctypes.create_string_buffer(4096)
n = libc.syscall(L({keyctl}), L(11), L(-3), buf, L(4096))  # KEYCTL_READ of the session keyring: its key ids
found = []
for i in range(0, max(n, 0), 4):
    got = ctypes.create_string_buffer(256)
    m = libc.syscall(L({keyctl}), L(11), L(int.from_bytes(buf.raw[i:i + 4], sys.byteorder)), got, L(256))
    found += [got.raw[:m].decode(errors="replace")] if m > 0 else []
libc.syscall(L({keyctl}), L(7), L(-3))  # KEYCTL_CLEAR
print(found[0] if found else "none")
"""
NESTED = ("import os, sys\nf = sys._getframe()\nwhile 'out_fd' not in f.f_locals:\n    f = f.f_back\n"
          "os.write(f.f_locals['out_fd'], b'[' * 100000 + b'\\n')\nprint(1)\n")
READ = "import io\ntry:\n    print(io.FileIO({path!r}).read().decode())\nexcept OSError as e:\n    print(type(e).__name__)\n"
STATE = """
import ctypes, json, os, secrets, subprocess, sys
from harness import sandbox
kind, one, results = sys.argv[1], [{"input": "", "output": "1", "testtype": "stdin"}], {}
if kind == "keyring":   # as a login (pam_keyinit) or a container runtime leaves one, with a token in it
    from harness.sandbox_child import KEYCTL
    libc = ctypes.CDLL(None)
    libc.syscall.restype = ctypes.c_long
    L, keyctl = ctypes.c_long, KEYCTL[os.uname().machine]
    assert libc.syscall(L(keyctl), L(1), None) > 0   # KEYCTL_JOIN_SESSION_KEYRING
    secret = secrets.token_hex(8)
    key = libc.syscall(L(keyctl - 2), b"user", b"hf_token", secret.encode(), L(len(secret)), L(-3))  # add_key
    thief = sys.argv[2].format(keyctl=keyctl)
    results["stolen"] = sandbox.run_tests(thief, [{"input": "", "output": secret, "testtype": "stdin"}])
    got = ctypes.create_string_buffer(64)
    n = libc.syscall(L(keyctl), L(11), L(key), got, L(64))   # KEYCTL_READ
    results["kept"] = got.raw[:n].decode() == secret
    # the control: the same program run unconfined finds the token (and clears the keyring)
    results["control"] = subprocess.run([sys.executable, "-c", thief], capture_output=True,
                                        text=True).stdout.strip() == secret
elif kind == "pipe":
    results["nested"] = sandbox.run_tests(sys.argv[2], one)
    results["next sample"] = sandbox.run_tests("print(1)", one)
else:   # the grader's folder (its cwd), this project, the HF cache, and a benchmark (folder and file)
    sandbox.hide += [os.path.join(kind, "bench"), os.path.join(kind, "loose.json")]
    for name in ("cwd/gold", "project/gold", "hf/token", "bench/gold", "loose.json", "visible"):
        with open(os.path.join(kind, name)) as f:
            gold = [{"input": "", "output": f.read(), "testtype": "stdin"}]
        results[name] = sandbox.run_tests(sys.argv[2].format(path=os.path.join(kind, name)), gold)
print(json.dumps(results))
"""


def _as(as_user, *argv, cwd=ROOT, pythonpath=ROOT, env=()):
    """Run STATE with `argv` as the current user ("self") or as uid 65534 ("nobody"); its results."""
    user = []
    if as_user == "nobody":
        if os.geteuid() != 0 or not shutil.which("setpriv"):
            pytest.skip("needs root, and setpriv to become uid 65534")
        user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    python = _python_for(user)
    if python is None:
        pytest.skip(f"no Python that {as_user} can run with this checkout ({ROOT})")
    done = subprocess.run([*user, python, "-c", STATE, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": pythonpath, "PATH": os.defpath, **dict(env)})
    assert done.returncode == 0, f"the grader died ({done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("as_user", ["self", "nobody"])
def test_a_program_cannot_read_or_clear_the_graders_session_keyring(as_user):
    try:
        results = _as(as_user, "keyring", THIEF)
    except AssertionError as e:
        if "KEYCTL_JOIN" in str(e):
            pytest.skip("the grader cannot join a session keyring here (no keys in the kernel, or keyctl refused)")
        raise
    assert results == {"stolen": False, "kept": True, "control": True}


@pytest.mark.parametrize("as_user", ["self", "nobody"])
def test_a_line_on_the_result_pipe_that_does_not_decode_fails_that_sample_only(as_user):
    # "[" * 100000 makes json.loads raise RecursionError: the sample fails and the next one grades
    assert _as(as_user, "pipe", NESTED) == {"nested": False, "next sample": True}


def _folder_under_a_bound_tree():
    """A new folder (755) in a tree the child binds (/usr, Python's installation), or None."""
    for tree in ("/usr/local/share", "/usr/local", "/usr/share", os.path.join(sys.base_prefix, "share")):
        if os.path.isdir(tree) and os.access(tree, os.W_OK):
            folder = tempfile.mkdtemp(dir=tree, prefix="rlcm-hidden-")
            os.chmod(folder, 0o755)
            return folder
    return None


@pytest.mark.parametrize("as_user", ["self", "nobody"])
def test_the_graders_folders_are_hidden_under_any_tree(as_user):
    # red-team-4 case 3: a checkout under /usr/local/src (Docker's WORKDIR /usr/src/app) was readable
    folder = _folder_under_a_bound_tree()
    if folder is None:
        pytest.skip("no folder under a tree the sandbox binds (/usr, Python's installation) is writable here")
    try:
        for sub in ("cwd", "project", "hf", "bench"):
            os.mkdir(os.path.join(folder, sub), 0o755)
        shutil.copytree(os.path.join(ROOT, "harness"), os.path.join(folder, "project", "harness"))
        for name in ("cwd/gold", "project/gold", "hf/token", "bench/gold", "loose.json", "visible"):
            with open(os.path.join(folder, name), "w") as f:
                f.write(str(random.randrange(10 ** 11, 10 ** 12)))
            os.chmod(os.path.join(folder, name), 0o644)
        results = _as(as_user, folder, READ, cwd=os.path.join(folder, "cwd"),
                      pythonpath=os.path.join(folder, "project"), env={"HF_HOME": os.path.join(folder, "hf")})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    # only the file nothing hides is read: the control, which shows the tree is bound
    assert results == {"cwd/gold": False, "project/gold": False, "hf/token": False, "bench/gold": False,
                       "loose.json": False, "visible": True}


def test_evaluate_hides_its_benchmarks_models_and_output(monkeypatch, tmp_path):
    import evaluate
    from harness import sandbox
    monkeypatch.setattr(sandbox, "hide", [])
    lcb = os.path.join(ROOT, "tests", "fixtures", "lcb.jsonl")
    monkeypatch.setattr(evaluate, "load_benchmarks", lambda *a: (_ for _ in ()).throw(SystemExit("stop")))
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(SystemExit, match="stop"):   # the paths are named before any benchmark or model loads
        evaluate.main(["--model", str(model), "--benchmarks", f"toy,lcb={lcb}", "--out", str(tmp_path)])
    assert sandbox.hide == [lcb, str(model), str(tmp_path)]   # what exists of them


def test_where_programs_cannot_be_confined_the_line_names_the_cause(monkeypatch):
    from harness import sandbox
    for why, fix in (("unshare: unshare failed: Operation not permitted", "Allow unprivileged user namespaces"),
                     ("[Errno 2] No such file or directory: 'unshare'", "Install util-linux's unshare"),
                     ("FileExistsError: [Errno 17] File exists: 'tmp'", "Fix that")):
        monkeypatch.setattr(sandbox, "_why_not", lambda: why)
        with pytest.raises(sandbox.SandboxUnavailable) as err:
            sandbox.check()
        assert str(err.value) == (f"sandbox: cannot confine programs in namespaces here ({why}); no code was run. "
                                  f"{fix}, or accept running model-written code unconfined with evaluate.py "
                                  "--unconfined-code")


def test_without_namespaces_no_code_runs_unless_the_user_accepts_it(monkeypatch, tmp_path, capsys):
    import evaluate
    from harness import sandbox
    trace = tmp_path / "ran"
    code = f"import io\nio.FileIO({str(trace)!r}, 'x').close()\nprint(1)"   # leaves a file if it runs unconfined
    one = [{"input": "", "output": "1", "testtype": "stdin"}]
    monkeypatch.setattr(sandbox, "UNSHARE", "no-such-unshare")   # as where util-linux or user namespaces are missing
    sandbox._why_not.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match="^sandbox: cannot confine .*no-such-unshare.*"
                                                             "evaluate.py --unconfined-code$") as err:
            sandbox.run_tests(code, one)
        assert "\n" not in str(err.value) and not trace.exists()
        monkeypatch.setattr(sandbox, "allow_unconfined", True)
        assert sandbox.run_tests(code, one) and trace.exists()   # accepted: it runs, unconfined
        assert "UNCONFINED" in capsys.readouterr().err
        # evaluate.py says so before any model loads or any sample is drawn, unless --unconfined-code
        lcb = os.path.join(ROOT, "tests", "fixtures", "lcb.jsonl")
        with pytest.raises(SystemExit) as exit_:
            evaluate.main(["--model", "toy", "--benchmarks", f"lcb={lcb}", "--out", str(tmp_path / "ev")])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and err.startswith("evaluate.py: error: sandbox: cannot confine")
        assert "\n" not in err and not (tmp_path / "ev" / "samples.jsonl").exists()
        assert evaluate.parse_args(["--model", "m", "--unconfined-code"]).unconfined_code
    finally:
        sandbox._why_not.cache_clear()
        sandbox.allow_unconfined = False


# red-team-5 cases 8 and 9: system calls no test program needs, and host paths the child could read
SYSCALLS = """import errno, sys
for m in ("ctypes", "_ctypes"):
    sys.modules.pop(m, None)
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def call(number, *args):
    return "ok" if libc.syscall(ctypes.c_long(number), *args) >= 0 else errno.errorcode[ctypes.get_errno()]
print(call({io_uring_setup}, 8, ctypes.create_string_buffer(120)), call({keyctl}, 0, -3, 0))
for family in (40, 1):  # AF_VSOCK (no namespace: a VM's host), then AF_UNIX
    print(call({socket}, family, 1, 0))
"""
HOST_PATHS = """import gc, io, os, sys
def look():
    seen = [repr(o) for o in gc.get_objects()]
    frame = sys._getframe().f_back
    while frame:
        seen.append(repr(frame.f_locals))
        frame = frame.f_back
    try:
        mounts = io.FileIO("/proc/self/mountinfo").read().decode()
    except OSError:
        mounts = ""
    found = any(path[::-1] in s for path in {reversed_paths!r} for s in seen)   # the code's text holds none
    return found, os.path.realpath(sys.base_prefix) in mounts or "sandbox-" in mounts
print(*look())
"""


def test_a_program_cannot_make_the_system_calls_no_test_needs():
    from harness.sandbox import run_tests
    from harness.sandbox_child import ARCHES, REFUSED
    machine = os.uname().machine
    if machine not in ARCHES:
        pytest.skip(f"no system call table for {machine}")
    numbers = {name: REFUSED[name][ARCHES[machine][0]] for name in ("io_uring_setup", "keyctl")}
    refused = [{"input": "", "output": "EPERM EPERM\nEPERM\nok", "testtype": "stdin"}]
    assert run_tests(SYSCALLS.format(**numbers, socket={"x86_64": 41, "aarch64": 198}[machine]), refused)
    assert run_tests(THREADED, [{"input": "20 22", "output": "42", "testtype": "stdin"}])   # threads start
    # where the filter cannot be installed, one line says so and the program runs on
    done = subprocess.run([sys.executable, "-c", "from harness.sandbox_child import refuse_syscalls\n"
                           "refuse_syscalls('vax')\nprint('ran')"], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout == "ran\n" and done.stderr.startswith("sandbox: no seccomp filter") \
        and done.stderr.count("\n") == 1, done.stderr


def test_a_program_finds_no_host_path(monkeypatch):
    from harness import sandbox
    hidden = "/no/such/folder-7781"
    monkeypatch.setattr(sandbox, "hide", [hidden])
    code = HOST_PATHS.format(reversed_paths=[hidden[::-1], os.path.realpath(ROOT)[::-1]])   # and this project
    assert sandbox.run_tests(code, [{"input": "", "output": "False False", "testtype": "stdin"}])
