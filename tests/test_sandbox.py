"""The sandboxed code grader: LiveCodeBench's comparison rules, hostile solutions, private-test decoding."""
import ast
import base64
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import venv
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

import harness.sandbox
import harness.sandbox_child
from harness.sandbox import decode_private_tests, extract_code, grade_many, run_tests, same_output

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADD = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
       {"input": "10 -4", "output": "6", "testtype": "stdin"}]
ADD_RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"
APPEND = [{"input": "[1, 2]\n3", "output": "[1, 2, 3]", "testtype": "functional"},
          {"input": "[]\n0", "output": "[0]", "testtype": "functional"}]
APPEND_RIGHT = "class Solution:\n    def push(self, xs, x):\n        return xs + [x]\n"


def stdin_tests(*pairs):
    return [{"input": i, "output": o, "testtype": "stdin"} for i, o in pairs]


def _imports(module):
    tree = ast.parse(open(module.__file__).read())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


def test_sandbox_imports_only_the_standard_library():
    # the child runs its file under `python -I`: nothing of the project, nothing installed
    names = _imports(harness.sandbox_child)
    assert names and names <= sys.stdlib_module_names, names - sys.stdlib_module_names
    assert _imports(harness.sandbox) - sys.stdlib_module_names == {"harness"}  # the child's constants


def test_extract_code_takes_the_last_block_after_the_thinking():
    response = ("<think>\n```python\nprint('draft')\n```\n</think>\nFirst:\n```\nprint(1)\n```\n"
                "Better:\n```python\nprint(2)\n```\nDone.")
    assert extract_code(response) == "print(2)\n"
    assert extract_code("<think>```python\nx = 1\n```</think> no code here") is None
    assert extract_code("```py\nx = 1\n```\n```python\ny = 2\n") == "x = 1\n"  # the last is unclosed


def test_stdin_right_and_wrong():
    assert run_tests(ADD_RIGHT, ADD)
    assert run_tests("import sys\na, b = map(int, sys.stdin.buffer.read().split())\n"
                     "sys.stdout.write(str(a + b))\n", ADD)
    assert run_tests("def main():\n    a, b = map(int, open(0).read().split())\n    print(a + b)\n"
                     "if __name__ == '__main__':\n    main()\n", ADD)
    assert not run_tests("a, b = map(int, input().split())\nprint(a - b)\n", ADD)
    assert not run_tests("print(3)\n", ADD)  # passes the first test only
    assert not run_tests("this is not python", ADD)
    assert not run_tests(None, ADD)


def test_stdin_comparison_rules():
    # whitespace at line ends and trailing newlines do not count; line count and tokens do
    assert same_output("3 4  \n5\n\n", "3 4\n5")
    assert same_output("  1\r\n2\r\n", "1\n2\n")
    assert not same_output("3 4 5", "3 4\n5")
    assert not same_output("3\n\n4", "3\n4")
    # numbers compare as Decimal: 0.50 == 0.5 and 1e2 == 100, but no tolerance and no text folding
    assert same_output("0.50 1e2", "0.5 100")
    assert not same_output("0.3333333", "0.3333334")
    assert not same_output("50000000000000001", "50000000000000000")
    assert not same_output("Yes", "YES")
    assert not same_output("1 2", "1") and not same_output("1", "1 2") and not same_output("1 x", "1")
    assert same_output("1.0   2\n3", "1 2.00\n3.0") and not same_output("NaN", "NaN 1")
    tests = stdin_tests(("", "0.5\n"), ("", "0.50"))
    assert run_tests("print('%.3f' % 0.5)\n", tests)
    assert not run_tests("print(0.5000001)\n", tests)


def test_a_long_output_line_costs_the_grader_little():
    # 8M number tokens against a 1-token gold: the token counts differ, so no Decimal is built
    # (every one was, at 2.4 s of the grader's CPU per sample)
    start = time.process_time()
    assert not same_output("1 " * 8_000_000, "42")
    assert not same_output("1\n" * 8_000_000, "42")
    assert not run_tests("import sys\nsys.stdout.write('1 ' * 8000000 + '\\n')\n", stdin_tests(("", "42")))
    assert time.process_time() - start < 0.5


def test_a_python_under_tmp_runs_programs_confined():
    # The child's own /tmp is a fresh tmpfs: a venv or a link to the interpreter that lives under the
    # host's /tmp (a newcomer's venv) still confines, and the program runs as PID 1 of its own namespace.
    if not os.access("/tmp", os.W_OK):
        pytest.skip("/tmp is not writable here")
    folder = tempfile.mkdtemp(dir="/tmp", prefix="sandbox-python-")
    os.chmod(folder, 0o755)
    try:
        venv.create(os.path.join(folder, "venv"), symlinks=True, with_pip=False)
        os.symlink(os.path.realpath(sys.executable), os.path.join(folder, "python"))
        check = ("from harness.sandbox import run_tests\n"
                 "print(run_tests('import os\\nprint(os.getpid(), os.getuid(), os.path.exists(\\'/etc\\'))', "
                 "[{'input': '', 'output': '1 65534 False', 'testtype': 'stdin'}]))")
        for python in (os.path.join(folder, "venv", "bin", "python"), os.path.join(folder, "python")):
            done = subprocess.run([python, "-c", check], cwd=ROOT, env={"PYTHONPATH": ROOT, "PATH": os.defpath},
                                  capture_output=True, text=True, timeout=120)
            assert done.stdout.strip() == "True", (python, done.stderr[-1000:])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_program_is_the_oom_killers_first_choice():
    # the grader holding a model keeps its own oom_score_adj; the program's processes have the highest
    # (read from here: the child has no /proc)
    children, scores = harness.sandbox._children, set()
    with ThreadPoolExecutor(1) as pool:
        graded = pool.submit(run_tests, "import time\ntime.sleep(2)\nprint(1)", stdin_tests(("", "1")))
        while not graded.done():
            for pid in (inner for unshare in children(os.getpid()) for inner in children(unshare)):
                try:
                    with open(f"/proc/{pid}/oom_score_adj") as f:
                        scores.add(f.read().strip())
                except OSError:  # gone
                    pass
            time.sleep(0.05)
    assert graded.result() and "1000" in scores, scores


def test_a_program_that_ignores_its_alarm_is_still_timed():
    # red-team-5 case 1: the alarm lives in the program's own process; the grader times each reply itself
    deaf = "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
    three = stdin_tests(*[("", "1")] * 3)
    for code, tests, fn_name in ((deaf + "time.sleep(3)\nprint(1)\n", three, None),
                                 (deaf + APPEND_RIGHT.replace("return", "time.sleep(3)\n        return"),
                                  APPEND, "push")):
        start = time.monotonic()
        assert not run_tests(code, tests, fn_name, per_test_s=1)
        # stopped by the grader's clock (3 s at most for a first functional reply, then a kill), with
        # room for a slow start on a busy machine; a grader that waited would take 9 s and 6 s here
        assert time.monotonic() - start < 6
    assert run_tests(deaf + "print(1)", three, per_test_s=1)


def test_functional_right_and_wrong():
    assert run_tests(APPEND_RIGHT, APPEND, fn_name="push")
    assert run_tests("class Solution:\n    def push(self, xs, x):\n        return tuple(xs) + (x,)\n",
                     APPEND, fn_name="push")  # tuples count as lists
    assert not run_tests("class Solution:\n    def push(self, xs, x):\n        return xs\n",
                         APPEND, fn_name="push")
    # right on the first test, wrong on the second
    assert not run_tests("class Solution:\n    def push(self, xs, x):\n        return [1, 2, 3]\n",
                         APPEND, fn_name="push")
    assert not run_tests(APPEND_RIGHT, APPEND, fn_name="pop")  # no such method


def test_prelude_imports_as_livecodebench():
    # LiveCodeBench runs an import prelude first: these names need no import there, nor here
    code = "d = defaultdict(int)\nh = [3, 1]\nheapify(h)\nprint(heappop(h), gcd(12, 18))\n"
    assert run_tests(code, stdin_tests(("", "1 6")))


def test_solution_cannot_read_the_expected_output():
    # only the inputs reach the child: a solution looking for the expected answer finds none
    # (the needle is built at run time so that the code's own text does not hold it)
    code = ("import gc\ndef look():\n    needle = ''.join(['SENTINEL', '-4417'])\n"
            "    return any(needle in repr(o) for o in gc.get_objects())\nprint(look())\n")
    assert run_tests(code, stdin_tests(("", "False")))
    assert not run_tests(code, stdin_tests(("", "SENTINEL-4417")))


def _pids_with(marker):
    """Processes whose command line holds `marker` (a /proc scan, no psutil)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


# Hostile solutions: each attacks, then prints the right answer, so it passes if and only if the
# attack is not stopped. {outside}: a file that must stay absent; {sentinel}: one that must survive.
ATTACKS = {
    "loop": "while True:\n    pass",
    "loop_eating_the_alarm": "while True:\n    try:\n        while True:\n            pass\n"
                             "    except BaseException:\n        pass",
    "memory": "x = bytearray(6 << 30)",
    "memory_growing": "xs = []\nwhile True:\n    xs.append(bytearray(50 << 20))",
    "popen": "import subprocess\nsubprocess.Popen(['sleep', '31337'])",
    "system": "import os\nos.system('sleep 31337 &')",
    "fork": "import os\nif os.fork() == 0:\n    import time\n    time.sleep(31337)",
    "posix_spawn": "import os\nos.posix_spawn('/bin/sleep', ['sleep', '31337'], {{}})",
    "multiprocessing": "import multiprocessing, time\n"
                       "multiprocessing.Process(target=time.sleep, args=(31337,)).start()",
    "write_open": "open({outside!r}, 'w').write('x')",
    "write_pathlib": "import pathlib\npathlib.Path({outside!r}).write_text('x')",
    "write_os_open": "import os\nos.open({outside!r}, os.O_CREAT | os.O_WRONLY)",
    "remove": "import os\nos.remove({sentinel!r})",
    "unlink_pathlib": "import pathlib\npathlib.Path({sentinel!r}).unlink()",
    "rmtree": "import shutil\nshutil.rmtree({folder!r})",
    "kill_parent": "import os\nos.kill(os.getppid(), 9)",
    "killpg_parent": "import os\nos.killpg(os.getpgid(os.getppid()), 9)",
    "kill_parent_posix": "import os, posix\nposix.kill(os.getppid(), 9)",
    "connect": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
    "connect_raw": "import _socket\n_socket.socket().connect(('127.0.0.1', {port}))",
    "connect_urllib": "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}', timeout=2)",
}


@pytest.mark.parametrize("kind", ATTACKS)
def test_hostile_solution_fails_fast_and_harms_nothing(kind, tmp_path):
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("keep")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    per_test_s = 1.0
    start = time.monotonic()
    try:
        code = ATTACKS[kind].format(outside=str(tmp_path / "written"), sentinel=str(sentinel),
                                    folder=str(tmp_path), port=listener.getsockname()[1])
        passed = run_tests(code + "\n" + ADD_RIGHT, ADD, per_test_s=per_test_s)
        took = time.monotonic() - start
        with pytest.raises(BlockingIOError):  # no connection ever reached the listener
            listener.accept()
    finally:
        listener.close()
    assert not passed
    # the per-test alarm stops a plain loop; one that swallows the alarm is late by the grader's clock
    assert took < (per_test_s + 3 if kind == "loop_eating_the_alarm" else 3)
    assert not _pids_with("31337"), "a process the solution started is still alive"
    assert sentinel.read_text() == "keep" and not (tmp_path / "written").exists()
    assert run_tests(ADD_RIGHT, ADD)  # and the next sample still grades


def test_solution_cannot_print_the_evaluations_environment(monkeypatch):
    monkeypatch.setenv("RLCM_SECRET", "hunter2")
    tests = stdin_tests(("", "hunter2"))
    assert run_tests("print('hunter2')", tests)  # the test itself can pass
    assert not run_tests("import os\nprint(os.environ.get('RLCM_SECRET'))", tests)
    assert not run_tests("import os\nprint(os.getenv('RLCM_SECRET'))", tests)
    assert not run_tests("print(open('/proc/self/environ').read())", tests)
    # the child's whole environment is the minimal one
    env = "import os\nprint(sorted(os.environ))"
    assert run_tests(env, stdin_tests(("", str(sorted(["PATH", "LANG", "OMP_NUM_THREADS",
                                                      "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"])))))


def test_grade_many_keeps_order_and_is_fast():
    """100 samples of a 5-test problem on 2 workers, half right and half wrong, under 10 s, or on a busy
    machine within twice the time of 100 bare interpreter launches there (the floor of a child per sample)."""
    tests = stdin_tests(*[(f"{i} {i * 7}", str(i * 8)) for i in range(5)])
    wrong = "a, b = map(int, input().split())\nprint(a * b)\n"
    jobs = [{"code": ADD_RIGHT if i % 2 else wrong, "tests": tests} for i in range(100)]
    start = time.monotonic()
    results = grade_many(jobs, workers=2)
    took = time.monotonic() - start
    assert results == [bool(i % 2) for i in range(100)]
    if took >= 10:
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda _: subprocess.run([sys.executable, "-I", "-c", "import json"]), range(20)))
        floor = (time.monotonic() - start) * 5
        print(f"grade_many: 100 samples x 5 tests, 2 workers: {took:.2f} s; 100 bare launches: {floor:.2f} s")
        assert took < 2 * floor


def _blob(obj):
    return base64.b64encode(zlib.compress(pickle.dumps(obj))).decode()


class _Evil:
    def __reduce__(self):
        return os.system, ("touch pwned-by-pickle",)


def test_decode_private_tests(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tests = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    assert decode_private_tests(_blob(json.dumps(tests))) == tests
    assert decode_private_tests(json.dumps(tests)) == tests
    for evil in (_blob(_Evil()), _blob([json.dumps(tests), _Evil()])):
        with pytest.raises(ValueError, match="posix.system|os.system") as err:
            decode_private_tests(evil)
        assert "\n" not in str(err.value)
    assert not (tmp_path / "pwned-by-pickle").exists()
    for bad in ("not json, not base64!", base64.b64encode(b"not zlib").decode(), _blob(["a list"])):
        with pytest.raises(ValueError, match="^private tests: ") as err:
            decode_private_tests(bad)
        assert "\n" not in str(err.value)
