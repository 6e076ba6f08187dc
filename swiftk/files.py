"""Reading files swiftk did not write: checked to be what they claim before any parser sees them."""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from .errors import SwiftkError

MAX_JSON_BYTES = 64 << 20   # config and tokenizer side files are kilobytes; a tokenizer.json tens of MB


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


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def read_json(path, what: str = "JSON file", expect: type = dict, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value in ``path`` (of type ``expect``); NaN/Infinity, bad UTF-8, deep nesting, a huge file or the
    wrong top-level type give a SwiftkError naming the file."""
    p = regular_file(path, what)
    if p.stat().st_size > max_bytes:
        raise SwiftkError(f"{what} {p} is {p.stat().st_size >> 20} MiB; more than {max_bytes >> 20} MiB is not a "
                          f"{what}")
    text = None
    try:
        text = p.read_bytes().decode("utf-8")
        value = json.loads(text, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise SwiftkError(f"{what} {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise SwiftkError(f"{what} {p} is nested too deeply to be a {what}") from None
    except ValueError as e:
        m = text and re.search(r'"([^"]{1,80})"\s*:\s*(?:\[[^\]]*?)?(-?Infinity|NaN)', text)
        if m:   # name the field: the parser only knows the constant
            raise SwiftkError(f"{what} {p} is corrupt: {m.group(1)} holds {m.group(2)}, not a finite number") from None
        raise SwiftkError(f"{what} {p} is not valid JSON: {e}") from None
    except OSError as e:
        raise SwiftkError(f"cannot read {what} {p}: {e.strerror}") from None
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
