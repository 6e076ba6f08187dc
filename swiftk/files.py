"""Reading files swiftk did not write: checked to be what they claim before any parser sees them."""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from .errors import SwiftkError

MAX_JSON_BYTES = 64 << 20   # config and tokenizer side files are kilobytes; a tokenizer.json tens of MB
MAX_TEXT_BYTES = 1 << 30    # prompts files and training text: read whole, so bounded by what memory holds


def regular_file(path, what: str = "file") -> Path:
    """``path`` if it is a regular file (a FIFO, device or socket would block or stream forever on read)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise SwiftkError(f"cannot read {what} {p}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, device or socket)"
        raise SwiftkError(f"{what} {p} is {kind}")
    return p


def read_bytes(path, what: str = "file", max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` (else a SwiftkError naming it). Every file
    swiftk reads whole goes through here: a FIFO would block, /dev/zero or a growing file would fill memory."""
    p = regular_file(path, what)
    try:
        size = p.stat().st_size
        if size <= max_bytes:
            with open(p, "rb") as f:
                data = f.read(max_bytes + 1)   # bounded even when st_size lies (procfs, a file growing)
    except OSError as e:
        raise SwiftkError(f"cannot read {what} {p}: {e.strerror}") from None
    if size > max_bytes or len(data) > max_bytes:
        raise SwiftkError(f"{what} {p} is over {_size(max_bytes)}; that is not a {what}")
    return data


def read_text(path, what: str = "file", max_bytes: int = MAX_TEXT_BYTES) -> str:
    """:func:`read_bytes` decoded as UTF-8 (else a SwiftkError naming the file and byte)."""
    data = read_bytes(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SwiftkError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def read_json(path, what: str = "JSON file", expect: type = dict, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value in ``path`` (of type ``expect``); NaN/Infinity, bad UTF-8, deep nesting, a huge file or the
    wrong top-level type give a SwiftkError naming the file."""
    p = Path(path)
    text = read_text(p, what, max_bytes)
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise SwiftkError(f"{what} {p} is nested too deeply to be a {what}") from None
    except ValueError as e:
        m = text and re.search(r'"([^"]{1,80})"\s*:\s*(?:\[[^\]]*?)?(-?Infinity|NaN)', text)
        if m:   # name the field: the parser only knows the constant
            raise SwiftkError(f"{what} {p} is corrupt: {m.group(1)} holds {m.group(2)}, not a finite number") from None
        raise SwiftkError(f"{what} {p} is not valid JSON: {e}") from None
    if not isinstance(value, expect):
        names = {dict: "object", list: "array", str: "string"}
        raise SwiftkError(f"{what} {p} must hold a JSON {names.get(expect, expect.__name__)}, got "
                          f"{names.get(type(value), type(value).__name__)}")
    return value


def check_output_path(path, what: str = "output file") -> None:
    """Fail before slow work when ``path`` could not be written once it is done: a directory, a missing or
    unwritable folder."""
    p = Path(path)  # as the writer will see it (no ~ expansion)
    if p.is_dir():
        raise SwiftkError(f"{what} {path}: is a directory")
    if not p.parent.is_dir():
        raise SwiftkError(f"{what} {path}: directory {p.parent} does not exist")
    if not os.access(p.parent, os.W_OK | os.X_OK):
        raise SwiftkError(f"{what} {path}: directory {p.parent} is not writable")
