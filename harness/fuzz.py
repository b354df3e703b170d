"""One fuzz run against one backend: search, shrink, diagnose, build the repro.

Used by the pytest suite (mutation matrix, clean backend), the ``mla-fuzz`` command and
the pytest plugin. A budget in seconds is honoured between scenarios; a budget in
examples is Hypothesis' ``max_examples``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hypothesis.errors import HypothesisException, Unsatisfiable

from mla_fuzz.mla_ref import ModelSpec

from .diagnosis import diagnose
from .graphs import default_device, make_runner
from .loading import effective_capabilities, load_backend
from .machine import BudgetExhausted, Campaign, search
from .repro import make_repro


@dataclass
class FuzzReport:
    backend: str
    graph_mode: str
    seed: int
    examples: int
    steps: int
    seconds: float
    examples_to_detect: int | None = None
    seconds_to_detect: float | None = None
    repro: dict | None = None
    coverage: dict = field(default_factory=dict)
    shrink_runs: int = 0  # scenarios re-run while shrinking (not counted in ``examples``)
    shrink_seconds: float = 0.0    # from the first sight of the failure to the end of the search
    diagnose_seconds: float = 0.0  # the diagnosis re-runs of the failure found
    # reason -> scenarios the backend declined (``mla_ref.Unsupported`` / NotImplementedError)
    unsupported: dict = field(default_factory=dict)
    # failure key -> times a failure this campaign already reported was seen again
    known: dict = field(default_factory=dict)
    capabilities: dict = field(default_factory=dict)  # what was drawn (``Capabilities.to_dict``)

    @property
    def failed(self) -> bool:
        return self.repro is not None

    @property
    def diagnosis(self) -> str | None:
        return None if self.repro is None else (self.repro.get("diagnosis") or {}).get("cls")


def resolve_mode(graph_mode: str) -> str:
    return make_runner(graph_mode).mode


#: The longest sequence drawn by default, by (spec size, device): long enough on a GPU for
#: engines' split paths (2 splits from 1k tokens) and FlashMLA-style planners, short on CPU
#: where the interpreter pays for every key.
DEFAULT_MAX_SEQ_LEN = {("tiny", "cpu"): 512, ("deepseek-v3", "cpu"): 256,
                       ("tiny", "cuda"): 4096, ("deepseek-v3", "cuda"): 32768}


def default_max_seq_len(spec: ModelSpec | str, device) -> int:
    """``DEFAULT_MAX_SEQ_LEN`` for ``spec`` (a spec of more than 16 heads counts as DeepSeek-V3
    size) on ``device`` (a ``torch.device`` or its name; anything but CUDA counts as CPU)."""
    spec = ModelSpec.from_name(spec) if isinstance(spec, str) else spec
    size = "deepseek-v3" if spec.num_heads > 16 else "tiny"
    return DEFAULT_MAX_SEQ_LEN[(size, "cuda" if str(device).startswith("cuda") else "cpu")]


class BackendSetupError(ValueError):
    """The backend cannot be built for the simplest scenario: nothing can be fuzzed (one line,
    naming the constructor's error and its file:line)."""


_BUILT: set = set()


def check_backend_builds(backend_cls, spec: ModelSpec, mode: str, device, caps, page_sizes) -> None:
    """Construct ``backend_cls`` once for the simplest scenario inside its capabilities (the
    first KV and query dtype it takes, the smallest page size and next_n, capture sizes
    1, 2, 4); ``BackendSetupError`` when the constructor raises. Every scenario builds a
    backend first, so a constructor that fails there would otherwise turn the whole budget
    into one repeated finding. Once per process and setting."""
    from .executor import ScenarioRunner, StepUnsupported
    from .oracles import OracleFailure
    from .scenario import ScenarioConfig

    sizes = [p for p in page_sizes if caps.page_sizes is None or p in caps.page_sizes] or list(caps.page_sizes or (16,))
    cfg = ScenarioConfig(spec=spec.to_dict(), kv_dtype=caps.kv_dtypes[0], q_dtype=caps.q_dtypes[0],
                         page_size=min(sizes), next_n=min(caps.next_n))
    key = (backend_cls, repr(spec), mode, str(device), repr(cfg))
    if key in _BUILT:
        return
    try:
        ScenarioRunner(backend_cls, cfg, mode, device).close()
    except StepUnsupported:
        pass  # declined this configuration: the search draws others and counts it
    except OracleFailure as f:
        name = getattr(backend_cls, "__qualname__", str(backend_cls))
        raise BackendSetupError(
            f"backend {name} cannot be built: its constructor raised {f.message} for the simplest scenario "
            f"(kv {cfg.kv_dtype}, q {cfg.q_dtype}, page size {cfg.page_size}, next_n {cfg.next_n}, capture "
            f"sizes {cfg.capture_sizes}, device {device}); see docs/backends.md#constructor") from None
    _BUILT.add(key)


def fuzz(backend_ref: str, *, spec: ModelSpec | str = "tiny", graph_mode: str = "auto", examples: int = 100,
         seed: int = 0, budget_s: float | None = None, device: str | None = None, shrink: bool = True,
         step_count: int = 6, max_seq_len: int | None = None, strict_contiguity: bool = False,
         on_step=None, shrink_seconds: float | None = None, should_stop=None, on_phase=None,
         narrow: dict | None = None, known=(), on_found=None, on_declined=None) -> FuzzReport:
    """Search ``backend_ref`` for up to ``examples`` scenarios (or ``budget_s`` seconds).

    Returns a ``FuzzReport``; when a failure is found its minimal repro (with diagnosis)
    is in ``report.repro``. Scenarios are drawn inside the backend's capabilities, narrowed
    by ``narrow`` (``Capabilities.narrow`` keywords); failures whose key is in ``known``
    (``oracles.failure_key``: already reported) do not end the search. Sequences are drawn up
    to ``max_seq_len`` tokens (default ``default_max_seq_len``). Hooks:
    ``on_step(cfg, steps)`` before each step (and with no steps before each scenario's
    backend is built), ``should_stop()`` polled between scenarios, ``on_phase(name, info)``
    before the diagnosis re-runs (``"diagnose"``), ``on_found(repro, info)`` the moment the
    first failure is seen, before shrinking: ``repro`` is its unshrunk, undiagnosed repro
    (``search.unshrunk`` true; it replays to the same failure) and ``info`` has
    ``examples_to_detect`` and ``seconds_to_detect`` (from this call's start);
    ``on_declined(cfg)`` when the backend declined a step of the scenario ``on_step`` announced
    (it is not one of the searched examples).
    """
    spec = ModelSpec.from_name(spec) if isinstance(spec, str) else spec
    backend_cls = load_backend(backend_ref)
    mode = resolve_mode(graph_mode)
    device = device or default_device(mode)
    caps, _notes = effective_capabilities(backend_cls, narrow, cpu=str(device).startswith("cpu"))
    big = spec.num_heads > 16
    check_backend_builds(backend_cls, spec, mode, device, caps, (64,) if big else (4, 16, 64))
    camp = Campaign(backend_cls, spec, mode, device,
                    max_seq_len=max_seq_len or default_max_seq_len(spec, device),
                    page_sizes=(64,) if big else (4, 16, 64), vary_heads=not big,
                    strict_contiguity=strict_contiguity, on_step=on_step,
                    should_stop=should_stop, caps=caps, known=frozenset(known or ()), on_declined=on_declined)
    t0 = time.monotonic()
    if budget_s is not None:
        camp.deadline = t0 + budget_s
    if on_found is not None:
        def first_sight(ff) -> None:
            first = camp.stats.get("first_failure", {})
            info = {"examples_to_detect": first.get("examples"),
                    "seconds_to_detect": first.get("time", time.monotonic()) - t0}
            search_info = {"seed": seed, "examples": camp.stats["examples"], "max_seq_len": camp.max_seq_len,
                           "examples_to_detect": info["examples_to_detect"], "unshrunk": True}
            on_found(make_repro(backend_ref, mode, ff.cfg, ff.steps, ff.failure, None, search_info), info)
        camp.on_found = first_sight
    flaky = None
    try:
        found = search(camp, max_examples=examples, seed=seed, step_count=step_count, shrink=shrink,
                       shrink_seconds=shrink_seconds)
    except BudgetExhausted:
        found = None
    except HypothesisException as exc:
        # Ending the search from inside a scenario (budget, stop, or the shrink's time bound)
        # can surface as Hypothesis' "inconsistent data generation" when it lands on a replayed
        # prefix. With no failure pending that is a normal end. With one pending and the
        # shrink's time spent, the shrink was cut: the smallest failure so far is reported, as
        # when ShrinkTimeUp arrives plainly. Otherwise the failure did not reproduce while
        # being shrunk (Hypothesis' Flaky family): it is reported as found, unshrunk and marked
        # flaky, never dropped. Anything else is a real error.
        stopped = (camp.deadline is not None and time.monotonic() > camp.deadline) or (
            should_stop is not None and should_stop())
        first = camp.stats.get("first_failure")
        shrink_cut = (first is not None and camp.shrink_seconds is not None
                      and time.monotonic() > first["time"] + camp.shrink_seconds)
        if shrink_cut and camp.latest_failure is not None:
            found = camp.latest_failure
        elif camp.first_failure is not None:
            found = camp.first_failure
            flaky = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        elif stopped or isinstance(exc, Unsatisfiable):
            # Unsatisfiable: every scenario was declined or already known; the counts say so
            found = None
        else:
            raise
    t_end = time.monotonic()
    report = FuzzReport(backend_ref, mode, seed, camp.stats["examples"], camp.stats["steps"],
                        t_end - t0, coverage=camp.stats["coverage"],
                        shrink_runs=camp.stats.get("shrink_runs", 0), unsupported=camp.stats["unsupported"],
                        known=camp.stats["known"], capabilities=caps.to_dict())
    if found is not None:
        first = camp.stats.get("first_failure", {})
        report.examples_to_detect = first.get("examples")
        report.seconds_to_detect = None if "time" not in first else first["time"] - t0
        report.shrink_seconds = 0.0 if "time" not in first else t_end - first["time"]
        if on_phase is not None:
            on_phase("diagnose", {"cfg": found.cfg, "steps": found.steps, "failure": found.failure})
        diag = diagnose(backend_cls, found.cfg, found.steps, found.failure, mode, device)
        report.diagnose_seconds = time.monotonic() - t_end
        search_info = {"seed": seed, "examples": camp.stats["examples"], "max_seq_len": camp.max_seq_len,
                       "examples_to_detect": report.examples_to_detect}
        if camp.first_failure is not None:
            search_info["unshrunk_steps"] = len(camp.first_failure.steps)
        if flaky is not None:
            # not shrunk: Hypothesis could not make it fail again (the steps are as found)
            search_info["flaky"] = flaky
        report.repro = make_repro(backend_ref, mode, found.cfg, found.steps, found.failure, diag, search_info)
    return report
