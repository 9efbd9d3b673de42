"""The one hook through which the demo and the tests watch an example's training.

An example builds an :class:`Instrument` from its command line, outside the
training loop, and calls it once per (re)start and once per step. Without
``--ledger``, ``--faults``, ``--step-sleep-s`` and ``--slow-below`` every call does nothing,
so a training script of your own simply leaves the instrument out. With
them, declared faults fire (each once per job), every step's samples go to
the sample ledger, and steps are slowed down so that a person can watch the
job.

The fault schedule and the ledger are development tools, not shipped:
they live in the repository's ``devkit/`` (:mod:`devkit.faults`,
:mod:`devkit.ledger`) and are imported only when ``--ledger`` or
``--faults`` asks for them, so the flags need a checkout on ``PYTHONPATH``
(the demo and the tests launch their jobs that way) and the example runs
without one.

Fault markers live under the run's own directory (``<ledger>/faults``),
never in a shared temporary one: a marker left by an earlier run would
silently disarm the fault of a later one.
"""

from __future__ import annotations

import argparse
import os
import time
import importlib
from typing import Any, Callable, Optional, Tuple

import numpy as np

from elastic_ext.errors import ConfigError


class Instrument:
    """Fault injection, sample ledger and step slow-down for one worker.

    Args:
        ledger_dir: directory of this run's sample ledger ("" for none); the
            fault markers go to its ``faults`` subdirectory.
        faults: ``"RANK:STEP[:HOW[:WHERE]],..."`` (see
            :meth:`devkit.faults.FaultSchedule.parse`); needs ``ledger_dir``.
        step_sleep_s: seconds to sleep in every step.
        slow_below: ``"SIZE:SECONDS"``: while the world has fewer than SIZE
            workers, steps sleep SECONDS instead ("" for never). The demo
            paces its job so that it grows to full size before training
            ends, even when its newcomers are slow to start.
        rank_fn: returns this worker's current rank.
        size_fn: returns the current world size.

    Raises:
        ConfigError: ``ledger_dir`` or ``faults`` is given where the
            repository's ``devkit`` cannot be imported, faults are given without a ledger directory,
            ``step_sleep_s`` is negative, or ``slow_below`` is not
            ``"SIZE:SECONDS"`` with SIZE >= 1 and SECONDS >= 0.
    """

    def __init__(self, ledger_dir: str = "", faults: str = "", step_sleep_s: float = 0.0,
                 rank_fn: Callable[[], int] = lambda: 0, size_fn: Callable[[], int] = lambda: 1,
                 slow_below: str = "") -> None:
        if faults and not ledger_dir:
            raise ConfigError(f"faults ({faults!r}) need a ledger directory: their markers live in the run's "
                              "own directory, <ledger>/faults")
        if step_sleep_s < 0:
            raise ConfigError(f"step_sleep_s ({step_sleep_s}) must be >= 0")
        self.faults: Optional[Any] = (  # a devkit.faults.FaultSchedule
            _devkit("faults").FaultSchedule.parse(faults, os.path.join(ledger_dir, "faults")) if faults else None)
        # a devkit.ledger.Ledger
        self.ledger: Optional[Any] = _devkit("ledger").Ledger(ledger_dir) if ledger_dir else None
        self.step_sleep_s = step_sleep_s
        self.slow_below = parse_slow_below(slow_below)
        self._rank_fn = rank_fn
        self._size_fn = size_fn

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Adds ``--ledger``, ``--faults``, ``--step-sleep-s`` and ``--slow-below`` (all off by default)."""
        group = parser.add_argument_group("demo and test instrumentation (off by default)")
        group.add_argument("--ledger", default="",
                           help="directory for the per-step sample ledger (exactly-once audit) and fault markers")
        group.add_argument("--faults", default="",
                           help='injected faults "RANK:STEP[:kill|stop|term]" (needs --ledger)')
        group.add_argument("--step-sleep-s", type=float, default=0.0, help="slow steps down, to watch the job")
        group.add_argument("--slow-below", default="", metavar="SIZE:SECONDS",
                           help="while the world has fewer than SIZE workers, steps sleep SECONDS instead")

    @classmethod
    def from_args(cls, args: argparse.Namespace, rank_fn: Callable[[], int],
                  size_fn: Callable[[], int]) -> "Instrument":
        """The instrument that :meth:`add_arguments`'s flags ask for."""
        return cls(args.ledger, args.faults, args.step_sleep_s, rank_fn, size_fn, args.slow_below)

    def started(self, state: Any, sampler: Any) -> None:
        """At every (re)start of the training function: where this generation resumed."""
        if self.ledger is not None:
            self.ledger.start(state.generation, sampler.epoch, sampler.cursor, state.step, self._rank_fn(),
                              self._size_fn())

    def before_step(self, state: Any) -> None:
        """At the start of step ``state.step``, before its forward pass: a due fault fires."""
        if self.faults is not None:
            self.faults.maybe_fire(self._rank_fn(), state.step)

    def pause(self) -> None:
        """Sleeps ``step_sleep_s`` (``slow_below``'s seconds below its size), so that a person can watch the job."""
        seconds = self.step_sleep_s
        if self.slow_below is not None and self._size_fn() < self.slow_below[0]:
            seconds = self.slow_below[1]
        if seconds:
            time.sleep(seconds)

    def record(self, state: Any, epoch: int, cursor: int, indices: Any, pad: Any) -> None:
        """Writes the step's real samples (``indices`` where not ``pad``) to the ledger."""
        if self.ledger is not None:
            indices, pad = np.asarray(indices), np.asarray(pad, dtype=bool)
            self.ledger.step(state.generation, epoch, cursor, state.step, self._rank_fn(), self._size_fn(),
                             indices[~pad], int(pad.sum()))

    def step(self, state: Any, sampler: Any, indices: Any, pad: Any) -> None:
        """:meth:`before_step`, :meth:`record` and :meth:`pause`, for a loop that draws from ``sampler``."""
        self.before_step(state)
        self.record(state, sampler.epoch, sampler.cursor, indices, pad)
        self.pause()

    def finished(self, state: Any) -> None:
        """After training returned: the ledger's end record."""
        if self.ledger is not None:
            self.ledger.end(state.step, self._rank_fn(), self._size_fn())


def _devkit(name: str) -> Any:
    """The checkout's ``devkit.<name>`` (not shipped: the demo's and the tests' flags need a checkout)."""
    try:
        return importlib.import_module(f"devkit.{name}")
    except ImportError as exc:
        raise ConfigError(f"--ledger and --faults need devkit.{name} from a checkout of the repository on "
                          f"PYTHONPATH (the demo and the tests set it); it cannot be imported: {exc}") from exc


def parse_slow_below(text: str) -> Optional[Tuple[int, float]]:
    """``"SIZE:SECONDS"`` as ``(size, seconds)``; None for ""."""
    if not text:
        return None
    size, _, seconds = text.partition(":")
    try:
        parsed = int(size), float(seconds)
    except ValueError:
        parsed = None
    if parsed is None or parsed[0] < 1 or not parsed[1] >= 0:
        raise ConfigError(f"slow_below ({text!r}) must be SIZE:SECONDS, a world size >= 1 and seconds >= 0, "
                          "for example '6:0.15'")
    return parsed
