"""Diagnosis: turn an oracle failure into a bug class with evidence.

Classes: ``stale-address``, ``laziness``, ``contiguity``, ``padding-leak``,
``cache-corruption``, ``host-sync``, ``numerical``, ``backend-error``, ``contract``,
``custom-op``, ``capture-divergence``, ``out-of-bounds``, ``layer-state``, ``crash`` (a process
death, see ``crash_repro``).
The direct oracles (contiguity, integrity, host read in capture, backend error, output
contract, custom-op) name their class. Output mismatches, moved addresses and accesses out
of bounds (``bounds``: interpreted kernels only, ``memory_guard``) are explained
by *experiments*, each a deterministic re-run of the scenario with one thing changed:

0. (backends with ``build_for_capture``) capturing with ``build`` instead: if the failure
   disappears, the capture-time metadata path diverges from the replay path (SGLang's
   separate capture/replay builders) -> capture-divergence;

L. (scenarios of several layers per step) every layer run alone, on the same steps: if each
   passes, the layers of one step share state they must not (metadata a forward changed
   that the next layer or a re-run read, one output buffer handed to several layers, per-layer
   work such as a top-k selection done by the first layer and reused) -> layer-state;

1. poisoning off: if the failure disappears, NaN placed only in padding reached real
   rows -> padding-leak (also when only seq_len-0 rows are wrong: padding-shaped rows);
2. the capture's kernel list vs a fresh backend's eager forward of the same batch: a
   kernel (the planner) missing from the graph -> laziness (state planned before
   capture, vLLM #42444), whichever oracle fired (before 1b: a skipped planner leaves later
   eager steps of that backend wrong too);
1b. (reference, finite or bounds oracle) the failing step as an eager step: if it fails after the
   scenario's earlier steps (so no graph is needed) but passes alone on a fresh backend, the
   output depends on what earlier builds left in persistent buffers (e.g. an nnz-sized copy
   leaving the previous step's tail, vLLM #42604) -> stale-address;
S. (a replay failing replay-eager or reference) the replay run twice, then with every earlier
   step's inputs drawn from other seeds (lengths kept: same shapes and host decisions): if it
   reproduces and the new history changes its output, the graph reads leftovers of earlier
   steps -> stale-address (a frozen capture-time value does not depend on earlier data; this
   comes before 3, whose re-capture changes that history too);
3. capturing with the replayed batch itself: if the failure disappears while every
   metadata address is stable and every kernel is present, the graph froze host-side
   values computed from the capture-time batch -> laziness (host-decided plan); unless the
   replay-eager oracle fired and 1b's test holds (the step's eager forward alone is wrong
   after this history, right on a fresh backend): the re-capture also rewrote that history,
   so the stale contents are the cause -> stale-address; or unless E holds;
E. (a replay failing replay-eager; asked inside 3 and before 5) that oracle set aside and the
   eager forward that checks the replay given a build of its own: if the reference then blames
   that eager forward while the same batch alone on a fresh backend passes, the check read
   what the replay or an earlier step left in state kept across builds -> stale-address;
4. the failing step eager without padding rows: if it passes, padded rows influence
   real rows -> padding-leak (for an access out of bounds: padded rows send the kernel
   outside its tensors -> out-of-bounds);
R. (replay/eager divergence, or an eager forward run twice disagreeing with itself) the
   second forward (the eager check of the replay, the determinism oracle's re-run) given a
   build of its own instead of the first forward's: if the failure disappears, a forward
   changes what a second forward on its build reads -> layer-state;
5. otherwise a replay/eager divergence -> stale-address (a tensor read by the graph that
   the audit could not see), an eager/reference divergence -> numerical, an access out of
   bounds -> out-of-bounds.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

from .audit import OpLog
from .blame import defined_at
from .executor import ScenarioRunner, StepUnsupported, run_steps
from .oracles import OracleFailure, compare_bitwise
from .scenario import ScenarioConfig

CLASSES = ("stale-address", "laziness", "contiguity", "padding-leak", "cache-corruption", "host-sync",
           "numerical", "backend-error", "contract", "custom-op", "capture-divergence", "out-of-bounds", "layer-state",
           "crash")


@dataclass
class Diagnosis:
    cls: str
    explanation: str
    oracle: str

    def to_dict(self) -> dict:
        return asdict(self)


def _signature(f: OracleFailure | None) -> tuple | None:
    return None if f is None else (f.oracle, f.step)


def diagnose(backend_cls, cfg: ScenarioConfig, steps: list[dict], failure: OracleFailure,
             graph_mode: str, device=None) -> Diagnosis:
    """Classify ``failure`` (raised at ``steps[failure.step]``) by the experiments above."""
    o = failure.oracle
    direct = {"contiguity": "contiguity", "integrity": "cache-corruption", "host-sync": "host-sync",
              "backend-error": "backend-error", "contract": "contract", "custom-op": "custom-op"}
    if o in direct:
        return Diagnosis(direct[o], _direct_text(o, failure, steps), o)

    rerun = lambda s: run_steps(backend_cls, cfg, s, graph_mode, device)  # noqa: E731
    k = failure.step
    upto = steps[: k + 1]
    failing = steps[k]

    # 0. the capture-time build path against the replay path
    if (graph_mode != "eager" and callable(getattr(backend_cls, "build_for_capture", None))
            and any(s["op"] == "capture" for s in upto)
            and run_steps(backend_cls, cfg, upto, graph_mode, device, capture_build=False) is None):
        return Diagnosis("capture-divergence", "with the capture built by build() (the replay path) the failure "
                         "vanishes: the metadata build_for_capture() makes for the captured graph disagrees with what "
                         "build() writes at replay (other buffers, other values or sizes; SGLang's separate capture "
                         "and replay metadata paths). " + failure.message, o)
    if o == "address":
        return Diagnosis("stale-address", _direct_text(o, failure, steps), o)

    # L. state shared across the layers of one step: each layer alone passes
    if cfg.layers > 1 and all(run_steps(backend_cls, cfg, upto, graph_mode, device, layers=(i,)) is None
                              for i in range(cfg.layers)):
        return Diagnosis("layer-state", _layer_text(failure, cfg, k), o)

    # 1. poisoning off
    if any(s.get("poison") for s in upto):
        clean = [dict(s, poison=False) for s in upto]
        if rerun(clean) is None:
            return Diagnosis("padding-leak", f"step {k} fails only when padding (padded q/hidden rows, the null "
                             "block, unused pages) is filled with NaN; with the same steps unpoisoned it passes: "
                             "values that belong to padding reach real rows. " + failure.message, o)

    # 2. a kernel missing from the graph names laziness whichever oracle fired: a planner the
    # capture skipped also leaves eager steps of the same backend wrong, which 1b would blame on
    # a stale buffer
    cap_idx = _capture_for(upto, failing)
    if cap_idx is not None and graph_mode != "eager":
        missing = _missing_kernels(backend_cls, cfg, upto[: cap_idx + 1], graph_mode, device)
        if missing:
            return Diagnosis("laziness", f"the graph captured at step {cap_idx} lacks kernel(s) {missing} that an "
                             "eager forward of the same batch on a fresh backend launches: state planned before "
                             "capture (warmup or an earlier step) made the capture skip the planner, so every "
                             "replay reuses that stale plan. " + failure.message, o)

    # 1b. state left by earlier builds: the step's *eager* output is wrong after this history
    # (for a replay: re-run it as an eager step, so the graph is out of the picture) but
    # right on a fresh backend with no history
    if o in ("reference", "finite", "bounds") and _eager_depends_on_history(rerun, upto, k):
        return Diagnosis("stale-address", _stale_contents_text(backend_cls, k, o) + failure.message, o)

    # S. the replay's own output follows the data of earlier steps: re-drawn from other seeds
    # (same lengths, so the same shapes and host decisions), they change it
    if (o in ("replay-eager", "reference") and cap_idx is not None and graph_mode != "eager"
            and _replay_reads_earlier_data(backend_cls, cfg, upto, graph_mode, device)):
        return Diagnosis("stale-address", f"step {k}'s replay gives another output when the steps before it draw "
                         "their inputs from other seeds (same lengths: the same shapes, split counts and other "
                         "host decisions): the captured graph reads data an earlier step computed that this step "
                         "did not rewrite (a workspace slot, a partial result, a tail of a buffer) — stale contents "
                         f"at a stable address. Capturing graph {failing['size']} with the replayed batch may hide "
                         f"it, by changing that history. {_leftovers_hint(backend_cls)}" + failure.message, o)

    # E. the eager forward that checks a replay is the wrong side: with the replay-eager
    # comparison set aside, that forward fails the reference even on a build of its own, while
    # the same batch run alone on a fresh backend passes: it read what the replay (or an earlier
    # step) left in state kept across builds. Asked inside 3 (a re-capture also rewrites that
    # state) and before the last resort.
    def eager_check_reads_leftovers() -> Diagnosis | None:
        if not (o == "replay-eager" and failing["op"] == "replay" and cap_idx is not None and graph_mode != "eager"
                and _eager_check_reads_leftovers(backend_cls, cfg, upto, graph_mode, device, rerun)):
            return None
        return Diagnosis("stale-address", f"the eager forward that checks the replay at step {k} disagrees with "
                         "the reference model, even on a build of its own, while the same batch run alone on a "
                         "fresh backend passes: that forward reads what the replay, or an earlier step, left in "
                         "memory the backend keeps across builds (a workspace slot, partial results of another "
                         "split layout, the tail of a buffer) — stale contents at a stable address, which a replay "
                         "can read just as well. Capturing the graph with the replayed batch may hide it by "
                         f"changing what was left. {_leftovers_hint(backend_cls)}" + failure.message, o)

    # 3. concerns a replay of a captured graph
    if cap_idx is not None and graph_mode != "eager":
        swapped = copy.deepcopy(upto)
        swapped[cap_idx]["batch"] = copy.deepcopy(failing["batch"])
        if rerun(swapped) is None:
            # the re-capture also changed what the earlier steps left in persistent buffers: when the
            # step's eager forward, no graph involved, is wrong after the original history and right
            # alone, that history is the cause and the frozen capture-time values are not
            if o == "replay-eager" and _eager_depends_on_history(rerun, upto, k):
                return Diagnosis("stale-address", "the replay disagrees with the eager forward, and "
                                 + _stale_contents_text(backend_cls, k) + f"(Capturing graph {failing['size']} "
                                 "with the replayed batch makes the failure vanish only because it rewrites that "
                                 "history.) " + failure.message, o)
            leftovers = eager_check_reads_leftovers()
            if leftovers is not None:
                return leftovers
            return Diagnosis("laziness", f"capturing graph {failing['size']} with the replayed batch itself makes "
                             "the failure vanish, while every metadata tensor keeps its address and no kernel is "
                             "missing from the graph: values decided on the host from the capture-time batch "
                             "(split counts, launch parameters, Python scalars) are frozen into the graph. "
                             + failure.message, o)

    # 4. padding rows influencing real rows
    if failing["op"] in ("replay", "eager") and len(failing["batch"]["seq_lens"]) < (
            failing.get("size") or failing.get("pad_to") or 0):
        unpadded = copy.deepcopy(upto)
        unpadded[k] = {"op": "eager", "batch": failing["batch"], "pad_to": None, "poison": False}
        passes_unpadded = rerun(unpadded) is None
        if passes_unpadded and o == "bounds":
            return Diagnosis("out-of-bounds", f"step {k} reads or writes outside the kernel's tensors with its batch "
                             f"padded to {failing.get('size') or failing.get('pad_to')} rows, and not without the "
                             "padding rows: what the builder writes for padded rows (their seq_len, their block-table "
                             "row) sends the kernel outside the cache. " + failure.message, o)
        if passes_unpadded:
            return Diagnosis("padding-leak", f"step {k} fails with its batch padded to "
                             f"{failing.get('size') or failing.get('pad_to')} rows but passes run eagerly without "
                             "padding rows: padded rows influence real rows (e.g. an uninitialised padded output "
                             "entering a batch-wide reduction). " + failure.message, o)

    # R. the eager forward that checks a replay runs on the replay's own build, after it: when
    # that forward agrees with the replay on a build of its own, the replay's forward changed
    # what a second forward on the same build reads
    if o in ("replay-eager", "determinism"):
        rewritten = _rewritten_by_forward(backend_cls, cfg, upto, graph_mode, device)
        if rewritten is not None:
            first = "the replay" if o == "replay-eager" else "the first forward"
            fields = (f"After {first}, metadata field(s) {', '.join(rewritten)} no longer hold what build() "
                      "writes for this batch: the forward changed them. " if rewritten else "")
            what = (f"the eager forward that checks step {k}'s replay ran on the replay's own build and disagrees "
                    "with it" if o == "replay-eager" else
                    f"step {k}'s eager forward, run a second time on the same build, disagrees with the first run")
            return Diagnosis("layer-state", f"{what}; on a build of its own the same eager forward agrees: "
                             "the forward changes metadata (or state) that a second forward on the same build "
                             "reads, as every later attention layer of an engine's step does, and warmups sharing a "
                             "build (a length rewritten in place, two metadata fields sharing memory). " + fields
                             + f"Keep what a forward computes in scratch of its own (the forward: "
                             f"{_forward_site(backend_cls)}). "
                             + failure.message, o)
    if o == "replay-eager":
        leftovers = eager_check_reads_leftovers()
        if leftovers is not None:
            return leftovers
        return Diagnosis("stale-address", "replay diverges from an eager forward of the same batch although the "
                         "metadata audit saw stable addresses: the graph reads a tensor the audit cannot see "
                         "(allocated outside the metadata object) that was replaced after capture. "
                         + failure.message, o)
    if o == "bounds":
        return Diagnosis("out-of-bounds", "a kernel reads or writes outside the tensors it was given, in a forward "
                         "with no graph, padding or history to blame (its index arithmetic or a mask is wrong for "
                         "this batch). " + failure.message, o)
    zero = {i for i, s in enumerate(failing["batch"]["seq_lens"]) if s == 0}
    rows = set(failure.evidence.get("rows") or [])
    if rows and rows <= zero:
        return Diagnosis("padding-leak", f"only rows with seq_len 0 are wrong (rows {sorted(rows)}): the contract "
                         "says such rows — the shape every padded row has — give out exactly 0 and lse -inf, "
                         "never NaN or leftover memory, or they poison batch-wide reductions (vLLM #37442, "
                         "#38148). " + failure.message, o)
    return Diagnosis("numerical", "the backend's eager output disagrees with the reference beyond the dtype "
                     "tolerance, with no graph or padding involved. " + failure.message, o)


def _rewritten_by_forward(backend_cls, cfg, steps: list[dict], graph_mode: str, device) -> list[str] | None:
    """Experiment R: run ``steps`` with the second forward (a replay's eager check, the
    determinism oracle's re-run) on a build of its own. None when it still fails; else the
    metadata fields the first forward left different from a new build of the same batch
    (``ScenarioRunner.rewritten``; may be empty)."""
    runner = None
    try:
        runner = ScenarioRunner(backend_cls, cfg, graph_mode, device, eager_own_build=True)
        for s in steps:
            runner.apply(s)
        return list(runner.rewritten)
    except OracleFailure:
        return None
    except StepUnsupported:
        return None
    finally:
        if runner is not None:
            runner.close()


def _eager_check_reads_leftovers(backend_cls, cfg, upto: list[dict], graph_mode: str, device, rerun) -> bool:
    """Experiment E: with the replay-eager oracle set aside and the checking eager forward on a
    build of its own, the failing replay step (``upto[-1]``) fails the reference on that eager
    forward, not on the replay; and the batch run eagerly alone on a fresh backend passes."""
    runner = None
    try:
        runner = ScenarioRunner(backend_cls, cfg, graph_mode, device, eager_own_build=True,
                                skip_oracles=("replay-eager",))
        for i, s in enumerate(upto):
            try:
                runner.apply(s)
            except OracleFailure as f:
                if i < len(upto) - 1:
                    return False
                blamed_eager = f.oracle in ("reference", "finite") and (f.evidence or {}).get("checked") == "eager"
                break
        else:
            return False
    except StepUnsupported:
        return False
    finally:
        if runner is not None:
            runner.close()
    if not blamed_eager:
        return False
    failing = upto[-1]
    alone = {"op": "eager", "batch": failing["batch"], "pad_to": failing.get("size"),
             "poison": bool(failing.get("poison"))}
    return rerun([alone]) is None


def _eager_depends_on_history(rerun, upto: list[dict], k: int) -> bool:
    """Experiment 1b: step ``k`` run as an eager step (a replay re-run without its graph) fails
    after ``upto[:k]`` but passes alone on a fresh backend."""
    failing = upto[k]
    if k == 0:
        return False
    as_eager = {"op": "eager", "batch": failing["batch"], "pad_to": failing.get("size") or failing.get("pad_to"),
                "poison": bool(failing.get("poison"))}
    eager_wrong = failing["op"] == "eager" or rerun(upto[:k] + [as_eager]) is not None
    return eager_wrong and rerun([as_eager]) is None


#: added to an earlier step's batch seed by experiment S (any change of its data will do)
_OTHER_DATA = 1_000_003


def _replay_outputs(backend_cls, cfg, steps: list[dict], graph_mode: str, device) -> list | None:
    """The last step's replay outputs (before its oracles), or None when an earlier step fails
    or declines, or the last step fails before its graph runs."""
    runner = ScenarioRunner(backend_cls, cfg, graph_mode, device)
    try:
        for i, s in enumerate(steps):
            try:
                runner.apply(s)
            except OracleFailure:
                if i < len(steps) - 1:
                    return None
        return runner.last_replay
    except StepUnsupported:
        return None
    finally:
        runner.close()


def _replay_reads_earlier_data(backend_cls, cfg, upto: list[dict], graph_mode: str, device) -> bool:
    """Experiment S: the failing replay (``upto[-1]``) reproduces bit for bit, and gives another
    output for its real rows when every earlier step's batch is drawn from another seed (its
    lengths kept). A decode of one batch depends on that batch alone; a replay that follows what
    earlier steps computed reads their leftovers."""
    first = _replay_outputs(backend_cls, cfg, upto, graph_mode, device)
    again = _replay_outputs(backend_cls, cfg, upto, graph_mode, device)
    if first is None or again is None or len(first) != len(again):
        return False
    rows = len(upto[-1]["batch"]["seq_lens"])
    if any(compare_bitwise(b[:rows], a[:rows]) is not None for a, b in zip(first, again)):
        return False  # not reproducible: another run differs anyway, so the experiment says nothing
    other = copy.deepcopy(upto)
    for s in other[:-1]:
        if "batch" in s:
            s["batch"]["seed"] = int(s["batch"]["seed"]) + _OTHER_DATA
    varied = _replay_outputs(backend_cls, cfg, other, graph_mode, device)
    if varied is None or len(varied) != len(first):
        return False
    return any(compare_bitwise(b[:rows], a[:rows]) is not None for a, b in zip(first, varied))


def _forward_site(backend_cls) -> str:
    return defined_at(backend_cls.forward) or backend_cls.__name__ + ".forward"


def _leftovers_hint(backend_cls) -> str:
    return ("Find the buffer it keeps across steps (a workspace, a metadata tail) whose unwritten part the "
            "kernels still read, and rewrite or mask that part every step (the forward: "
            f"{_forward_site(backend_cls)}). ")


def _stale_contents_text(backend_cls, k: int, oracle: str | None = None) -> str:
    which = f" ({oracle} oracle)" if oracle else ""
    return (f"step {k}'s eager output is wrong{which} after the earlier steps, but the same batch run alone on a "
            "fresh backend passes: the kernels read data an earlier step left in a persistent buffer that this "
            "step's build did not rewrite (a stale tail of an nnz-sized copy, vLLM #42604) — stale contents at a "
            "stable address. " + _leftovers_hint(backend_cls))


def _capture_for(steps: list[dict], failing: dict) -> int | None:
    if failing["op"] != "replay":
        return None
    for i in range(len(steps) - 2, -1, -1):
        if steps[i]["op"] == "capture" and steps[i]["size"] == failing["size"]:
            return i
    return None


def _missing_kernels(backend_cls, cfg, steps_to_capture: list[dict], graph_mode: str, device) -> list[str]:
    """Kernels a fresh eager forward of the capture batch runs that the capture did not record."""
    runner = ScenarioRunner(backend_cls, cfg, graph_mode, device)
    try:
        for s in steps_to_capture:
            runner.apply(s)
        cap = runner.captures[steps_to_capture[-1]["size"]]
        captured = list(cap.log.custom_ops)
    except OracleFailure:
        return []
    finally:
        runner.close()
    fresh = ScenarioRunner(backend_cls, cfg, "eager", device)
    try:
        cstep = steps_to_capture[-1]
        batch = fresh.world.make_batch(cstep["batch"], cstep["size"])
        meta = fresh.backend.build(batch)
        q, hidden, positions = fresh._inputs(cstep["size"], batch, cstep["batch"], False)
        log = OpLog()
        fresh._audited(lambda: fresh._forward(q, hidden, positions, meta), log)
    except Exception:
        return []
    finally:
        fresh.close()
    return sorted(set(log.custom_ops) - set(captured))


def _layer_text(f: OracleFailure, cfg: ScenarioConfig, k: int) -> str:
    ev = f.evidence or {}
    which = f"layer {ev['layer'] + 1} of {cfg.layers}" if ev.get("layer") is not None else "a layer"
    text = (f"step {k} fails with its {cfg.layers} attention layers run on one build ({which} is wrong), but each "
            "layer run alone on the same steps passes: the layers of one step share state they must not — metadata "
            "a forward changed that the next layer (or a re-run) read, one output buffer handed to several layers, "
            "or per-layer work (a plan, a top-k selection) done by the first layer and reused by the rest.")
    shared = ev.get("shared_outputs")
    if shared:
        pairs = ", ".join(f"{i + 1} and {j + 1}" for i, j in shared)
        text += f" The outputs forward returned to layers {pairs} share memory: one buffer for several layers."
    return text + " " + f.message


def _direct_text(oracle: str, f: OracleFailure, steps: list[dict]) -> str:
    op = steps[f.step]["op"] if f.step is not None and f.step < len(steps) else "?"
    lead = {
        "backend-error": f"the backend raised during step {f.step} ({op}); the first error and where it was raised: ",
        "contract": "forward's return value breaks the output contract (shape, dtype or device of out or lse; "
                    "capabilities declare the lse convention): ",
        "custom-op": "the backend launches a Triton kernel directly, which the graph emulator cannot record: ",
        "address": "the address audit saw a tensor that the captured graph reads (a metadata field, or a tensor the "
                   "backend object holds) replaced by a later build (fresh tensors instead of copies into "
                   "persistent buffers, vLLM #35175): ",
        "contiguity": "a kernel was handed a non-contiguous view it may index flat (vLLM #42135: a "
                      "[:B, :max_decode_len] slice of a 2-D buffer is non-contiguous when max_decode_len < next_n): ",
        "integrity": "KV-cache slots that no real token of this step writes changed (a padded row's slot_mapping "
                     "was not -1, or a write ignored it): ",
        "host-sync": "the forward reads device values on the host while a graph is captured (.item(), .tolist(), "
                     ".cpu(), nonzero), which CUDA forbids and which would freeze a host decision into the graph: ",
    }[oracle]
    return lead + f.message
