"""`python -m mla_fuzz.mla_ref.demo` runs end to end and reports every request."""
import re
import runpy
import sys

import pytest

from mla_fuzz.mla_ref.demo import main


def test_demo_tiny_passes_and_prints_each_row(capsys):
    rc = main(["--spec", "tiny", "--batch", "3", "--max-seq-len", "40", "--next-n", "3", "--page-size", "8",
               "--dtype", "fp32", "--kv-dtype", "fp8", "--fp8-out"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+\s", line)]
    assert len(rows) == 3, out
    assert "OK" in out.splitlines()[-1]


def test_demo_module_entry_point_exits_zero(monkeypatch, capsys):
    """The `python -m` path (the __main__ guard and sys.exit), run in-process to skip a
    second interpreter start-up."""
    monkeypatch.setattr(sys, "argv", ["mla_fuzz.mla_ref.demo", "--spec", "tiny", "--batch", "2", "--dtype", "bf16",
                                      "--max-seq-len", "20"])
    # With the project installed editable (the README's set-up), pytest's assertion rewriter
    # claims its packages (they ship the pytest plugin) and, having no get_code, breaks
    # runpy's import (pytest 9: "'AssertionRewritingHook' object has no attribute
    # 'get_code'"); `python -m` runs without it, so this does too: the module found afresh
    # (not the rewritten one this file imported) by the finders other than the rewriter
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path
                                           if type(f).__name__ != "AssertionRewritingHook"])
    monkeypatch.delitem(sys.modules, "mla_fuzz.mla_ref.demo", raising=False)
    with pytest.raises(SystemExit) as info:
        runpy.run_module("mla_fuzz.mla_ref.demo", run_name="__main__", alter_sys=True)
    assert info.value.code == 0
    assert "worst relative error" in capsys.readouterr().out


def test_demo_rejects_non_positive_sizes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--spec", "tiny", "--batch", "0"])
    assert info.value.code == 2
    assert "--batch" in capsys.readouterr().err
