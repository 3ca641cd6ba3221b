"""Files in run and evaluation folders, written whole (`replacing`), and the one-line error a user
can fix (UserError), which the rest of harness raises too. `read_jsonl` repairs a log's last line cut
by a kill; `locked` holds a folder for its one writer; `identity` names a model by content."""
import hashlib
import json
import os
import secrets
import socket
import sys
import time
from contextlib import contextmanager, suppress

LOCK = "lock"
WHOLE, HEAD, SAMPLES, SLICE = 64 << 20, 1 << 20, 64, 1 << 16   # identity's reading of a big file
NOT_THE_MODEL = ("state.pt", "probe.pt")


class UserError(ValueError):
    """A problem the user can fix (bad name, missing file, offline hub): printed as one line."""


def first_line(e, limit=200):
    """An exception's message cut to its first line (a library's may run to pages)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def fresh_name(path):
    """A new name beside PATH, random: two writers (or a killed one's leftovers) never share it."""
    return f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


@contextmanager
def _writing(path):
    """A failed write (disk full, no permission) as one UserError line naming the file."""
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}: free some space or check the "
                        "folder's permissions") from None


@contextmanager
def replacing(path, mode="w"):
    """Write PATH whole or not at all: the block writes a fresh file beside it, which then replaces
    PATH; on any error PATH is as it was."""
    tmp = fresh_name(path)
    try:
        with _writing(path), open(tmp, mode.replace("w", "x")) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def appending(path):
    with _writing(path), open(path, "a") as f:
        yield f


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json(path, obj, indent=2):
    with replacing(path) as f:
        json.dump(obj, f, indent=indent)


def read_jsonl(path, valid=lambda row: True):
    """Rows of a JSON-lines log we append to. A cut-off last line (a kill mid-write) is dropped from
    the file with a message; any other bad line, or a row not `valid`, is a UserError."""
    if not os.path.lexists(path):
        return []
    with open(path, "rb") as f:
        raw = f.read()
    lines = [(i, line) for i, line in enumerate(raw.split(b"\n"), 1) if line.strip()]
    rows = []
    for i, line in lines:
        shown = line[:60].decode("utf-8", "replace")
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError:
            if (i, line) != lines[-1]:
                raise UserError(f"{path} line {i} is not JSON: remove the line") from None
            print(f"{path}: dropped a cut-off last line ({shown!r})", file=sys.stderr)
            break
        if not isinstance(row, dict) or not valid(row):
            raise UserError(f"{path} line {i} is not a row of this log ({shown}): remove the line")
        rows.append(row)
    if len(rows) < len(lines) or raw and not raw.endswith(b"\n"):  # next append: a new line
        with replacing(path, "wb") as f:
            f.write(b"".join(line + b"\n" for _, line in lines[:len(rows)]))
    return rows


def truncate_metrics(path, last_step):
    """Drop rows logged after the checkpoint we resume from (they will be produced again)."""
    if not os.path.lexists(path):
        return
    rows = read_jsonl(path, valid=lambda r: isinstance(r.get("step"), int))
    with replacing(path) as f:
        f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] <= last_step)


@contextmanager
def locked(folder, what="run"):
    """Hold FOLDER/lock while writing into FOLDER: an flock (the kernel drops it when the holder dies)
    on a file naming the holder for a second writer's one-line UserError."""
    import fcntl
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UserError(f"{folder} is in use by {_holder(path)}: another {what} is writing there; "
                            f"wait for it to end or pass another --out") from None
        with suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # else removed after our open: retry
                break
        os.close(fd)
    old = os.read(fd, 4096).decode("utf-8", "replace").strip()
    if old:
        print(f"taking over the stale lock of {_holder(path, old)} in {folder} (that process is gone)",
              file=sys.stderr)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(dict(pid=os.getpid(), host=socket.gethostname(),
                                  since=time.strftime("%Y-%m-%d %H:%M:%S"))).encode(), 0)
    os.fsync(fd)
    try:
        yield path
    finally:
        os.unlink(path)
        os.close(fd)


def _holder(path, text=None):
    try:
        h = read_json(path) if text is None else json.loads(text)
        return f"pid {h['pid']} on {h['host']} (since {h['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return f"another process (lock file {path})"


def identity(path):
    """What a model is, by content: a hash of its folder's files (not sub-folders, state.pt or probe.pt);
    a hub id stands for itself. A file over WHOLE bytes is hashed by its size, its first HEAD bytes
    and SAMPLES slices: training changes every weight, so a retrained model differs in every slice."""
    if not os.path.isdir(path):
        return path
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name in NOT_THE_MODEL or name.startswith(".") or not os.path.isfile(full):
            continue
        size = os.path.getsize(full)
        h.update(f"{name}\0{size}\0".encode())
        with open(full, "rb") as f:
            if size <= WHOLE:
                h.update(f.read())
                continue
            h.update(f.read(HEAD))
            for k in range(SAMPLES):
                f.seek(HEAD + (size - HEAD - SLICE) * k // (SAMPLES - 1))
                h.update(f.read(SLICE))
    return h.hexdigest()[:16]
