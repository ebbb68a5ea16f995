"""Small files written atomically: a kill leaves the old file or the new one, never half."""

from __future__ import annotations

import json
import os


def write_json_atomic(path: str, obj, indent: int | None = None) -> None:
    """json.dump `obj` to `path` via `<path>.tmp` and a rename."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=indent)
    os.replace(tmp, path)
