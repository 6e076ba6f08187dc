"""The benchmarks' library (bench/ holds the runnable benchmarks): held-out prompt sets (``workloads``, ``prompts``),
the machine record and bandwidth probes (``machine``), result files (``results``), llama.cpp's tools (``llamacpp``)."""
import os
import sys


def _checkout_last() -> None:
    """``python -m`` puts the checkout first on sys.path, where its kernels/ folder (installed as swiftk.kernels)
    shadows the ``kernels`` package that transformers >= 5.25 imports at load: the checkout goes after the installed
    packages (nothing installed is named like another of its folders)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = [p for p in sys.path if os.path.abspath(p or os.curdir) == root]
    for p in here:
        sys.path.remove(p)
    sys.path.extend(here)


_checkout_last()
