#!/usr/bin/env bash
# The README's test command: set up, then run the pytest suite on the CPU.
# Kernels run under the Triton interpreter; graph semantics under the emulator.
set -uo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh || exit 1
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
PY=${PYTHON:-python3}
# Two workers match the 2-core CI machine; more only add interpreter contention.
"$PY" -m pytest -n "${MLA_FUZZ_WORKERS:-2}" -q -m "${MLA_FUZZ_MARKERS:-not slow}" --mla-examples "${MLA_FUZZ_SUITE_EXAMPLES:-8}" --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "ci/test.sh: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
