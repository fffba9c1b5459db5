"""The host allocator policy (flarepp.allocator): applied by the compute commands, switched
off by FLAREPP_RETAIN_MEMORY=0, observable in glibc's own statistics.

The probes run in fresh interpreters: the policy is process state, and each setting must be
checked from a clean start.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from flarepp import allocator
from flarepp.cli import main

GLIBC = platform.libc_ver()[0] == "glibc"
PROBE = """
import json, torch
from flarepp.allocator import apply_policy, malloc_stats
policy = apply_policy()
x = torch.empty(64 * 2 ** 20, dtype=torch.uint8).fill_(1)  # above any mmap threshold
held = malloc_stats()
del x
print(json.dumps({"retained": policy.retained, "policy": str(policy), "held": held,
                  "freed": malloc_stats()}))
"""


def _probe(switch: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != allocator.ENV_VAR}
    if switch is not None:
        env[allocator.ENV_VAR] = switch
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="the policy acts on glibc's malloc only")
def test_policy_keeps_a_large_block_in_the_heap_and_the_switch_turns_it_off():
    """Applied (the default): a 64 MiB tensor comes from the heap, not from an mmap, and
    stays in the process after it is freed; with FLAREPP_RETAIN_MEMORY=0 it is mmap'd and
    returned on free, as glibc does by default. A failure means mallopt did not take."""
    mib = 2 ** 20
    on = _probe(None)
    assert on["retained"] and on["policy"].startswith("retain (glibc"), on["policy"]
    if on["held"] is not None:  # glibc >= 2.33 has mallinfo2
        assert on["held"]["mmapped_bytes"] < 32 * mib
        assert on["freed"]["free_bytes"] >= 64 * mib  # kept for reuse
    off = _probe("0")
    assert not off["retained"] and "switched off by FLAREPP_RETAIN_MEMORY=0" in off["policy"]
    if off["held"] is not None:
        assert off["held"]["mmapped_bytes"] >= 64 * mib
        assert off["freed"]["mmapped_bytes"] < off["held"]["mmapped_bytes"] - 60 * mib


RETURN_PROBE = """
import json, torch
from flarepp.allocator import apply_policy, malloc_stats, return_freed_memory
apply_policy()
x = torch.empty(64 * 2 ** 20, dtype=torch.uint8).fill_(1)
del x
kept = malloc_stats()
policy = return_freed_memory()
returned = malloc_stats()
y = torch.empty(64 * 2 ** 20, dtype=torch.uint8).fill_(1)
held = malloc_stats()
del y
freed = malloc_stats()
print(json.dumps({"retained": policy.retained, "detail": policy.detail, "kept": kept,
                  "returned": returned, "held": held, "freed": freed}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="the policy acts on glibc's malloc only")
def test_a_budgeted_process_returns_the_memory_the_policy_kept():
    """``return_freed_memory`` (what a run under a memory budget calls): after it, a new
    64 MiB block is mmap'd and unmapped when freed, as glibc does by default, where the
    retain policy kept the freed 64 MiB in the heap, so a heap held at a training step's
    high-water mark does not take the evaluation's room under an address-space limit."""
    env = {k: v for k, v in os.environ.items() if k != allocator.ENV_VAR}
    done = subprocess.run([sys.executable, "-c", RETURN_PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert not got["retained"] and got["detail"] == allocator.RETURNED
    if got["kept"] is not None:  # glibc >= 2.33 has mallinfo2
        mib = 2 ** 20
        assert got["kept"]["free_bytes"] >= 64 * mib
        assert got["held"]["mmapped_bytes"] >= 64 * mib
        assert got["freed"]["mmapped_bytes"] < got["held"]["mmapped_bytes"] - 60 * mib


def test_switch_values_and_errors():
    """Accepted spellings both ways; anything else is an error naming the variable, not a
    silent default."""
    for value in ("1", "true", "Yes", "on", " ON "):
        assert allocator.retain_memory_requested({allocator.ENV_VAR: value})
    for value in ("0", "false", "no", "OFF"):
        assert not allocator.retain_memory_requested({allocator.ENV_VAR: value})
    assert allocator.retain_memory_requested({})
    with pytest.raises(ValueError, match="FLAREPP_RETAIN_MEMORY='maybe'"):
        allocator.retain_memory_requested({allocator.ENV_VAR: "maybe"})
    assert allocator.child_environment(False, {"A": "1"}) == {"A": "1",
                                                             allocator.ENV_VAR: "0"}


def test_compute_commands_apply_it_and_others_do_not(monkeypatch, tmp_path, capsys):
    """main() applies the policy before running train/eval/infer/bench/demo/compare and
    not for the rest; a bad switch value is a CLI error (exit 2) that names it."""
    calls = []
    monkeypatch.setattr(allocator, "apply_policy",
                        lambda: calls.append(1) or allocator.AllocatorPolicy(False, "test"))
    assert main(["eval", str(tmp_path / "missing.pt")]) == 1  # a runtime error, after it
    assert calls == [1]
    assert main(["presets"]) == 0
    assert calls == [1]
    monkeypatch.undo()
    monkeypatch.setenv(allocator.ENV_VAR, "maybe")
    assert main(["eval", str(tmp_path / "missing.pt")]) == 2
    assert "FLAREPP_RETAIN_MEMORY='maybe'" in capsys.readouterr().err
