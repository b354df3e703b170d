"""Whether a process is still there, for processes this one did not start or cannot wait for."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and is not a zombie (one that ended and that no one has
    reaped yet is as good as gone); a process of another user counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): the signal said it exists
