"""The contract every discovery script keeps with ``horovodrun``.

- stdout carries only ``host:slots`` lines, written at once at the end;
  logs and errors go to stderr.
- The whole run is bounded by ``--timeout-s``: every scheduler or cloud call
  takes its timeout from the same deadline, and a watchdog ends the process
  if anything else hangs.
- The exit status says what went wrong (:data:`EXIT_CODES`). Horovod ends
  the job when the first call exits non-zero and keeps the previous host set
  when a later one does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence

from elastic_ext.discovery.deadline import Deadline
from elastic_ext.discovery.hosts import HostSlots, render, usable_hosts
from elastic_ext.errors import (DiscoveryError, DiscoveryInputError, DiscoveryTimeoutError,
                                DiscoveryUnavailableError)

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_INPUT = 2
EXIT_UNAVAILABLE = 3
EXIT_TIMEOUT = 4

EXIT_CODES = {
    EXIT_OK: "hosts printed (possibly none: an empty list means no usable host right now)",
    EXIT_INTERNAL: "internal error (a bug); details with --log-level DEBUG",
    EXIT_INPUT: "usage or bad input: flags, nodelist, host file, slot count, AWS config",
    EXIT_UNAVAILABLE: ("scheduler or cloud API unreachable, missing, or answered an error; "
                       "or Slurm reports no node of the allocation healthy"),
    EXIT_TIMEOUT: "a scheduler/API call or the whole run exceeded its time bound",
}

DEFAULT_TIMEOUT_S = 5.0
# The watchdog fires this long after the deadline, so cooperative timeouts
# (which kill their subprocesses) normally win the race.
WATCHDOG_GRACE_S = 0.5

# Set once the host list starts going to stdout; the watchdog then stands down.
_written = threading.Event()


def exit_code_epilog() -> str:
    """The exit-code table for ``--help``."""
    rows = "\n".join(f"  {code}  {text}" for code, text in EXIT_CODES.items())
    return ("stdout: one HOST:SLOTS line per usable host; logs go to stderr.\n\n"
            f"exit status:\n{rows}")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter, its width read as argparse reads it but without importing ``shutil``.

    argparse builds a formatter for every ``add_argument`` and imports
    ``shutil`` (with its compression modules) for the terminal's width: a
    tenth of a discovery script's start, every second under Horovod.
    """

    def __init__(self, prog: str, **options: object) -> None:
        if options.get("width") is None:
            options["width"] = _terminal_columns() - 2
        super().__init__(prog, **options)


def _terminal_columns() -> int:
    """``$COLUMNS``, else the terminal's width, else 80 (``shutil.get_terminal_size``'s rule)."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the options every discovery script shares."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     epilog=exit_code_epilog(), formatter_class=_HelpFormatter)
    parser.add_argument("--timeout-s", type=positive_float, default=DEFAULT_TIMEOUT_S,
                        metavar="S", help="bound for the whole run, in seconds "
                        f"(default {DEFAULT_TIMEOUT_S:g}); exceeding it exits {EXIT_TIMEOUT}")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="stderr log level (default WARNING)")
    return parser


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def main(parser: argparse.ArgumentParser, discover: Callable[[argparse.Namespace, Deadline], list[HostSlots]],
         argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run ``discover`` under the deadline, print hosts; return the exit code."""
    args = parser.parse_args(argv)  # exits 2 with a usage message on bad flags
    _configure_logging(parser.prog, args.log_level)
    log = logging.getLogger(parser.prog)
    output_lock = threading.Lock()
    watchdog = threading.Timer(args.timeout_s + WATCHDOG_GRACE_S, _expire,
                               (parser.prog, args.timeout_s, output_lock))
    watchdog.daemon = True
    watchdog.start()
    try:
        hosts = usable_hosts(discover(args, Deadline(args.timeout_s)))
    except DiscoveryTimeoutError as exc:
        return _fail(log, EXIT_TIMEOUT, exc)
    except DiscoveryUnavailableError as exc:
        return _fail(log, EXIT_UNAVAILABLE, exc)
    except DiscoveryInputError as exc:
        return _fail(log, EXIT_INPUT, exc)
    except DiscoveryError as exc:
        return _fail(log, EXIT_UNAVAILABLE, exc)
    except Exception as exc:  # a bug: one line on stderr, the traceback only when asked
        log.debug("traceback", exc_info=True)
        return _fail(log, EXIT_INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
    finally:
        watchdog.cancel()
    if not hosts:
        log.warning("no usable hosts right now; printing an empty list")
    with output_lock:
        _written.set()
        try:
            sys.stdout.write(render(hosts))
            sys.stdout.flush()
        except BrokenPipeError:
            log.error("stdout was closed before the host list was written")
            return EXIT_UNAVAILABLE
    return EXIT_OK


def _fail(log: logging.Logger, code: int, exc: object) -> int:
    log.error("%s", exc)
    return code


def _expire(prog: str, timeout_s: float, output_lock: threading.Lock) -> None:
    # Never interleave with a host list being written: either all of it or none.
    output_lock.acquire(timeout=WATCHDOG_GRACE_S)
    if _written.is_set():
        return  # the answer is out; let the main thread exit normally
    try:
        sys.stderr.write(f"{prog}: ERROR: discovery did not finish within --timeout-s "
                         f"{timeout_s:g} s; giving up\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_TIMEOUT)


def _configure_logging(prog: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prog}: %(levelname)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # botocore is chatty at DEBUG; keep its noise out unless we debug ourselves.
    logging.getLogger("botocore").setLevel(max(logging.getLevelName(level), logging.INFO))


__all__ = ["EXIT_OK", "EXIT_INTERNAL", "EXIT_INPUT", "EXIT_UNAVAILABLE", "EXIT_TIMEOUT",
           "EXIT_CODES", "DEFAULT_TIMEOUT_S", "make_parser", "positive_int", "positive_float",
           "main"]
