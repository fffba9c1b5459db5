"""The ``serve`` extra's one entry: KServe, imported so that it cannot read our arguments.

``kserve``'s package imports its ``model_server`` module, which parses ``sys.argv`` at
import (its own options, abbreviations allowed: a ``--timeout`` of ours would be taken for
its ``--timeout-keep-alive``); :func:`require_kserve` hides the process's arguments while it
imports, and names the extra to install when it is missing.
"""

from __future__ import annotations

import sys
from types import ModuleType

SERVE_EXTRA = "pip install 'flarepp[serve]'"


class ServeUnavailable(ImportError):
    """The serve extra is not installed (the message says what to install)."""


def require_kserve() -> ModuleType:
    """The ``kserve`` module (module docstring)."""
    if "kserve" in sys.modules:
        return sys.modules["kserve"]
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        import kserve
    except ImportError as err:
        raise ServeUnavailable(f"flarepp serve needs KServe's model server: {SERVE_EXTRA} "
                               f"({err})") from None
    finally:
        sys.argv = argv
    return kserve


__all__ = ["SERVE_EXTRA", "ServeUnavailable", "require_kserve"]
