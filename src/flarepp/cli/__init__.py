"""The ``flarepp`` command line: a thin layer over library functions.

Each module of this package that defines ``register(subparsers)`` adds one subcommand;
the handler it sets with ``set_defaults(func=...)`` returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


class CLIError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flarepp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


COMPUTE_COMMANDS = frozenset({"train", "eval", "infer", "bench", "demo", "compare"})
"""Commands whose process keeps freed host memory for reuse (:mod:`flarepp.allocator`;
``FLAREPP_RETAIN_MEMORY=0`` switches it off)."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in COMPUTE_COMMANDS:
            from flarepp.allocator import apply_policy
            args.allocator = apply_policy()
        return int(args.func(args) or 0)
    except (CLIError, ValueError, FileNotFoundError, KeyError, FloatingPointError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"flarepp {args.command}: error: {msg}", file=sys.stderr)
        return 2


__all__ = ["COMPUTE_COMMANDS", "CLIError", "build_parser", "main"]
