"""--reward-fn FILE.py:NAME: a correctness function of your own in place of the built-in graders.

    def my_correctness(response, answer, row):   # -> a float in [0, 1], or None to skip
        return float(response.strip().endswith(answer))

It grades every rollout's whole text and every forced answer alone (None: docs/reference.md,
"--reward-fn"). The file runs in this process with your permissions.
"""
import functools
import importlib.util
import numbers
import os

from harness import files
from harness.files import UserError, first_line


@functools.cache
def load(spec):
    """The function NAME of FILE.py, spec = "FILE.py:NAME"; UserError (one line) if it cannot be had."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise UserError(f"--reward-fn {spec}: give FILE.py:NAME, the file, a colon and the function's name")
    if not os.path.isfile(path):
        raise UserError(f"--reward-fn {spec}: no file {path}; pass the path of a Python file")
    module_spec = importlib.util.spec_from_file_location("reward_fn", path)
    if module_spec is None:
        raise UserError(f"--reward-fn {spec}: {path} is not a Python file (FILE.py:NAME)")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # a sys.exit() in the file is an import failure too
        raise UserError(f"--reward-fn {spec}: importing {path} failed ({type(e).__name__}: "
                        f"{first_line(e)}); fix the file") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"--reward-fn {spec}: {path} has no function {name}"
                        + (f" ({name} is a {type(fn).__name__})" if hasattr(module, name) else ""))
    return fn


def digest(spec):
    """The sha256 of the file at spec (None without --reward-fn), for config.json: a resume sees an edit."""
    return files.sha256(spec.rpartition(":")[0]) if spec else None


def judge(spec, response, answer, row):
    """The checked value of the function at spec for one response: a float in [0, 1], or None."""
    try:
        value = load(spec)(response, answer, dict(row))
    except KeyboardInterrupt:   # Ctrl-C while it runs: train.py's own line (it cannot be told from a raise)
        raise
    except BaseException as e:   # sys.exit() in it too: it must not end the run as a success
        raise UserError(f"--reward-fn {spec} raised {type(e).__name__}: {first_line(e)} "
                        f"(on response {response[:40]!r}); fix the function") from None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= 1:
        shown = repr(value)[:40]
        raise UserError(f"--reward-fn {spec} returned {shown} ({type(value).__name__}) on response "
                        f"{response[:40]!r}: it must return a float in [0, 1] or None")
    return float(value)  # NaN fails 0 <= value above
