"""CPU threads chosen by measurement, the way cuDNN's benchmark mode picks a kernel.

PyTorch starts as many intra-op threads as the machine has cores. Alone, that is often the
fastest setting; beside any other busy process it is the slowest by far (every small op
waits for its slowest thread, and one of them is always descheduled: ten times slower on 2
cores beside one busy process). So a run times its own first steps at each sensible count
(:func:`candidates`: 1, 2, 4, ... up to the cores it may use, :func:`usable_cores`), keeps
the fastest, says so in one line, and measures again when its step time drifts far from
what was measured (another job started or ended).

The user's setting wins, and nothing is measured, when there is one: ``--threads N``
(:func:`set_threads`, which also exports :data:`THREADS_ENV` so that launched workers
inherit it), ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, or ``torch.set_num_threads`` called
after flarepp was imported. A setting of more than :data:`THREADS_PER_CORE` threads per
logical core is refused in a sentence (:func:`check_thread_count`: ``--threads 100000``
would start threads until none could be started, and threads beyond the cores only wait). Measuring is skipped where it cannot pay: one usable
core, a device other than the CPU, or too few steps to spare the measured ones.

A tuner changes the count only for the work it times: :meth:`ThreadTuner.restore` puts back
the count it found (the trainer's thread callback calls it when the trainer closes,
:mod:`flarepp.train.callbacks`), so a run leaves its process as it found it.

The cores a process may use are the fewest of its CPU affinity, its cgroup's CPU quota
(v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``) and :data:`CORES_ENV`, the share a launcher
gives each of several workers on one machine (:func:`worker_share`); DataLoader worker
processes and inter-op threads are counted in the same budget (:func:`thread_budget`,
:func:`limit_interop`).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from flarepp.device import cgroup_folders

THREADS_ENV = "FLAREPP_THREADS"
"""An explicit intra-op thread count (``--threads N`` exports it to the worker processes)."""
CORES_ENV = "FLAREPP_CORES"
"""The cores this process may use, set by a launcher for each of its workers."""
USER_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
THREADS_PER_CORE = 4
"""The most intra-op threads per logical core a user's setting may ask for
(:func:`check_thread_count`)."""
DRIFT = 2.0
"""A step time this many times slower or faster than measured starts a new measurement
(the step times of one count on a shared machine spread by up to 1.8x between windows)."""
ROUNDS = 3
"""Timed steps per candidate (interleaved rounds; the median is kept)."""
SHARED_BY_RANKS = "not measured: the ranks' launcher divided the cores"
"""Why a run of several ranks keeps its count (each rank's is set by its launcher)."""
WINDOW_S = 2.0
"""Drift is judged on the median of at least this many seconds of steps."""
BUDGET_S = 3.0
"""Measurement stops adding rounds once its steps took this long (the last round is full)."""

_TORCH_AT_IMPORT = torch.get_num_threads()  # what the user did before is indistinguishable


def usable_cores(*, cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
                 proc: str | os.PathLike = "/proc") -> int:
    """The cores this process may run on: the fewest of its CPU affinity, its cgroup's CPU
    quota (rounded up) and a launcher's share (:data:`CORES_ENV`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    try:
        membership = (Path(proc) / "self" / "cgroup").read_text()
    except OSError:
        membership = ""
    quota = cgroup_cpu_quota(cgroup_root, membership)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota - 1e-9)))
    share = _positive(os.environ.get(CORES_ENV))
    return max(1, min(cores, share) if share else cores)


def cgroup_cpu_quota(root: str | os.PathLike, membership: str) -> float | None:
    """The tightest CPU quota, in cores, of this process's cgroup and its ancestors (v2
    ``cpu.max`` "QUOTA PERIOD", v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), or None.
    ``membership`` is ``/proc/self/cgroup``'s text; ``root`` where the hierarchies are
    mounted."""
    best: float | None = None
    for _, folder in cgroup_folders(root, membership, "cpu",
                                    ("cpu,cpuacct", "cpu", "cpuacct,cpu")):
        quota = _quota(folder)
        if quota is not None and (best is None or quota < best):
            best = quota
    return best


def _quota(folder: Path) -> float | None:
    try:
        if (folder / "cpu.max").is_file():
            limit, period = (folder / "cpu.max").read_text().split()[:2]
        else:
            limit = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        if limit == "max" or int(limit) <= 0:
            return None
        return int(limit) / int(period)
    except (OSError, ValueError):
        return None


def _positive(text: str | None) -> int | None:
    try:
        value = int(text) if text else 0
    except ValueError:
        return None
    return value if value > 0 else None


def check_thread_count(threads: int, where: str) -> int:
    """``threads`` if this machine can run that many intra-op threads: at most
    :data:`THREADS_PER_CORE` per logical core (``os.cpu_count()``); else a ``ValueError``
    naming ``where`` (the option or environment variable that asked)."""
    cores = os.cpu_count() or 1
    most = THREADS_PER_CORE * cores
    if threads > most:
        raise ValueError(f"{where} asks for {threads} CPU threads, more than this machine can "
                         f"run ({THREADS_PER_CORE} per logical core of its {cores}: threads "
                         "beyond the cores only wait for them, and too many cannot be "
                         f"started); give at most {most}, or none: flarepp then times the "
                         "fastest count")
    return threads


def set_threads(threads: int) -> None:
    """The user's ``--threads N``: this process's intra-op threads, and the setting of the
    worker processes it starts (:data:`THREADS_ENV`); nothing is measured."""
    check_thread_count(threads, "--threads")
    os.environ[THREADS_ENV] = str(threads)
    torch.set_num_threads(threads)


def user_threads() -> tuple[int, str] | None:
    """The thread count the user set and where (``--threads``, an environment variable,
    ``torch.set_num_threads``), or None where the choice is flarepp's; a count above the
    logical cores is refused (:func:`check_thread_count`)."""
    for name in (THREADS_ENV, *USER_ENVS):
        value = _positive(os.environ.get(name))
        if value:
            where = "--threads" if name == THREADS_ENV else name
            return check_thread_count(value, where), where
    if torch.get_num_threads() != _TORCH_AT_IMPORT and not _Applied.by_us:
        return torch.get_num_threads(), "torch.set_num_threads"
    return None


class _Applied:
    by_us = False  # whether the current count was set by a measurement of this process


def thread_budget(loader_workers: int = 0) -> int:
    """The intra-op threads a run may use: its usable cores less its DataLoader workers
    (each a process busy while the run computes), at least 1."""
    return max(1, usable_cores() - max(loader_workers, 0))


def limit_interop(budget: int) -> None:
    """At most ``budget`` inter-op threads (PyTorch starts one per core): they run beside
    the intra-op ones when work is forked, so they count in the same budget. PyTorch
    takes the setting only before its inter-op pool started, and never gives it back: a
    setting of the whole process, made by its entry point (``flarepp``'s compute commands,
    :func:`flarepp.cli.main`), not by a run."""
    if torch.get_num_interop_threads() > budget:
        try:
            torch.set_num_interop_threads(budget)
        except RuntimeError:  # the pool already runs
            pass


def candidates(budget: int) -> list[int]:
    """The counts worth timing up to ``budget``: 1, 2, 4, ... and ``budget`` itself."""
    out, n = [], 1
    while n < budget:
        out.append(n)
        n *= 2
    return [*out, budget]


def worker_share(workers: int, cores: int | None = None) -> int:
    """Each of ``workers`` processes' share of ``cores`` (default :func:`usable_cores`)."""
    return max(1, (cores or usable_cores()) // max(workers, 1))


@dataclass
class ThreadChoice:
    """What a run uses: ``threads``, ``how`` (``measured``, or why not: the user's setting,
    one core, ...) and the median step time measured at each count (seconds)."""

    threads: int
    how: str
    step_s: dict[int, float] = field(default_factory=dict)
    measurements: int = 0

    def line(self) -> str:
        if not self.step_s:
            return f"threads: {self.threads} ({self.how})"
        timed = ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in sorted(self.step_s.items()))
        return f"threads: {self.threads} (fastest of {timed} per step; {self.how})"

    def record(self) -> dict[str, Any]:
        return {"threads": self.threads, "how": self.how, "measurements": self.measurements,
                "step_s": {str(n): round(s, 6) for n, s in sorted(self.step_s.items())}}


class ThreadTuner:
    """Chooses the intra-op thread count from the run's own steps.

    Wrap each step in :meth:`step`: the first one (warm-up) runs as it is, the next
    ``rounds x len(counts)`` run at each candidate count in turn (interleaved, so a load
    that comes and goes hits every count alike), then the fastest median is kept and
    ``say`` is called with one line. After each round, counts more than twice as slow as
    the fastest are dropped, and the measurement ends once its steps took ``budget_s``.
    After that, the median of the last ``window`` steps (at least ``window_s`` seconds of
    them) is compared with that of the first ones at the chosen count; beyond a factor
    :data:`DRIFT` either way the counts are measured again (not sooner than four times the
    measurement's steps later, and twice that after a measurement that kept the count).
    The measured steps are real steps of the run; only the slower counts' extra time is
    spent.

    ``steps``: the steps the run will take, if known (too few to spare the measurement:
    nothing is measured). ``budget``: the most threads (default :func:`thread_budget`).
    ``skip``: why nothing is measured here (the count is left as it is). ``window`` and
    ``window_s``: the fewest steps and seconds of steps whose median judges a drift.
    """

    def __init__(self, *, steps: int | None = None, budget: int | None = None,
                 device: torch.device | str = "cpu", say: Callable[[str], None] | None = None,
                 rounds: int = ROUNDS, budget_s: float = BUDGET_S, window: int = 5,
                 window_s: float = WINDOW_S, skip: str | None = None) -> None:
        self.say = say or (lambda line: None)
        self.rounds, self.budget_s = rounds, budget_s
        self.window, self.window_s = window, window_s
        self.counts = candidates(budget or thread_budget())
        self._found = (torch.get_num_threads(), _Applied.by_us)  # what restore() puts back
        self.choice = ThreadChoice(torch.get_num_threads(), skip) if skip \
            else self._fixed(steps, torch.device(device))
        self._plan: list[int] = []
        self._times: dict[int, list[float]] = {}
        self._recent: list[float] = []
        self._reference: float | None = None
        self._since, self._cooldown, self._backoff = 0, 0, 1
        self._spent = 0.0
        self._warm = False
        if self.choice is None:
            self._start()
        else:
            self.say(self.choice.line())

    def _fixed(self, steps: int | None, device: torch.device) -> ThreadChoice | None:
        user = user_threads()
        if user is not None:
            torch.set_num_threads(user[0])
            return ThreadChoice(user[0], f"set by {user[1]}")
        threads = torch.get_num_threads()
        if device.type != "cpu":
            return ThreadChoice(threads, f"not measured: the run computes on {device.type}")
        if len(self.counts) == 1:
            apply_threads(self.counts[0])
            return ThreadChoice(self.counts[0], "the one usable core" if usable_cores() == 1
                                else "the whole thread budget")
        if steps is not None and steps < 4 * (1 + self.rounds * len(self.counts)):
            apply_threads(min(threads, self.counts[-1]))
            return ThreadChoice(torch.get_num_threads(),
                                f"not measured: {steps} step(s) of work")
        return None

    def restore(self) -> None:
        """Put back the intra-op thread count this tuner found (the count it chose, or the
        user's it applied, was the work's only)."""
        threads, by_us = self._found
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        _Applied.by_us = by_us

    def __enter__(self) -> "ThreadTuner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    @property
    def measuring(self) -> bool:
        return self.choice is None or bool(self._plan)

    def _prune(self) -> None:
        """After a whole round: stop once the budget is spent, and stop timing the counts
        more than twice as slow as the fastest (they cannot win; beside a busy process
        the slowest count is ten times slower, its steps the measurement's whole cost)."""
        if self._spent > self.budget_s:
            self._plan.clear()
            return
        medians = {n: statistics.median(t) for n, t in self._times.items() if t}
        best = min(medians.values())
        self._plan = [n for n in self._plan if medians[n] <= 2 * best]
        self._plan_counts = list(dict.fromkeys(self._plan))
        if len(self._plan_counts) < 2:  # nothing left to compare
            self._plan.clear()

    def _start(self) -> None:
        self._recent, self._reference = [], None
        self._plan_counts = list(self.counts)
        self._plan = [n for _ in range(self.rounds) for n in self.counts]
        self._times = {n: [] for n in self.counts}
        self._spent = 0.0
        self._warm = False

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time one step (and, while measuring, run it at the next candidate count)."""
        count = None
        if self._plan and self._warm:
            count = self._plan[0]
            apply_threads(count)
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        if self._plan:
            if not self._warm:
                self._warm = True
                return
            self._plan.pop(0)
            self._times[count].append(seconds)
            self._spent += seconds
            if self._plan and self._plan[0] == self._plan_counts[0]:  # a round is done
                self._prune()
            if not self._plan:
                self._choose()
            return
        if not self.choice.how.startswith("measured"):
            return
        # a window of at least window_s of steps: short steps on a shared machine are noisy
        window = max(self.window,
                     math.ceil(self.window_s / self.choice.step_s[self.choice.threads]))
        self._recent = [*self._recent[1 - window:], seconds]
        self._since += 1
        if len(self._recent) < window:
            return
        now = statistics.median(self._recent)
        if self._reference is None:  # the chosen count's steps, once warm
            self._reference = now
        elif self._since >= self._cooldown and not 1 / DRIFT <= now / self._reference <= DRIFT:
            self.say(f"threads: step time {now * 1e3:.1f} ms against {self._reference * 1e3:.1f}"
                     f" ms at {self.choice.threads} thread(s) before; measuring again")
            self._start()

    def _choose(self) -> None:
        medians = {n: statistics.median(t) for n, t in self._times.items() if t}
        best = min(medians, key=medians.get)
        apply_threads(best)
        measurements = (self.choice.measurements if self.choice else 0) + 1
        # measure again only after several times the steps this measurement took, and twice
        # as long after each measurement that kept the count (noise, not a new load)
        kept = self.choice is not None and self.choice.threads == best
        self._backoff = self._backoff * 2 if kept else 1
        self._since = 0
        self._cooldown = self._backoff * (4 * sum(len(t) for t in self._times.values()) + 1)
        self.choice = ThreadChoice(best, "measured" if measurements == 1
                                   else f"measured {measurements} times", medians, measurements)
        self.say(self.choice.line())


def apply_threads(threads: int) -> None:
    """Set the intra-op threads as flarepp's own choice (not a user's setting, which
    :func:`user_threads` would report and every later run would keep)."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    _Applied.by_us = True


def measure_threads(step: Callable[[], Any], *, budget: int | None = None,
                    rounds: int = ROUNDS, budget_s: float = BUDGET_S) -> ThreadChoice:
    """Call ``step`` (one step of a run: a forward, or a forward and backward) at each
    candidate count, interleaved, and keep the fastest (:class:`ThreadTuner`, for work
    that is not a loop of steps the caller controls, e.g. before an evaluation)."""
    tuner = ThreadTuner(budget=budget, rounds=rounds, budget_s=budget_s)
    while tuner.measuring:
        with tuner.step():
            step()
    return tuner.choice


__all__ = ["BUDGET_S", "CORES_ENV", "DRIFT", "ROUNDS", "SHARED_BY_RANKS", "THREADS_ENV",
           "THREADS_PER_CORE", "WINDOW_S", "ThreadChoice", "ThreadTuner", "apply_threads",
           "candidates", "cgroup_cpu_quota", "check_thread_count", "limit_interop",
           "measure_threads", "set_threads", "thread_budget", "usable_cores", "user_threads",
           "worker_share"]
