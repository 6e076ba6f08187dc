"""Triton backend: the op names of swiftk.runtime.ops backed by the kernels in the top-level ``kernels/`` folder.

Installed, those kernels are the package ``swiftk.kernels`` (setup.py package_dir); in a source checkout that was
not pip-installed, :func:`kernels_package` maps the folder to that name so both layouts import the same code.
Triton decides interpreter vs compiled mode when a kernel module is imported, so TRITON_INTERPRET must be set
before the first use.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path



def kernels_package():
    """Import ``swiftk.kernels`` (installed) or register the checkout's ``kernels/`` folder under that name."""
    try:
        return importlib.import_module("swiftk.kernels")
    except ModuleNotFoundError:
        pass
    folder = Path(__file__).resolve().parents[3] / "kernels"
    init = folder / "__init__.py"
    if not init.is_file():
        raise ModuleNotFoundError(f"swiftk.kernels not installed and {folder} not found")
    spec = importlib.util.spec_from_file_location("swiftk.kernels", init, submodule_search_locations=[str(folder)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["swiftk.kernels"] = mod
    spec.loader.exec_module(mod)
    return mod


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> tuple[bool, str]:
    """(usable, reason) — importable Triton, and the kernel modules import."""
    try:
        import triton  # noqa: F401  (optional: importable is the test)
    except Exception as e:  # ImportError, or a broken install raising at import
        return False, f"triton cannot be imported ({type(e).__name__}: {e})"
    try:
        _load()
    except Exception as e:
        return False, f"swiftk Triton kernels failed to import ({type(e).__name__}: {e})"
    return True, "ok"


def _load():
    kernels_package()
    names = ("triton_norm", "triton_rope", "triton_swiglu", "triton_attention", "triton_kv_commit")
    return [importlib.import_module(f"swiftk.kernels.triton.{n}") for n in names]


def ops() -> dict:
    """op name -> Triton implementation."""
    norm, rope, swiglu_m, attn, kvc = _load()
    return {
        "rmsnorm": norm.rmsnorm,
        "fused_add_rmsnorm": norm.fused_add_rmsnorm,
        "apply_rope": rope.apply_rope,
        "swiglu": swiglu_m.swiglu,
        "attention": attn.attention,
        "tree_attention": attn.tree_attention,
        "kv_commit": kvc.kv_commit,
    }
