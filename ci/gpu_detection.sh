#!/usr/bin/env bash
# Time to first finding on a GPU (issue #44's done-when), each matrix one `mla-fuzz mutants`
# command in new processes, as a user runs it:
#   bash ci/gpu_detection.sh OUTDIR [WORKERS]
# - tiny, cold: an empty Triton cache (the command's warmup phase and every compilation count);
# - tiny, warm: the same command again (new processes, the cache the first one filled);
# - the held-out set (--set heldout) on the cache the tiny matrix warmed (heldout-cold: its own
#   empty cache);
# - startup: benchmarks/startup.py on the cache the tiny matrix warmed (imports, pools of 1, 4
#   and WORKERS workers to ready, one process's per-scenario kernel loads): where the seconds
#   before a row's first example go;
# - DeepSeek-V3 size, cold then warm, on its own empty cache; then the held-out set there.
# - srv-tiny-cold, srv-tiny-warm, srv-dsv3-cold, srv-dsv3-warm: the same with an `mla-fuzz server`
#   running (started before the phase on that phase's cache, its imports not counted, stopped at
#   the end): the command and its workers fork from it instead of importing torch and triton.
# PHASES="tiny-cold tiny-warm ..." picks and orders the phases (default: all but heldout-cold);
# a phase written PHASE:KEY=VAL[,KEY=VAL...] runs its matrix with those variables set and is
# named PHASE.KEY-VAL... (e.g. "srv-tiny-warm:MLA_FUZZ_CUDA_EARLY=0 srv-tiny-warm:MLA_FUZZ_CUDA_EARLY=1"
# compares both on one machine and one server; the variables reach the command, not the server);
# EXTRA="--only a,b" adds arguments to every matrix; BUNDLE=FILE.tgz also packs OUTDIR into one
# file at the end (a machine that hands back only a few files loses none of the phases').
# Each json row has seconds_to_detect (from the command's start) and row_started_s (when a
# worker took the row). Logs and json land in OUTDIR; benchmarks/gpu_detection_summary.py
# turns one or more OUTDIRs into the summary json kept under benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash ci/gpu_detection.sh OUTDIR [WORKERS]}
W=${2:-16}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
rc=0
matrix() {  # name cache-dir args... (the phase's variables, VARS, in its environment)
    local name=$1$LABEL cache=$2
    shift 2
    local t0=$SECONDS
    env ${VARS[@]+"${VARS[@]}"} TRITON_CACHE_DIR="$cache" "$PY" -m mla_fuzz.harness.cli mutants --graph cuda \
        --workers "$W" --json "$OUT/$name.json" "$@" ${EXTRA:-} >"$OUT/$name.txt" 2>&1
    local r=$?
    echo "$name: exit $r, $((SECONDS - t0)) s"
    tail -n 4 "$OUT/$name.txt"
    [ "$r" -gt "$rc" ] && rc=$r
}
SERVED=" "
server_for() {  # cache-dir: an mla-fuzz server for commands on that cache, started once
    case $SERVED in *" $1 "*) return ;; esac
    TRITON_CACHE_DIR="$1" "$PY" -m mla_fuzz.harness.cli server start --graph cuda >>"$OUT/server.txt" 2>&1
    echo "server for $1: exit $?"; tail -n 1 "$OUT/server.txt"
    SERVED="$SERVED$1 "
}
# DETECTION_CACHE: a Triton cache folder kept after the run (phases of later commands read
# what earlier ones compiled); default: a new empty folder, removed at the end
C=${DETECTION_CACHE:-$(mktemp -d)}
for token in ${PHASES:-tiny-cold tiny-warm startup heldout-warm dsv3-cold dsv3-warm heldout-dsv3-warm}; do
    phase=${token%%:*}
    VARS=() LABEL=""
    if [ "$phase" != "$token" ]; then
        IFS=, read -r -a VARS <<<"${token#*:}"
        LABEL=.$(IFS=.; echo "${VARS[*]}" | tr '=' '-')
    fi
    case $phase in
        tiny-cold|tiny-warm) matrix "$phase" "$C/tiny" --spec tiny ;;
        startup)
            env ${VARS[@]+"${VARS[@]}"} TRITON_CACHE_DIR="$C/tiny" "$PY" benchmarks/startup.py --graph cuda \
                --workers "1,4,$W" --scenarios 8 --out "$OUT/startup$LABEL.json" >"$OUT/startup$LABEL.txt" 2>&1
            r=$?; echo "startup$LABEL: exit $r"; tail -n 4 "$OUT/startup$LABEL.txt"; [ "$r" -gt "$rc" ] && rc=$r ;;
        heldout-cold) matrix "$phase" "$C/heldout" --spec tiny --set heldout ;;
        heldout-warm) matrix "$phase" "$C/tiny" --spec tiny --set heldout ;;
        dsv3-cold|dsv3-warm) matrix "$phase" "$C/dsv3" --spec deepseek-v3 ;;
        heldout-dsv3-warm) matrix "$phase" "$C/dsv3" --spec deepseek-v3 --set heldout ;;
        srv-tiny-cold|srv-tiny-warm) server_for "$C/srv-tiny"; matrix "$phase" "$C/srv-tiny" --spec tiny ;;
        srv-dsv3-cold|srv-dsv3-warm) server_for "$C/srv-dsv3"; matrix "$phase" "$C/srv-dsv3" --spec deepseek-v3 ;;
        srv-heldout-warm) server_for "$C/srv-tiny"; matrix "$phase" "$C/srv-tiny" --spec tiny --set heldout ;;
        *) echo "ci/gpu_detection.sh: unknown phase $phase" >&2; exit 2 ;;
    esac
done
[ "$SERVED" = " " ] || "$PY" -m mla_fuzz.harness.cli server stop --all >>"$OUT/server.txt" 2>&1
[ -n "${DETECTION_CACHE:-}" ] || rm -rf "$C"
if [ -n "${BUNDLE:-}" ]; then
    tar czf "$BUNDLE" -C "$OUT" . || rc=1
fi
exit "$rc"
