"""A LiveCodeBench row's tests, checked when the benchmark is loaded (data._lcb_row): a malformed row
is one line naming its problem before anything is generated.

    tests, fn_name = lcb.tests_of(row)   # [{"input": str, "output": str, "testtype": "stdin"}], None

The hub stores them as JSON strings (private tests as base64(zlib(pickle(json))):
harness/sandbox.decode_private_tests); a local copy may hold them decoded already.
"""
import base64
import binascii
import json
import zlib

TYPES = ("stdin", "functional")
LIMIT = 1 << 30   # bytes private tests may inflate to: real ones are tens of MB, a zlib bomb is not bounded


class RowError(ValueError):
    """What is wrong with a row, in a few words (data.py adds the problem and what to do)."""


def _field(r, name, default, decode=json.loads):
    value = r.get(name)
    if value is None or value == "":
        value = default
    if isinstance(value, str):
        try:
            return decode(value)
        except RecursionError:   # nested thousands deep: no test is
            raise RowError(f"{name} is nested too deep to be tests") from None
        except MemoryError:      # a zlib bomb larger than this machine's memory
            raise RowError(f"{name} decodes to more than this machine's memory") from None
        except ValueError as e:
            raise RowError(f"{name}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else 'not JSON'}") from None
    return value


def _bounded(blob, name):
    """RowError when a base64(zlib(...)) blob inflates past LIMIT, found in 16 MB chunks that are not
    kept (zlib.decompress would allocate all of it first); anything else is decode_private_tests'."""
    try:
        data, d, total = base64.b64decode(blob), zlib.decompressobj(), 0
        while data:
            total += len(d.decompress(data, 1 << 24))
            if total > LIMIT:
                raise RowError(f"{name} inflates to more than {LIMIT >> 20} MB (a zlib bomb?)")
            data = d.unconsumed_tail
    except (binascii.Error, zlib.error, ValueError) as e:
        if isinstance(e, RowError):
            raise


def tests_of(r):
    """(tests, fn_name) of a LiveCodeBench row: public then private tests, each {"input": str,
    "output": str, "testtype": stdin | functional}, all of one type (functional: fn_name, the method
    of class Solution, from the metadata's func_name). RowError when any of it is not so."""
    from harness.sandbox import decode_private_tests
    public = _field(r, "public_test_cases", None)
    blob = r.get("private_test_cases")
    if isinstance(blob, str) and blob and not blob.lstrip().startswith("["):
        _bounded(blob, "private_test_cases")
    private = _field(r, "private_test_cases", "[]", decode_private_tests)
    meta = _field(r, "metadata", "{}")
    for name, value in (("public_test_cases", public), ("private_test_cases", private)):
        if not isinstance(value, list):
            raise RowError(f"{name} is {type(value).__name__}, not a list of tests")
    if not isinstance(meta, dict):
        raise RowError(f"metadata is {type(meta).__name__}, not an object")
    tests, fn_name = public + private, meta.get("func_name")
    if not tests:
        raise RowError("it has no tests")
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not all(isinstance(t.get(k), str) for k in ("input", "output")) \
                or t.get("testtype") not in TYPES:
            shown = json.dumps(t, default=str)[:60]
            raise RowError(f"test {i} is {shown}, not {{\"input\": text, \"output\": text, \"testtype\": "
                           f"{' or '.join(TYPES)}}}")
    kinds = {t["testtype"] for t in tests}
    if len(kinds) > 1:
        raise RowError("it mixes stdin and functional tests")
    if kinds == {"functional"} and not (isinstance(fn_name, str) and fn_name.isidentifier()):
        raise RowError(f"its tests are functional but metadata's func_name is {fn_name!r}, not a method name")
    return tests, fn_name
