"""mla-fuzz: a correctness harness and property-based fuzzer for MLA decode under CUDA graphs.

One namespace for the three layers, so that installing mla-fuzz adds a single top-level
import name (``kernels`` alone would clash with Hugging Face's kernel hub):

- ``mla_fuzz.mla_ref``: the PyTorch reference (the oracle) and the plug-in contract;
- ``mla_fuzz.kernels``: our Triton MLA backend, the realistic implementation under test;
- ``mla_fuzz.harness``: the fuzzer, its oracles, diagnosis, repros and the CLI.

In the repository the three live at the top (``mla_ref/``, ``kernels/``, ``harness/``);
``pyproject.toml`` maps them under this package.
"""
from __future__ import annotations

from pathlib import Path as _Path

# Run from a source checkout that is not installed (or installed in editable mode, whose
# finder is consulted after the path-based one): the three layers are siblings of this
# folder, so look for subpackages there too. An installed wheel holds them inside.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "harness" / "__init__.py").is_file():
    __path__.append(str(_root))  # type: ignore[name-defined]
del _Path, _root
