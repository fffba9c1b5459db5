"""The ``flarepp`` command line: a thin layer over library functions.

Each module of this package that defines ``register(subparsers)`` adds one subcommand;
the handler it sets with ``set_defaults(func=...)`` returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys
import threading
from pathlib import Path

from flarepp import allocator, threads
from flarepp.allocator import OutOfMemory
from flarepp.data import DataError
from flarepp.data.fingerprint import DataMismatch
from flarepp.distributed import RankFailure
from flarepp.io import UnreadableFile
from flarepp.locks import LeaseLost
from flarepp.storage.checkpoint import CheckpointError
from flarepp.storage.rundir import RunLocked
from flarepp.train.loop import TrainingInterrupted


class CLIError(Exception):
    """A usage error: printed as a sentence without a traceback, exit status 2."""


RUNTIME_ERRORS: tuple[type[BaseException], ...] = (
    DataError, CheckpointError, RunLocked, LeaseLost, DataMismatch, FloatingPointError, OSError,
    RankFailure, UnreadableFile, OutOfMemory)
"""Failures of a valid command (bad data or checkpoint, a busy run directory, a lost lease, a
diverged loss, the file system, a failed rank, a failed allocation named by its stage): exit
status 1."""


class Terminated(BaseException):
    """SIGTERM outside a training loop (which handles it itself, see flarepp.train.loop)."""


def _terminate(signum, frame) -> None:
    raise Terminated


def _sentence(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    return str(err)


def check_output(path: str | Path, *, directory: bool, option: str = "--out") -> Path:
    """Raise :class:`CLIError` before any work if ``path`` cannot be written.

    ``directory``: ``path`` is a directory to create or reuse (a run directory); otherwise a
    file whose folder must exist or be creatable.
    """
    path = Path(path)
    if directory and path.exists() and not path.is_dir():
        raise CLIError(f"{option} {str(path)!r} is a file, not a directory")
    if not directory and path.is_dir():
        raise CLIError(f"{option} {str(path)!r} is a directory; give a file name")
    folder = path if directory else path.parent
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CLIError(f"{option} {str(path)!r}: {str(existing)!r} is a file, so the folder "
                       "cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CLIError(f"{option} {str(path)!r}: no permission to write in {str(existing)!r}")
    return path


def say(line: str) -> None:
    """Print ``line`` on stdout, flushed; a reader that has gone away (``| head``) is not an
    error of the command: stdout is pointed at ``/dev/null`` and the command goes on to
    write its files."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def at_least(low: int, *, most: int | None = None):
    """An argparse ``type`` for an integer option that must be ``>= low`` (and ``<= most``
    where given, e.g. a TCP port): anything else is a usage error naming the option and
    the value (exit status 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (most is not None and value > most):
            bounds = f">= {low}" if most is None else f"from {low} to {most}"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {value}")
        return value
    return parse


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    """``--threads N``: the run's intra-op threads, instead of the count it measures on its
    first steps (:mod:`flarepp.threads`); applied by :func:`main` before the command."""
    p.add_argument("--threads", dest="run_threads", type=at_least(1), metavar="N",
                   help="CPU intra-op threads (default: the fastest count, timed on the "
                        "run's first steps; OMP_NUM_THREADS is respected too)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flarepp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


COMPUTE_COMMANDS = frozenset({"train", "eval", "infer", "bench", "demo", "compare", "sweep"})
"""Commands whose process keeps freed host memory for reuse (:mod:`flarepp.allocator`;
``FLAREPP_RETAIN_MEMORY=0`` switches it off)."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        _process_settings(args)
        return int(args.func(args) or 0)
    except TrainingInterrupted as err:
        print(f"flarepp {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except (KeyboardInterrupt, Terminated) as err:
        code = 130 if isinstance(err, KeyboardInterrupt) else 143
        print(f"flarepp {args.command}: {'interrupted' if code == 130 else 'terminated'} "
              "(no output is half-written: files are replaced atomically)", file=sys.stderr)
        return code
    except RUNTIME_ERRORS as err:
        print(f"flarepp {args.command}: error: {_sentence(err)}", file=sys.stderr)
        return 1
    except MemoryError as err:  # numpy's message says how much one allocation needed
        print(f"flarepp {args.command}: error: out of memory"
              + (f": {err}" if str(err) else ""), file=sys.stderr)
        return 1
    except (CLIError, ValueError) as err:  # bad arguments, names or config values
        print(f"flarepp {args.command}: error: {_sentence(err)}", file=sys.stderr)
        return 2


def _process_settings(args: argparse.Namespace) -> None:
    """What a command sets for its whole process, before it starts: the host allocator
    policy and the inter-op thread budget of the compute commands; ``--threads``; a thread
    count from the environment above what the machine can run is refused here, before any
    work (:func:`flarepp.threads.check_thread_count`)."""
    if args.command in COMPUTE_COMMANDS:  # (module attributes: a test may replace them)
        args.allocator = allocator.apply_policy()
        threads.user_threads()
        threads.limit_interop(threads.thread_budget())
    if getattr(args, "run_threads", None):
        threads.set_threads(args.run_threads)


__all__ = ["COMPUTE_COMMANDS", "CLIError", "RUNTIME_ERRORS", "add_threads_argument", "at_least",
           "build_parser", "check_output", "main", "say"]
