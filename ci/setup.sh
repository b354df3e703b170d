#!/usr/bin/env bash
# One set-up path for everything: the README's two commands and CI call this.
# Installs torch only when it is missing, pinned to the CPU build that lies on local
# disk (an unpinned torch would pull a multi-GB CUDA build), then triton and the
# project in editable mode with its test extras. Idempotent and quiet when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CHECKOUT=$(pwd -P)
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing torch==${MLA_FUZZ_TORCH:-2.13.0}"
    "$PY" -m pip install -q "torch==${MLA_FUZZ_TORCH:-2.13.0}"
fi
need_install=0
# From outside the checkout, so that only an install (not the working directory) satisfies
# it; the entry point's target tells a current install from one of an older layout, and the
# imported file tells an install of this checkout from one of another clone (whose code the
# tests' subprocesses would otherwise run while pytest itself runs this one's).
(cd / && MLA_FUZZ_CHECKOUT="$CHECKOUT" "$PY" -c "
import os, triton, hypothesis, numpy, pytest, xdist, rich, mla_fuzz.harness.cli
from importlib.metadata import entry_points
assert [e.value for e in entry_points(group='console_scripts') if e.name == 'mla-fuzz'] == ['mla_fuzz.harness.cli:main']
here = os.path.realpath(os.path.join(os.environ['MLA_FUZZ_CHECKOUT'], 'harness', 'cli.py'))
assert os.path.realpath(mla_fuzz.harness.cli.__file__) == here
") >/dev/null 2>&1 || need_install=1
if grep -q '^mla-fuzz = ' pyproject.toml && ! command -v mla-fuzz >/dev/null 2>&1; then need_install=1; fi
if [ "$need_install" = 1 ]; then
    echo "[setup] installing mla-fuzz and its dependencies"
    "$PY" -m pip install -q -e ".[test,cli]"
fi
"$PY" -c "import torch, triton; print(f'[setup] torch {torch.__version__}, triton {triton.__version__}')"
