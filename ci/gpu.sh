#!/usr/bin/env bash
# GPU validation on a CUDA machine, everything side by side (the search is host-bound):
#   bash ci/gpu.sh OUTDIR [SECONDS]
# - the gpu-marked tests (real CUDA graphs, kernels, Hopper routes, the GPU chaos campaign);
# - ci/gpu_validate.py: every mutant under real CUDA graphs, the clean backend, emulator == cuda;
# - each example backend (examples/) in a `mla-fuzz run --graph cuda` campaign.
# Logs and json land in OUTDIR; the exit status is the worst of the parts.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash ci/gpu.sh OUTDIR [SECONDS]}
T=${2:-480}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" || { echo "ci/gpu.sh: needs CUDA" >&2; exit 2; }
pids=()
timeout "$T" "$PY" -m pytest -q -m gpu tests/ -n 6 -p no:cacheprovider >"$OUT/gpu-suite.txt" 2>&1 & pids+=($!)
timeout "$T" "$PY" ci/gpu_validate.py --out "$OUT/gpu-validate.json" --matrix-spec deepseek-v3 \
    --clean-examples 2000 --clean-big 40 --procs 6 --budget $((T / 3)) >"$OUT/gpu-validate.txt" 2>&1 & pids+=($!)
for ex in reference_backend:ReferenceBackend triton_decode:TritonDecodeBackend sglang_style:SGLangStyleBackend; do
    name=${ex%%:*}
    timeout "$T" "$PY" -m mla_fuzz.harness.cli run --backend "mla_fuzz.examples.$ex" --graph cuda \
        --budget $((T / 3))s --workers 1 --seed 0 --corpus "$OUT/corpus-$name" --json "$OUT/example-$name.json" \
        >"$OUT/example-$name.txt" 2>&1 & pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p"; r=$?; [ "$r" -gt "$rc" ] && rc=$r; done
tail -n 3 "$OUT"/*.txt
exit "$rc"
