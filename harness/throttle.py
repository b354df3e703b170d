"""How many tasks run side by side once the GPU has run out of memory.

Workers share one GPU. When one reports that a step ran out of device memory
(``blame.DeviceOutOfMemory``: the worker has already freed what it held), that says more
about its neighbours than about the backend, so the task is not a finding: it goes back to
the queue and the parent lets fewer tasks run at once (half of those running when it
happened). Once only one may run, the retried task runs alone and is marked so (``alone``):
the worker then reports an out-of-memory error as the backend's own (its file and line),
because nothing else holds the GPU. A task that runs out of memory alone all the same (the
harness's own tensors did not fit) is not run again: its caller reports the error.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OomThrottle:
    """The number of tasks allowed to run at once (``cap``; None: every worker) and the
    tasks waiting to run again after running out of memory."""

    cap: int | None = None
    retry: list = field(default_factory=list)

    def allows(self, busy: int) -> bool:
        """Whether one more task may start while ``busy`` tasks run."""
        return self.cap is None or busy < self.cap

    @staticmethod
    def retries(event) -> bool:
        """Whether the pool event ``event`` is an out-of-memory error to run again (a task that
        ran alone is not: running it again would change nothing)."""
        return (event.kind == "error" and event.msg.get("kind") == "oom" and event.task is not None
                and not event.task.get("alone"))

    def ran_out(self, task: dict, busy: int) -> str:
        """``task`` ran out of memory while ``busy`` tasks (itself included) were running: queue
        it again and halve the cap. Returns the line to show the user."""
        before = busy if self.cap is None else min(self.cap, busy)
        self.cap = max(1, before // 2)
        self.retry.append(dict(task, oom_retries=int(task.get("oom_retries", 0)) + 1))
        at_once = "alone" if self.cap == 1 else f"at most {self.cap} at a time"
        return (f"{_what(task)} ran out of GPU memory with {busy} task(s) side by side (not a finding); "
                f"it runs again, {at_once} from now on (fewer --workers avoid this)")

    def next_retry(self, busy: int) -> dict | None:
        """The next task to run again, if one may start now; marked ``alone`` when it will."""
        if not self.retry or not self.allows(busy):
            return None
        task = self.retry.pop(0)
        if self.cap == 1 and busy == 0:
            task["alone"] = True
        return task


def _what(task: dict) -> str:
    if task.get("op") == "fuzz" and task.get("chunk") is not None:
        return f"chunk {task['chunk']} (seed {task.get('seed')})"
    if task.get("op") == "warmup":
        return f"warmup scenario '{task.get('name')}'"
    return f"row {task['backend']}" if task.get("backend") else f"task {task.get('id')}"
