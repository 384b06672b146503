"""The files the project reads and writes, and the three rules they all follow (docs/FAULTS.md):

  * a path read or written is a regular file after symlinks are followed (or a directory where one is meant):
    a FIFO would block the open forever, a device be read forever (regular_file);
  * a write goes to a temporary file in the same directory, then os.replace: a full disk or a Ctrl-C leaves
    the old file whole, never a fragment, and the new file gets the usual permissions (replacing, write_text);
  * an output is never a file the same run reads (check_not_input).

Tests: python -m pytest -q tests/test_faults.py -k "regular or failed_write or umask or overwrite"
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile


def regular_file(path: str) -> bool:
    """Whether `path` exists, as a regular file once symlinks are followed; anything else that exists there (a
    FIFO, a device, a directory, a socket) is a ValueError `PATH: not a regular file`."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as e:          # a symlink loop, a path through a file, no permission
        raise ValueError(f"{path}: {e.strerror.lower()}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: not a regular file")
    return True


def json_kind(value) -> str:
    """What a JSON value is, in words: 'a list', 'a string', 'null'..."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


MAX_JSON_BYTES = 1 << 28      # a config or index file, read whole: K2.6's index is ~10 MB
MAX_DIGITS = 4000             # a JSON integer longer than this is no count or id (Python's int() stops at 4300)


class LongNumber(str):
    """A JSON integer of more than MAX_DIGITS digits, kept as its text: whichever field holds it then says it
    is not an integer it can take, naming the file and the field."""

    def __repr__(self) -> str:
        return f"a {len(self)}-digit integer"


def read_json(path: str) -> dict:
    """A JSON file whose top level is an object; any other content (a device, a huge file, binary data) is one
    ValueError naming the file. A missing file is FileNotFoundError."""
    if not regular_file(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.getsize(path) > MAX_JSON_BYTES:
        raise ValueError(f"{path}: {os.path.getsize(path)} bytes, more than a config file holds "
                         f"({MAX_JSON_BYTES >> 20} MiB)")
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read().decode("utf-8"),
                             parse_int=lambda s: int(s) if len(s.lstrip("-")) <= MAX_DIGITS else LongNumber(s))
    except (ValueError, RecursionError) as e:      # JSON and UTF-8 errors are ValueErrors; nesting: recursion
        raise ValueError(f"{path}: not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})") \
            from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {json_kind(obj)}")
    return obj


def umask() -> int:
    """The process's umask (reading it means setting it: set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def replacing(path: str):
    """`with replacing(path) as tmp:` write the new file at tmp (a name in path's directory); when the block
    ends, tmp takes path's place in one step (os.replace). An error or Ctrl-C inside the block removes tmp and
    leaves path as it was. mkstemp makes tmp 0600: the file gets 0666 less the umask, as open() would give."""
    path = os.fspath(path)
    regular_file(path)            # a directory, FIFO or device there is an error, not replaced
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_text(path: str, text: str) -> None:
    """`text` as UTF-8 into `path`, through replacing."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def copy_file(src: str, dst: str) -> str:
    """src's bytes into dst, through replacing (shutil.copytree's copy_function)."""
    with replacing(dst) as tmp:
        shutil.copyfile(src, tmp)
    return dst


def write_json(path: str, obj, indent: int = 2) -> None:
    write_text(path, json.dumps(obj, indent=indent) + "\n")


def check_not_input(flag: str, out: str, inputs) -> None:
    """`out` (an output path given by `flag`) is none of the files in `inputs` (paths; a directory stands for
    every file in it): writing it would destroy what the run reads. The same file through a symlink or a hard
    link counts. A ValueError naming both, before any work."""
    if not os.path.exists(out):
        return
    for p in inputs:
        if p is None or not os.path.exists(p):
            continue
        names = [os.path.join(p, n) for n in sorted(os.listdir(p))] if os.path.isdir(p) else [p]
        for name in names:
            if os.path.exists(name) and os.path.samefile(out, name):
                via = "" if os.path.abspath(out) == os.path.abspath(name) else f" (it is {name})"
                what = "a file the run reads" if name == p else f"a file of {p}, which the run reads"
                raise ValueError(f"{flag} {out}: {what}{via}; writing it would destroy it: name another file")
