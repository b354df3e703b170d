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
