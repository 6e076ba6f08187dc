"""Where swiftk keeps what it caches (models, learned state, built kernels, corpus tables, draft vocabularies):
one root, read by every layer, so it lives below all of them."""
from __future__ import annotations

import os
from pathlib import Path


def swiftk_home() -> Path:
    """Cache root: $SWIFTK_HOME, else ~/.cache/swiftk."""
    env = os.environ.get("SWIFTK_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "swiftk"


def models_dir() -> Path:
    return swiftk_home() / "models"
