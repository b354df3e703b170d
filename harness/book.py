"""The opening book: a few generic scenario shapes that push a captured graph's lifecycle
hardest, searched before the random search (issue #44: bugs of this kind live there first).

Each opening is a fixed sequence of steps whose *values* Hypothesis draws, so a failure
shrinks like any other; the draws are arranged so that the simplest one is the hard case
(the longest rows, every row real, the widest MTP step, two graphs), not the smallest. The
shapes are the lifecycle of an engine's graphs, not any known bug's input:

- ``grow``: capture a short one-row batch, replay the largest batch with the longest rows,
  then replay one long row padded to the graph's size, with poisoned padding;
- ``shared-warmups``: three warmups and the capture on ONE build (as vLLM does per capture
  size), then replays with long rows;
- ``eager-between``: two graphs; a padded, poisoned eager forward before their replays;
- ``mtp-wider``: capture with one query token per request, replay with ``next_n`` (a
  ragged-MTP backend; otherwise it is ``grow`` again with MTP rows).

Each opening runs on one data path (``strategies.PATHS``); the search pairs openings with
paths and rotates the pairing with the seed, so chunks of a campaign cover other pairs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Opening:
    """One book entry: ``program(draw, cfg, batches)`` returns the step dicts to run after
    the scenario's config is drawn. ``batches(rows, short=..., long=..., mdl=...)`` is the
    batch strategy of the scenario for exactly ``rows`` requests."""

    name: str
    program: Callable


def _capture(draw, batches, size, *, warmups=0, share=False, mdl=None) -> dict:
    return {"op": "capture", "size": size, "batch": draw(batches(1, short=True, mdl=mdl)),
            "warmups": warmups, "share": share}


def _replay(draw, batches, size, rows, *, poison=False, mdl=None) -> dict:
    return {"op": "replay", "size": size, "batch": draw(batches(rows, long=True, mdl=mdl)), "poison": poison}


def _grow(draw, cfg, batches) -> list[dict]:
    big = cfg.max_batch
    return [_capture(draw, batches, big), _replay(draw, batches, big, big),
            _replay(draw, batches, big, 1, poison=True)]


def _shared_warmups(draw, cfg, batches) -> list[dict]:
    big = cfg.max_batch
    return [_capture(draw, batches, big, warmups=3, share=True), _replay(draw, batches, big, big),
            _replay(draw, batches, big, big, poison=True)]


def _eager_between(draw, cfg, batches) -> list[dict]:
    small, big = min(cfg.capture_sizes), cfg.max_batch
    # one row short of the big graph, padded to it: a padded row's inputs are poisoned (NaN)
    return [_capture(draw, batches, small), _capture(draw, batches, big),
            {"op": "eager", "batch": draw(batches(max(1, big - 1), long=True)), "pad_to": big, "poison": True},
            _replay(draw, batches, small, small), _replay(draw, batches, big, big)]


def _mtp_wider(draw, cfg, batches) -> list[dict]:
    big = cfg.max_batch
    return [_capture(draw, batches, big, mdl=1), _replay(draw, batches, big, big, mdl=cfg.next_n),
            _replay(draw, batches, big, 1, poison=True, mdl=cfg.next_n)]


BOOK = (Opening("grow", _grow), Opening("shared-warmups", _shared_warmups),
        Opening("eager-between", _eager_between), Opening("mtp-wider", _mtp_wider))

#: Examples per opening: Hypothesis' first (the simplest draw, here the hard shape) and one
#: random draw of the same shape.
BOOK_EXAMPLES = 2
#: Random steps the search may add after an opening's program.
BOOK_EXTRA_STEPS = 2
