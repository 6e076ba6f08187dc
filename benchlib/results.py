"""Where a run's results go: ``bench/results/<name>_<date>.md`` and ``.json``, each written whole or not at all."""
from __future__ import annotations

import sys
import time
from pathlib import Path


def write_result(out_dir, name: str, md: str, res: dict) -> Path:
    """A run's ``<out_dir>/<name>_<date>.md`` and ``.json``, each written whole or not at all; returns the stem."""
    from swiftk.atomic import write_atomic, write_json_atomic   # lazy: report's tables need no swiftk

    stem = Path(out_dir) / f"{name}_{time.strftime('%Y%m%d-%H%M%S')}"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(f"{stem}.md"), md)   # not with_suffix: model names hold dots
    write_json_atomic(Path(f"{stem}.json"), res)
    print(f"wrote {stem}.md / .json", file=sys.stderr)
    return stem
