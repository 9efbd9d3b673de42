"""Runs a training script as its users run it, watched from outside its code: the demo's and the tests' faults,
sample ledger and pacing.

    python -m devkit.watched [--ledger DIR] [--faults SPEC] [--step-sleep-s S] [--slow-below SIZE:S] \\
        -- SCRIPT [ARGS...]

Under ``elastic-horovodrun`` this is the worker's command (the launcher's
entry runs it as ``-m devkit.watched``); the script itself carries no hook,
as the examples carry none. The watch sits on the two public calls every
training script of this project makes:

- the function decorated with ``@elastic_ext.run``: at each (re)start the
  ledger's ``start`` record (the generation, where the sampler resumed, the
  step, the rank and the world size), and a fault due at that step fires;
- ``sampler.record_step()`` (the scripts' own loops call it after each
  optimizer step; ``ElasticCallback`` calls it in ``model.fit``): the step's
  samples go to the ledger (this rank's share of the step at the sampler's
  position, as its plan gives it), steps sleep as ``--step-sleep-s`` and
  ``--slow-below`` say, and a fault due at the next step fires.

So a fault ``RANK:STEP`` fires after step STEP - 1's update and before the
commit that may follow it, or at a (re)start at STEP. Rank and world size
are the sampler's (``sampler.world()``), the State is the one handed to the
decorated function, and its sampler the State's ``sampler`` entry. The
script runs as ``python SCRIPT`` would run it: ``__main__``, its directory
first on ``sys.path``, ``sys.argv`` from SCRIPT on.
"""

from __future__ import annotations

import argparse
import functools
import os
import runpy
import sys
import time
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from devkit import faults as fault_schedule, ledger
from elastic_ext.errors import ConfigError


class Watch:
    """Fault schedule, ledger and pacing of one worker.

    Args:
        ledger_dir: this run's sample ledger ("" for none); fault markers go to its ``faults`` subdirectory.
        faults: ``"RANK:STEP[:HOW[:WHERE]],..."`` (:meth:`devkit.faults.FaultSchedule.parse`); needs ``ledger_dir``.
        step_sleep_s: seconds every step sleeps.
        slow_below: ``"SIZE:SECONDS"``: while the world has fewer than SIZE workers, steps sleep SECONDS
            instead ("" for never).

    Raises:
        ConfigError: faults without a ledger directory, a negative ``step_sleep_s``, or ``slow_below`` not
            ``"SIZE:SECONDS"`` with SIZE >= 1 and SECONDS >= 0.
    """

    def __init__(self, ledger_dir: str = "", faults: str = "", step_sleep_s: float = 0.0,
                 slow_below: str = "") -> None:
        if faults and not ledger_dir:
            raise ConfigError(f"faults ({faults!r}) need a ledger directory: their markers live in the run's "
                              "own directory, <ledger>/faults")
        if not step_sleep_s >= 0:
            raise ConfigError(f"step_sleep_s ({step_sleep_s}) must be >= 0")
        self.faults = fault_schedule.FaultSchedule.parse(faults, os.path.join(ledger_dir, "faults")) if faults else None
        self.ledger = ledger.Ledger(ledger_dir) if ledger_dir else None
        self.step_sleep_s = step_sleep_s
        self.slow_below = parse_slow_below(slow_below)
        self.state: Any = None  # the State of the running training function

    def started(self, state: Any) -> None:
        """At every (re)start of the training function."""
        self.state = state
        sampler = sampler_of(state)
        rank, size = sampler.world()
        if self.ledger is not None:
            self.ledger.start(state.generation, sampler.epoch, sampler.cursor, state.step, rank, size)
        if self.faults is not None:
            self.faults.maybe_fire(rank, state.step)

    def recording(self, sampler: Any) -> None:
        """As ``sampler.record_step()`` begins: the step's samples to the ledger."""
        if self.ledger is None:
            return
        state = self._state()
        rank, size = sampler.world()
        sampler.skip_ahead()
        indices, pad = sampler.plan().batch(0)
        pad = np.asarray(pad, dtype=bool)
        self.ledger.step(state.generation, sampler.epoch, sampler.cursor, state.step, rank, size,
                         np.asarray(indices)[~pad], int(pad.sum()))

    def recorded(self, sampler: Any) -> None:
        """After ``sampler.record_step()``: the pause, then a fault due at the next step fires."""
        rank, size = sampler.world()
        seconds = self.step_sleep_s
        if self.slow_below is not None and size < self.slow_below[0]:
            seconds = self.slow_below[1]
        if seconds:
            time.sleep(seconds)
        if self.faults is not None:
            self.faults.maybe_fire(rank, self._state().step + 1)

    def finished(self) -> None:
        """After the script ended: the ledger's end record."""
        if self.ledger is not None and self.state is not None:
            rank, size = sampler_of(self.state).world()
            self.ledger.end(self.state.step, rank, size)

    def _state(self) -> Any:
        if self.state is None:
            raise ConfigError("sampler.record_step() was called outside the function decorated with "
                              "@elastic_ext.run: the watch has no State to read the step and generation from")
        return self.state


def sampler_of(state: Any) -> Any:
    """The State's ``sampler`` entry."""
    sampler = getattr(state, "sampler", None)
    if sampler is None or not hasattr(sampler, "record_step"):
        raise ConfigError("the watched script's State has no 'sampler' entry (an ElasticSampler): the ledger "
                          "records the sampler's steps")
    return sampler


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


def install(watch: Watch) -> None:
    """Puts ``watch`` on ``@elastic_ext.run`` and ``ElasticPartitioner.record_step`` (of every sampler)."""
    import elastic_ext
    from elastic_ext.data.sampler import ElasticPartitioner
    from elastic_ext.runtime import run as run_module

    original_run, original_record = run_module.run, ElasticPartitioner.record_step

    def watched_run(func: Optional[Callable] = None, **options: Any) -> Any:
        if func is None:
            return functools.partial(watched_run, **options)

        @functools.wraps(func)
        def started_then(state: Any, *args: Any, **kwargs: Any) -> Any:
            watch.started(state)
            return func(state, *args, **kwargs)

        return original_run(started_then, **options)

    def record_step(sampler: Any) -> None:
        watch.recording(sampler)
        original_record(sampler)
        watch.recorded(sampler)

    elastic_ext.run = watched_run
    ElasticPartitioner.record_step = record_step


def parse_args(argv: List[str]) -> Tuple[argparse.Namespace, List[str]]:
    """The watch's options, and the script's command line after ``--``."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit("usage: python -m devkit.watched [--ledger DIR] [--faults SPEC] [--step-sleep-s S] "
                         f"[--slow-below SIZE:S] -- SCRIPT [ARGS...] (got {argv!r})")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m devkit.watched")
    parser.add_argument("--ledger", default="", help="directory of the sample ledger and the fault markers")
    parser.add_argument("--faults", default="", help='injected faults "RANK:STEP[:kill|stop|term]" (needs --ledger)')
    parser.add_argument("--step-sleep-s", type=float, default=0.0, help="seconds every step sleeps")
    parser.add_argument("--slow-below", default="", metavar="SIZE:SECONDS",
                        help="while the world has fewer than SIZE workers, steps sleep SECONDS instead")
    return parser.parse_args(argv[:split]), argv[split + 1:]


def main(argv: Optional[List[str]] = None) -> None:
    args, script = parse_args(sys.argv[1:] if argv is None else list(argv))
    watch = Watch(args.ledger, args.faults, args.step_sleep_s, args.slow_below)
    install(watch)
    sys.argv = script
    sys.path[0] = os.path.dirname(os.path.abspath(script[0]))
    runpy.run_path(script[0], run_name="__main__")
    watch.finished()


if __name__ == "__main__":
    main()
