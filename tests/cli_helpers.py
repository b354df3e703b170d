"""Calling ``mla-fuzz`` in-process from the CLI tests."""
from mla_fuzz.harness import cli


def run_cli(argv, capsys):
    """``(exit code, stdout, stderr)`` of ``mla-fuzz ARGV``; no traceback may reach the user."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return code, out, err


def one_line(err: str) -> str:
    """The single non-blank line of ``err`` (a usage error is one line)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


class RecordingDisplay:
    """A campaign display that keeps what the user would have seen: ``notes`` as
    ``(time.time(), text, files)`` where ``files`` maps each ``*.json`` path the line names to
    its content at that moment (None: no such file) and ``listing`` to the names in its
    folder then; ``counts`` as ``(cases, steps)`` of every live update, ``stamps`` their
    ``time.time()``."""

    def __init__(self):
        self.notes: list = []
        self.counts: list = []
        self.stamps: list = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def note(self, text: str) -> None:
        import re
        import time
        from pathlib import Path

        files = {}
        for p in re.findall(r"(\S+\.json)", text):
            path = Path(p)
            files[p] = {"content": path.read_text() if path.exists() else None,
                        "listing": sorted(x.name for x in path.parent.iterdir()) if path.parent.is_dir() else []}
        self.notes.append((time.time(), text, files))

    def update(self, result, live_examples: int = 0, live_steps: int = 0, force: bool = False) -> None:
        import time
        self.counts.append((result.examples + live_examples, result.steps + live_steps))
        self.stamps.append(time.time())


def record_display(monkeypatch) -> RecordingDisplay:
    """Make ``mla-fuzz run`` (in-process, without ``--quiet``) show its progress to a
    ``RecordingDisplay``, returned."""
    from mla_fuzz.harness import progress

    display = RecordingDisplay()
    monkeypatch.setattr(progress, "make_progress", lambda enabled=True, stream=None: display if enabled else None)
    return display


def replaced_paths_are_announced(notes) -> None:
    """Every repro a live line named either still exists or a line says it was replaced."""
    from pathlib import Path

    for _, text, files in notes:
        for p in files:
            if not Path(p).exists():
                assert any(p in t and "replace" in t for _, t, _ in notes), (p, [t for _, t, _ in notes])
