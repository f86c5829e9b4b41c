"""Supervision of a local fleet's replicas: a replica that dies is reported at once and restarted with backoff.

What a process supervisor (systemd's ``Restart=on-failure``, supervisord, runit) does for a service, done by the
``pagedserve fleet`` launcher for its replicas:

- each :meth:`ReplicaSupervisor.poll` (the launcher calls it every ``poll_interval_s``) reaps the replicas that
  exited while the fleet runs and prints one line per death naming the replica, its pid and how it ended (exit code,
  or the signal by name: ``killed by signal SIGKILL``), with the path of its log;
- the dead process's log is kept under a name of its own (``replica-<i>.died-<n>.log``, n counting that replica's
  deaths) so the restarted process's ``replica-<i>.log`` does not bury it, and the launcher keeps its temporary log
  directory at exit when any process died;
- the replica is started again after a backoff: ``initial_backoff_s`` for the first death, doubled for each death
  that follows a short life (up less than ``reset_after_s``), at most ``max_backoff_s``; a replica that stayed up
  ``reset_after_s`` starts from ``initial_backoff_s`` again (systemd's ``RestartSec`` with ``RestartSteps``);
- once the restarted process answers ``/health`` a line says it is back. The router (health checks every second,
  :data:`pagedserve.fleet.router.SIDECAR_SETTINGS`) sends it traffic again by itself: its URL did not change.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from .local import Fleet, http_ok, signal_group


def describe_exit(returncode: int) -> str:
    """How a process ended, from ``Popen.returncode``: ``"exited with code 3"`` or ``"killed by signal SIGKILL"``
    (negative codes are signals, as subprocess reports them)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return f"killed by signal {name}"


@dataclass(frozen=True)
class Death:
    """One replica death: which replica, its pid, how it ended, when (``time.monotonic()`` seconds) and the kept log."""

    replica: int
    pid: int
    how: str
    at: float
    log: Path


@dataclass
class RestartPolicy:
    """Backoff before a dead replica is started again (seconds)."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    reset_after_s: float = 60.0

    def __post_init__(self):
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("RestartPolicy: need 0 <= initial_backoff_s <= max_backoff_s")

    def next_backoff(self, previous_s: float | None, lived_s: float) -> float:
        """The wait before the next start, given the previous wait (None: first death) and how long it was up."""
        if previous_s is None or lived_s >= self.reset_after_s:
            return self.initial_backoff_s
        return min(self.max_backoff_s, max(previous_s * 2, self.initial_backoff_s, 1e-3))


@dataclass
class ReplicaSupervisor:
    """Watches ``fleet``'s replicas (started by :meth:`Fleet.start`) and restarts the ones that die.

    Args:
        fleet: the running fleet; its ``replicas[i]`` are replaced by the restarted processes.
        policy: the restart backoff.
        out: where the death / restart / back lines go (the launcher's stderr).
        clock: monotonic seconds (tests pass a fake one).
    """

    fleet: Fleet
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    out: TextIO = sys.stderr
    clock: Callable[[], float] = time.monotonic
    deaths: list[Death] = field(default_factory=list, init=False)
    restarts: list[int] = field(default_factory=list, init=False)

    def __post_init__(self):
        now = self.clock()
        n = self.fleet.num_replicas
        self._started_at = [now] * n
        self._backoff: list[float | None] = [None] * n
        self._restart_at: dict[int, float] = {}
        self._awaiting_health: set[int] = set()

    def poll(self) -> None:
        """Reap dead replicas (report, keep the log, schedule the restart), start the ones whose backoff ran out,
        and report restarted replicas that answer ``/health``. Never blocks longer than one short health probe per
        restarted replica."""
        now = self.clock()
        for i, proc in enumerate(self.fleet.replicas):
            if i in self._restart_at:
                if now >= self._restart_at[i]:
                    self._restart(i, now)
                continue
            if proc is None:
                continue
            returncode = proc.poll()
            if returncode is None:
                if i in self._awaiting_health and http_ok(self.fleet.http_url(i) + "/health", timeout_s=0.5):
                    self._awaiting_health.discard(i)
                    self._say(f"replica {i} is back (pid {proc.pid}; answers {self.fleet.http_url(i)}/health)")
                continue
            self._on_death(i, proc.pid, returncode, now)

    def _on_death(self, i: int, pid: int, returncode: int, now: float) -> None:
        signal_group(self.fleet.replicas[i], signal.SIGKILL)  # whatever of its process group is left
        self._awaiting_health.discard(i)
        count = sum(d.replica == i for d in self.deaths) + 1
        log = self.fleet.keep_log(f"replica-{i}.log", f"replica-{i}.died-{count}.log")
        death = Death(i, pid, describe_exit(returncode), now, log)
        self.deaths.append(death)
        backoff = self.policy.next_backoff(self._backoff[i], now - self._started_at[i])
        self._backoff[i] = backoff
        self._restart_at[i] = now + backoff
        self._say(f"replica {i} (pid {pid}, {self.fleet.http_url(i)}) died: {death.how}; its log is kept in {log}; "
                  f"restarting it in {backoff:g} s (death {count} of this replica)")

    def _restart(self, i: int, now: float) -> None:
        del self._restart_at[i]
        self.fleet.start_replica(i)
        self._started_at[i] = now
        self.restarts.append(i)
        self._awaiting_health.add(i)
        self._say(f"replica {i} restarted (pid {self.fleet.replicas[i].pid})")

    def _say(self, line: str) -> None:
        print(f"pagedserve fleet: {line}", file=self.out, flush=True)
