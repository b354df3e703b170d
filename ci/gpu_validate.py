"""GPU validation of the fuzzer under real CUDA graphs (run on a CUDA machine).

1. mutation matrix: every mutant fuzzed under ``cuda`` graphs at the chosen spec
   (default DeepSeek-V3 size), examples to detect, seconds, diagnosis;
2. clean backend: ``--clean-examples`` scenarios (tiny spec, many processes sharing the
   GPU — the search is host-bound) plus ``--clean-big`` at DeepSeek size; must find nothing;
3. fidelity: the emulator's verdicts equal real CUDA's on every mutant's shrunk repro.

Writes one json (``--out``) and prints a table. Exit 1 if a mutant escapes, is
misdiagnosed, the clean backend is flagged, or emulated and cuda disagree.

    python ci/gpu_validate.py --out results.json --clean-examples 5000 --procs 8
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time


def _clean_worker(args):
    spec, examples, seed, budget = args
    from mla_fuzz.harness.fuzz import fuzz
    r = fuzz("triton", spec=spec, graph_mode="cuda", examples=examples, seed=seed, budget_s=budget,
             shrink_seconds=60)
    return {"spec": spec, "seed": seed, "examples": r.examples, "steps": r.steps, "seconds": round(r.seconds, 1),
            "failed": r.failed, "diagnosis": r.repro and r.repro["diagnosis"], "steps_repro": r.repro and r.repro["steps"]}


def _mutant_worker(args):
    name, spec, seed = args
    from mla_fuzz.harness.fuzz import fuzz
    from mla_fuzz.harness.mutants import EXPECTED
    from mla_fuzz.harness.repro import replay_repro
    r = fuzz(f"mutant:{name}", spec=spec, graph_mode="cuda", examples=300, seed=seed, shrink_seconds=60)
    row = {"mutant": name, "spec": spec, "caught": r.failed, "examples_to_detect": r.examples_to_detect,
           "seconds_to_detect": r.seconds_to_detect and round(r.seconds_to_detect, 2),
           "seconds": round(r.seconds, 1), "diagnosis": r.diagnosis,
           "diagnosis_ok": r.diagnosis in EXPECTED[name],
           "shrunk_steps": len(r.repro["steps"]) if r.repro else None}
    if r.repro:
        emu = replay_repro(r.repro, graph_mode="emulated", device="cuda")
        row["emulated_agrees"] = bool(emu.failed and emu.diagnosis and emu.diagnosis.cls == r.diagnosis)
        row["repro"] = r.repro
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--matrix-spec", default="deepseek-v3", choices=("tiny", "deepseek-v3"))
    ap.add_argument("--clean-examples", type=int, default=5000)
    ap.add_argument("--clean-big", type=int, default=100)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the clean runs")
    ap.add_argument("--skip-matrix", action="store_true")
    ap.add_argument("--mutants", default=None, help="comma-separated subset of harness.mutants.ALL")
    a = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("gpu_validate: needs CUDA", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    t0 = time.time()
    with ctx.Pool(a.procs) as pool:
        from mla_fuzz.harness.mutants import ALL, INTERPRETER_ONLY
        # a mutant whose only symptom is an access out of bounds is seen by the CPU
        # interpreter's bounds check alone (harness/memory_guard.py)
        names = a.mutants.split(",") if a.mutants else [n for n in ALL if n not in INTERPRETER_ONLY]
        mjobs = [] if a.skip_matrix else [pool.apply_async(_mutant_worker, ((n, a.matrix_spec, 0),)) for n in names]
        per = -(-a.clean_examples // a.procs)
        cjobs = [pool.apply_async(_clean_worker, (("tiny", per, 1000 + i, a.budget),)) for i in range(a.procs)]
        big = [pool.apply_async(_clean_worker, (("deepseek-v3", a.clean_big, 77, a.budget),))] if a.clean_big else []
        result["matrix"], result["clean"] = [], []
        for j in mjobs:  # each row as it lands: a run cut short still shows what it measured
            m = j.get()
            result["matrix"].append(m)
            print(f"row {m['mutant']}: caught={m['caught']} examples={m['examples_to_detect']} "
                  f"seconds={m['seconds_to_detect']} diagnosis={m['diagnosis']} steps={m['shrunk_steps']} "
                  f"emulated_agrees={m.get('emulated_agrees')}", flush=True)
        for j in cjobs + big:
            c = j.get()
            result["clean"].append(c)
            print(f"clean {c['spec']} seed {c['seed']}: {c['examples']} examples, failed={c['failed']}", flush=True)
    result["seconds"] = round(time.time() - t0, 1)
    bad = [m["mutant"] for m in result["matrix"] if not (m["caught"] and m["diagnosis_ok"])]
    flagged = [c for c in result["clean"] if c["failed"]]
    disagree = [m["mutant"] for m in result["matrix"] if m["caught"] and not m.get("emulated_agrees")]
    result["summary"] = {
        "mutants_caught": sum(m["caught"] for m in result["matrix"]), "mutants": len(result["matrix"]),
        "clean_examples_tiny": sum(c["examples"] for c in result["clean"] if c["spec"] == "tiny"),
        "clean_examples_deepseek": sum(c["examples"] for c in result["clean"] if c["spec"] != "tiny"),
        "clean_failures": len(flagged), "escaped_or_misdiagnosed": bad, "emulated_disagrees": disagree}
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"{'mutant':26} {'caught':6} {'examples':8} {'seconds':8} {'diagnosis':16} steps emu==cuda")
    for m in result["matrix"]:
        print(f"{m['mutant']:26} {str(m['caught']):6} {str(m['examples_to_detect']):8} "
              f"{str(m['seconds_to_detect']):8} {str(m['diagnosis']):16} {m['shrunk_steps']}     {m.get('emulated_agrees')}")
    print(json.dumps(result["summary"]))
    return 1 if (bad or flagged or disagree) else 0


if __name__ == "__main__":
    sys.exit(main())
