"""Where Tandem keeps its files: the user's data and cache folders, or `$TANDEM_HOME` when set (tests)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def data_dir() -> Path:
    override = os.environ.get("TANDEM_HOME")
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_data_dir("tandem", appauthor=False))


def cache_dir() -> Path:
    override = os.environ.get("TANDEM_HOME")
    if override:
        return Path(override) / "cache"
    import platformdirs

    return Path(platformdirs.user_cache_dir("tandem", appauthor=False))


def atomic_write_json(path: Path, data: Any) -> Path:
    """Write JSON to a temporary file in the same folder, then rename it over `path`: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
