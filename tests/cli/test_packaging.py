"""Installing mla-fuzz adds one top-level import name, ``mla_fuzz`` (issue: ``kernels``
alone is also Hugging Face's kernel hub, and one install would overwrite the other)."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_has_only_the_mla_fuzz_top_level_name(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("mla_fuzz", "mla_ref", "kernels", "harness", "examples"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("mla_fuzz-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith((".dist-info", ".data"))}
    assert tops == {"mla_fuzz"}, tops
    # every layer made it in, with its subpackages
    for mod in ("mla_fuzz/__init__.py", "mla_fuzz/mla_ref/__init__.py", "mla_fuzz/kernels/backend.py",
                "mla_fuzz/harness/cli.py", "mla_fuzz/harness/graphs/emulated.py", "mla_fuzz/harness/mutants/__init__.py",
                "mla_fuzz/harness/suite/test_properties.py", "mla_fuzz/examples/__init__.py"):
        assert mod in names, mod
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    entry = zipfile.ZipFile(wheel).read(meta).decode()
    assert "mla-fuzz = mla_fuzz.harness.cli:main" in entry
    assert "mla_fuzz = mla_fuzz.harness.pytest_plugin" in entry


def test_no_module_imports_the_old_top_level_names():
    """Inside the project every import goes through ``mla_fuzz``: a bare ``kernels`` would
    pick up whichever package of that name happens to be installed."""
    import re
    pat = re.compile(r"^\s*(from|import)\s+(kernels|harness|mla_ref)\b", re.M)
    offenders = []
    for folder in ("mla_ref", "kernels", "harness", "tests", "benchmarks", "ci", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if pat.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
