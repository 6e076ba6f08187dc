"""The one exception type users catch. Subclasses ValueError so bad-argument errors read naturally."""
import os
import sys
import warnings


class SwiftkError(ValueError):
    """Bad input, unsupported model or file, or a failed integrity check; the message names the problem."""


def warn(message: str, category: type = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside swiftk, so the warning points at the user's line
    and not at an internal one."""
    pkg = os.path.dirname(os.path.abspath(__file__)) + os.sep
    level, f = 2, sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(pkg):
        f, level = f.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
