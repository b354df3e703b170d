"""Atomic file writes (a reader, or a process killed mid-write, never sees half a file) and
JSON reads that fail as one line."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temp file in the same folder, fsync'd and
    renamed over the target; the temp file is removed on any failure."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=p.suffix)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return p


def read_json(path: str | os.PathLike, error: type[Exception]):
    """The parsed JSON of ``path``; ``error("PATH: why")`` when it is missing or not JSON."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: no such file")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{p}: not valid JSON ({exc})") from None
