"""The C ABI is written twice, once for C (csrc/include/swiftk_cpu.h, which the kernels' definitions are compiled
against) and once for ctypes (swiftk/runtime/ops/cpu_abi.py): the two must declare the same functions with the same
types, in order. Read from the header's text: no compiler or built library needed."""

import ctypes
import re
from pathlib import Path

from swiftk.runtime.ops import cpu_abi

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "csrc" / "include" / "swiftk_cpu.h"
C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
           "void": None}


def _ctype(decl: str):
    """One C parameter or return type -> its ctypes type (every pointer is a void pointer to ctypes)."""
    decl = re.sub(r"\b(const|unsigned)\b", "", decl).strip()
    if "*" in decl:
        return ctypes.c_void_p
    words = decl.split()
    base = words[0] if len(words) == 1 else " ".join(words[:-1])   # a parameter carries its name last
    return C_TYPES[base]


def header_signatures(text: str) -> dict:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    out = {}
    for res, name, args in re.findall(r"SWIFTK_API\s+([\w\s\*]+?)\s*\b(swk_\w+)\s*\(([^)]*)\)\s*;", text):
        params = [a for a in (x.strip() for x in args.split(",")) if a and a != "void"]
        out[name] = (_ctype(res), [_ctype(p) for p in params])
    return out


def test_header_declares_what_ctypes_binds_with_the_same_types():
    declared = header_signatures(HEADER.read_text())
    assert set(declared) == set(cpu_abi.SIGNATURES), (sorted(set(declared) ^ set(cpu_abi.SIGNATURES)))
    for name, (res, args) in cpu_abi.SIGNATURES.items():
        assert declared[name] == (res, list(args)), name


def test_the_check_sees_a_changed_parameter():
    """The parser reads types, not just names: one parameter narrowed to int is a difference."""
    text = HEADER.read_text().replace("int swk_q_block_size(int type)", "int swk_q_block_size(int64_t type)")
    assert header_signatures(text)["swk_q_block_size"] != (ctypes.c_int, list(cpu_abi.SIGNATURES["swk_q_block_size"][1]))
