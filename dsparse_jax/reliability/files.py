"""Small files written atomically: a kill leaves the old file or the new one, never half."""

from __future__ import annotations

import json
import os


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` via `<path>.tmp` and a rename."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json_atomic(path: str, obj, indent: int | None = None) -> None:
    """json.dump `obj` to `path` via `<path>.tmp` and a rename."""
    write_text_atomic(path, json.dumps(obj, indent=indent))


def emit_json(obj, out: str | None = None) -> None:
    """A script's result: `obj` as indented JSON on stdout and, with `out`, the same text
    written there atomically."""
    text = json.dumps(obj, indent=1)
    print(text, flush=True)
    if out:
        write_text_atomic(out, text + "\n")
