"""The search: a Hypothesis ``RuleBasedStateMachine`` over eager/warmup/capture/replay.

Each rule draws one step, appends it to the scenario's trace and runs it through
``ScenarioRunner``; the oracles are checked inside the step. On a failure Hypothesis
shrinks the rule sequence (and every drawn value) to a minimal program, and the
``FuzzFailure`` raised by the final, minimal run carries that program as JSON steps.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, Verbosity, reject, seed as hypothesis_seed, settings, target
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from mla_fuzz.mla_ref import Capabilities, ModelSpec

from .blame import CudaContextLost, first_line, is_cuda_error
from .book import BOOK, BOOK_EXAMPLES, BOOK_EXTRA_STEPS, Opening
from .executor import ScenarioRunner, StepUnsupported, raise_if_environment_oom
from .loading import supports_layer, supports_sparse
from .oracles import OracleFailure, failure_key, take_closeness
from .scenario import ScenarioConfig, add_note, scenario_coverage, spec_family, step_coverage, withdraw_notes
from .settle import settle
from .strategies import batch_draws, configs, paths_allowed, short_bound


class FuzzFailure(Exception):
    """An oracle failure together with the scenario that produced it."""

    def __init__(self, failure: OracleFailure, cfg: ScenarioConfig, steps: list[dict]):
        super().__init__(str(failure))
        self.failure = failure
        self.cfg = cfg
        self.steps = steps


@dataclass
class Campaign:
    """What one search needs; ``stats`` is filled as it runs."""

    backend_cls: type
    spec: ModelSpec
    graph_mode: str = "auto"
    device: str | None = None
    # the longest sequence drawn (``harness.strategies.configs``)
    max_seq_len: int = 512
    page_sizes: tuple = (4, 16, 64)
    vary_heads: bool = True
    strict_contiguity: bool = False
    # what the backend declares (narrowed by the user): scenarios are drawn inside it
    caps: Capabilities = field(default_factory=Capabilities)
    # failure keys (``oracles.failure_key``) already reported by this campaign: seeing one
    # again does not end the search, so a frequent failure cannot hide a rare one
    known: frozenset = frozenset()
    stats: dict = field(default_factory=lambda: {"examples": 0, "steps": 0, "coverage": {}, "unsupported": {},
                                                 "known": {}})
    # The first failure as found (unshrunk): what is left to report when shrinking cannot
    # reproduce it (a flaky failure) and Hypothesis gives up on the search.
    first_failure: FuzzFailure | None = None
    # The latest failure with the first one's key: while shrinking, each is smaller than the
    # one before (Hypothesis keeps a candidate only when it is), so it is the best so far.
    latest_failure: FuzzFailure | None = None
    deadline: float | None = None
    # path -> the config of the simplest scenario of that path that a search block ran
    # (Hypothesis starts every block with it; later blocks skip it)
    zero_configs: dict = field(default_factory=dict)
    block_zero: dict | None = None  # the first config the current block ran
    # Seconds shrinking may take after the first failure (None: Hypothesis' own bound).
    shrink_seconds: float | None = None
    # Called with (config, steps so far) right before each step runs, so a supervising
    # process can turn a step that kills this process into a repro (crash isolation).
    on_step: object = None
    # Polled before each scenario: a true result ends the search like the deadline does.
    should_stop: object = None
    # Called once with the first ``FuzzFailure`` the moment it is seen (unshrunk), before
    # shrinking starts, so a supervisor can report it at once; an error in it is ignored.
    on_found: object = None
    # Called with the config of a scenario the backend declined (not shrinking): the example
    # announced by ``on_step(cfg, [])`` does not count (its scenario coverage is taken back).
    on_declined: object = None

    def note(self, key: str, value, amount: int = 1) -> None:
        add_note(self.stats["coverage"], key, str(value), amount)

    def count(self, table: str, key: str) -> None:
        t = self.stats.setdefault(table, {})
        t[key] = t.get(key, 0) + 1


class BudgetExhausted(BaseException):
    """Raised inside a rule when the campaign's wall-clock budget is spent (BaseException so
    Hypothesis does not treat it as a failure to shrink)."""


class ShrinkTimeUp(BaseException):
    """Raised between scenarios when shrinking has had its ``shrink_seconds``; the search
    returns the smallest failure seen so far."""


def _lost_context(exc: BaseException, step: int) -> None:
    """Raise ``CudaContextLost`` when ``exc`` (or what it wraps) is a CUDA error: kernels run
    asynchronously, so an illegal access can surface in a later step's harness code (a cache
    allocation, a comparison); nothing run in this process after it means anything."""
    from .blame import chain
    links = chain(exc)
    if is_cuda_error(" | ".join(str(e) for e in links)):
        raise CudaContextLost(f"step {step}: {first_line(links[-1])}") from None


def _path_flags(c: Campaign) -> tuple[bool, bool]:
    return (supports_layer(c.backend_cls) and c.caps.layer, supports_sparse(c.backend_cls) and c.caps.sparse)


def campaign_paths(c: Campaign) -> tuple:
    """The data paths (``strategies.PATHS``) the campaign's backend takes."""
    return paths_allowed(*_path_flags(c))


def make_machine(c: Campaign, path: str | None = None, opening: Opening | None = None):
    """A state-machine class bound to one campaign: scenarios on data ``path`` (None: drawn),
    starting with ``opening``'s program (``harness.book``) when given."""
    layer_ok, sparse_ok = _path_flags(c)
    config_strategy = configs(c.spec, layer_ok=layer_ok, vary_heads=c.vary_heads, max_seq_len=c.max_seq_len,
                              page_sizes=c.page_sizes, sparse_ok=sparse_ok, caps=c.caps, path=path,
                              book=opening is not None)
    # the simplest scenario of this path as run by an earlier block: not run again
    skip_config = None if opening is not None else c.zero_configs.get(path)

    class DecodeMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.runner = None
            self.steps: list[dict] = []
            self.captured: set[int] = set()
            self._batch_strategies: dict = {}
            self.shrinking = False
            self.closeness = 0.0

        def _batches(self, rows: int, short: bool = False, long: bool = False, mdl: int | None = None,
                     exact: bool = False):
            # one strategy object per row bound and scenario: Hypothesis re-validates a
            # fresh strategy object on every draw
            key = (rows, short, long, mdl, exact)
            if key not in self._batch_strategies:
                self._batch_strategies[key] = batch_draws(
                    self.cfg, rows, min_rows=rows if exact else 1, caps=c.caps,
                    top=short_bound(self.cfg) if short else None, long=long,
                    max_decode_len=None if mdl is None else min(mdl, self.cfg.next_n))
            return self._batch_strategies[key]

        def _book_batches(self, rows: int, short: bool = False, long: bool = False, mdl: int | None = None):
            return self._batches(rows, short, long, mdl, exact=True)

        @initialize(data=st.data())
        def setup(self, data):
            # Out of budget (or asked to stop): end the search between scenarios — unless a
            # failure is being shrunk, which shrink_seconds bounds; stopping then would
            # make Hypothesis drop the failure as flaky.
            pending = "first_failure" in c.stats
            if (pending and c.shrink_seconds is not None
                    and time.monotonic() > c.stats["first_failure"]["time"] + c.shrink_seconds):
                raise ShrinkTimeUp()
            if not pending and ((c.deadline is not None and time.monotonic() > c.deadline)
                                or (c.should_stop is not None and c.should_stop())):
                raise BudgetExhausted()
            self.cfg = cfg = data.draw(config_strategy, label="config")
            if skip_config is not None and cfg.to_dict() == skip_config:
                reject()
            if c.block_zero is None and not pending:
                c.block_zero = cfg.to_dict()
            self.split_seen = False
            key = "shrink_runs" if pending else "examples"
            c.stats[key] = c.stats.get(key, 0) + 1
            self.shrinking = pending
            if c.on_step is not None:
                c.on_step(cfg, [], shrinking=pending)  # a crash while building the backend belongs to this config
            if not pending:  # coverage counts searched examples, not shrink re-runs
                for key, value in scenario_coverage(cfg):
                    c.note(key, value)
            if opening is not None:
                for step in opening.program(data.draw, cfg, self._book_batches):
                    self._run(step)
                    if step["op"] == "capture":
                        self.captured.add(step["size"])
                return
            # Every scenario starts with a capture: the bugs we hunt need capture -> replay,
            # and a rule that merely *may* capture wastes most examples on eager-only runs.
            self._capture(data)

        def _run(self, step: dict) -> None:
            self.steps.append(step)
            if not self.shrinking:
                c.stats["steps"] += 1
                for key, value in step_coverage(self.cfg, step):
                    c.note(key, value)
            if c.on_step is not None:
                c.on_step(self.cfg, self.steps, shrinking=self.shrinking)
            take_closeness()
            self._guard(lambda: self._apply(step))
            self.closeness = max(self.closeness, take_closeness())
            if not self.shrinking and self.runner is not None:
                for key, value, amount in self.runner.take_notes():
                    if (key, value) == ("split", "steps split") and not self.split_seen:
                        self.split_seen = True  # the scenario's first split step
                        c.note("split", "scenarios split " + spec_family(self.cfg.spec))
                    c.note(key, value, amount)

        def _apply(self, step: dict) -> None:
            # the backend is built with the scenario's first step, so a constructor that
            # raises is that step's failure, with a replayable repro
            if self.runner is None:
                self.runner = ScenarioRunner(c.backend_cls, self.cfg, c.graph_mode, c.device, c.strict_contiguity)
            self.runner.apply(step)

        def _guard(self, fn) -> None:
            """Run a step (or the backend's construction). An input the backend declines is
            counted and the scenario dropped (``reject``: neither a failure nor a way for
            shrinking to slide onto it); a failure already reported by this campaign, or one
            other than the failure being shrunk, likewise; anything else ends the search."""
            try:
                fn()
            except StepUnsupported as u:
                _clear_locals(u)
                c.count("unsupported", u.reason if u.declared else f"{u.reason} (plain NotImplementedError)")
                if not self.shrinking:  # a declined scenario is not a searched example (Hypothesis' count too)
                    c.stats["examples"] -= 1
                    withdraw_notes(c.stats["coverage"], scenario_coverage(self.cfg))
                    if c.on_declined is not None:
                        c.on_declined(self.cfg)
                reject()
            except OracleFailure as f:
                _clear_locals(f)
                if f.oracle != "bounds" and is_cuda_error(f.message):
                    raise CudaContextLost(f"step {len(self.steps) - 1}: {f.message}") from None
                key = failure_key(f)
                pending = c.stats.get("first_failure")
                if key in c.known or (pending is not None and pending["key"] != key):
                    c.count("known", key)
                    reject()
                c.stats.setdefault("first_failure", {"examples": c.stats["examples"], "time": time.monotonic(),
                                                     "key": key})
                failure = FuzzFailure(f, self.cfg, list(self.steps))
                if c.first_failure is None:
                    c.first_failure = failure
                    if c.on_found is not None:
                        try:
                            c.on_found(failure)
                        except Exception as exc:  # never a failure of the search itself
                            import sys
                            print(f"mla-fuzz: the first-sight hook failed: {type(exc).__name__}: {exc}",
                                  file=sys.stderr)
                c.latest_failure = failure
                raise failure from None
            except Exception as e:
                # a harness allocation (the world's caches, a reference) out of GPU memory
                raise_if_environment_oom(e, f"step {len(self.steps) - 1}")
                _lost_context(e, len(self.steps) - 1)
                raise

        def _capture(self, data):
            size = data.draw(st.sampled_from(self.cfg.capture_sizes), label="size")
            # half the captures see a short batch, so replays run longer rows than the
            # capture saw (a plan sized at capture is then too small)
            short = data.draw(st.booleans(), label="short capture")
            batch = data.draw(self._batches(size, short), label="batch")
            self._run({"op": "capture", "size": size, "batch": batch,
                       "warmups": data.draw(st.sampled_from((0, 1, 3)), label="warmups"),
                       "share": data.draw(st.booleans(), label="share")})
            self.captured.add(size)

        def _replay(self, data, poison: bool):
            size = data.draw(st.sampled_from(sorted(self.captured)), label="size")
            batch = data.draw(self._batches(size), label="batch")
            self._run({"op": "replay", "size": size, "batch": batch, "poison": poison})

        @rule(data=st.data())
        def capture(self, data):
            self._capture(data)

        @precondition(lambda self: bool(self.captured))
        @rule(data=st.data())
        def replay(self, data):
            self._replay(data, poison=False)

        @precondition(lambda self: bool(self.captured))
        @rule(data=st.data())
        def replay_poisoned(self, data):
            self._replay(data, poison=True)

        @rule(data=st.data())
        def eager(self, data):
            cfg = self.cfg
            batch = data.draw(self._batches(cfg.max_batch), label="batch")
            pads = [None] + [s for s in cfg.capture_sizes if s >= len(batch["seq_lens"])]
            self._run({"op": "eager", "batch": batch, "pad_to": data.draw(st.sampled_from(pads), label="pad_to"),
                       "poison": data.draw(st.booleans(), label="poison")})

        def teardown(self):
            if not self.shrinking and self.steps:
                # steer the search (Hypothesis' target phase) towards scenarios whose outputs
                # came nearer the tolerance and whose steps ran more distinct batch shapes
                target(self.closeness, label="reference error / tolerance")
                shapes = {(len(s["batch"]["seq_lens"]), max(s["batch"]["seq_lens"] or [0]),
                           s["batch"].get("max_decode_len"), s.get("size")) for s in self.steps}
                target(float(len(shapes)), label="distinct batch shapes")
            if self.runner is not None:
                # the machine itself lives on in Hypothesis' reference cycles (ScenarioRunner.close)
                runner, self.runner = self.runner, None
                try:
                    runner.close()
                except Exception as e:
                    _lost_context(e, len(self.steps) - 1)
                    raise

    return DecodeMachine


#: Examples per search block: the random search runs in blocks of this many examples, each on
#: one data path, rotating through the paths (Hypothesis makes most new examples by mutating
#: earlier ones, so a path drawn inside one long search came in runs: the FP8-output layer
#: was one scenario in 30).
PATH_BLOCK = 10


def plan_blocks(paths: tuple, seed: int, max_examples: int, book: bool = True) -> list[tuple]:
    """The search's blocks in order, ``(opening | None, path, examples, block seed)``: first
    the opening book, each opening on one path (paired by ``seed``), then random blocks of
    ``PATH_BLOCK`` examples (doubling each round, up to four times) rotating through ``paths``
    from where the book left off; in all
    ``max_examples`` examples."""
    import hashlib
    n = len(paths)
    off = seed % n
    blocks, left, k = [], max_examples, 0
    for i, opening in enumerate(BOOK if book else ()):
        if left <= 0:
            break
        take = min(BOOK_EXAMPLES, left)
        blocks.append((opening, paths[(off + i) % n], take))
        left -= take
    while left > 0:
        # blocks grow each round through the paths (10, 20, 40): short ones reach every path
        # soon, longer ones give Hypothesis' mutation and target phases room
        take = min(PATH_BLOCK << min(k // n, 2), left)
        blocks.append((None, paths[(off + k) % n], take))
        left -= take
        k += 1
    out = []
    for j, (opening, path, take) in enumerate(blocks):
        h = hashlib.blake2b(f"mla-fuzz-block:{seed}:{j}".encode(), digest_size=4).digest()
        out.append((opening, path, take, int.from_bytes(h, "little")))
    return out


def _clear_locals(e: BaseException) -> None:
    """Empty the finished frames of ``e``'s traceback and of the exceptions it chains (file
    and line stay, for Hypothesis' grouping of failures): their locals are the scenario's
    tensors (the KV pool before and after the step, the forward's outputs, the backend's
    own), and the exception lives on in Hypothesis' reference cycles until a full garbage
    collection (``ScenarioRunner.close``)."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if x.__traceback__ is not None:
            traceback.clear_frames(x.__traceback__)  # the frame handling it is skipped: still running
        todo += [x.__cause__, x.__context__]


def _forget(machine: type) -> None:
    """Let a finished block's machine class hold nothing of its campaign. Hypothesis keeps
    every state-machine class it ran (``RuleBasedStateMachine._setup_state_per_class``, and
    its strategy cache holds the rules), and each block's class closes over its campaign,
    whose failures' tracebacks hold the scenarios' runners: a worker kept every fuzz call's
    failing scenarios alive, GPU tensors included (4.5 GB after one 12-example DeepSeek-V3 row
    on an H200), and its neighbours ran out of memory. So the class leaves Hypothesis' cache
    and its methods' closure cells (the campaign, the block's strategies) are emptied: the
    class is never run again. ``tests/harness/test_search_plan.py`` checks that nothing of a
    campaign outlives it."""
    cache = getattr(RuleBasedStateMachine, "_setup_state_per_class", None)
    if isinstance(cache, dict):
        cache.pop(machine, None)
    for member in vars(machine).values():
        for cell in getattr(getattr(member, "__func__", member), "__closure__", None) or ():
            cell.cell_contents = None


def search(c: Campaign, *, max_examples: int, seed: int, step_count: int = 6, shrink: bool = True,
           database=None, shrink_seconds: float | None = None, book: bool = True) -> FuzzFailure | None:
    """Run up to ``max_examples`` scenarios seeded by ``seed``: the opening book, then random
    blocks rotating through the data paths (``plan_blocks``), each block its own Hypothesis
    search; the minimal failure (or None). ``BudgetExhausted`` propagates when
    ``c.deadline`` passes. ``book``: start with the opening book."""
    # shrinking is bounded by the machine itself (ShrinkTimeUp): Hypothesis' own bound is a
    # private module constant
    c.shrink_seconds = shrink_seconds
    settle(c.backend_cls)
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target] + ([Phase.shrink] if shrink else [])
    for opening, path, examples, block_seed in plan_blocks(campaign_paths(c), seed, max_examples, book):
        s = settings(max_examples=examples, deadline=None, database=database, phases=phases,
                     stateful_step_count=BOOK_EXTRA_STEPS if opening is not None else step_count,
                     report_multiple_bugs=False, derandomize=False, print_blob=False,
                     verbosity=Verbosity.quiet, suppress_health_check=list(HealthCheck))
        c.block_zero = None
        machine = make_machine(c, path, opening)
        try:
            run_state_machine_as_test(hypothesis_seed(block_seed)(machine), settings=s)
        except FuzzFailure as f:
            return f
        except ShrinkTimeUp:
            return c.latest_failure
        except Unsatisfiable:
            pass  # every scenario of this block was declined or skipped: the counts say so
        finally:
            _forget(machine)
        if opening is None and path not in c.zero_configs and c.block_zero is not None:
            c.zero_configs[path] = c.block_zero
    return None
