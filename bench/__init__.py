"""swiftk's runnable benchmarks (``python -m bench.NAME``); their shared library is benchlib/."""
import benchlib  # noqa: F401  (puts the checkout after the installed packages on sys.path: benchlib/__init__.py)
