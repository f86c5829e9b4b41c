"""The fleet's replica supervision (pagedserve.fleet.supervisor) on stand-in replicas (``sleep`` processes in their
own process groups, a fake clock): a death is reported with the replica, pid and how it ended, its log is kept under
its own name, the restart waits out a backoff that doubles for short lives and resets after a long one, and the
launcher keeps its temporary log directory when a replica died."""
from __future__ import annotations

import io
import signal
import subprocess

import pytest

from support import wait_until

from pagedserve.fleet.launcher import _drop_logs
from pagedserve.fleet.local import Fleet
from pagedserve.fleet.supervisor import ReplicaSupervisor, RestartPolicy, describe_exit


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StandInFleet(Fleet):
    """A fleet whose replicas are ``sh`` processes that write a line to their log and sleep (or exit at once)."""

    exit_code: int | None = None

    def start_replica(self, i: int) -> None:
        script = f"echo started {i}; exit {self.exit_code}" if self.exit_code is not None else \
            f"echo started {i}; exec sleep 60"
        self.replicas[i] = self._spawn(["sh", "-c", script], f"replica-{i}.log")


@pytest.fixture
def fleet(tmp_path):
    f = StandInFleet(2, log_dir=tmp_path)
    for i in range(2):
        f.start_replica(i)
    yield f
    f.stop(grace_s=1)


def _wait_dead(proc: subprocess.Popen) -> None:
    proc.wait(10)


def test_describe_exit_names_the_signal_or_the_code():
    assert describe_exit(-signal.SIGKILL) == "killed by signal SIGKILL"
    assert describe_exit(-signal.SIGSEGV) == "killed by signal SIGSEGV"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(0) == "exited with code 0"


def test_a_sigkilled_replica_is_reported_its_log_kept_and_restarted_after_the_backoff(fleet):
    clock, out = FakeClock(), io.StringIO()
    sup = ReplicaSupervisor(fleet, RestartPolicy(initial_backoff_s=2, max_backoff_s=30, reset_after_s=60), out, clock)
    sup.poll()
    assert not sup.deaths and out.getvalue() == ""  # nothing died yet: nothing said
    victim = fleet.replicas[1]
    log = fleet.log_dir / "replica-1.log"
    wait_until(lambda: log.read_text() == "started 1\n", 10, "the stand-in replica never wrote its log")
    fleet.kill(1)
    sup.poll()
    assert [(d.replica, d.pid, d.how) for d in sup.deaths] == [(1, victim.pid, "killed by signal SIGKILL")]
    line = out.getvalue()
    assert line.startswith(f"pagedserve fleet: replica 1 (pid {victim.pid}, ") and "killed by signal SIGKILL" in line
    kept = fleet.log_dir / "replica-1.died-1.log"
    assert str(kept) in line and "restarting it in 2 s" in line
    assert kept.read_text() == "started 1\n" and not (fleet.log_dir / "replica-1.log").exists()
    assert fleet.replicas[0].poll() is None  # the other replica is untouched
    clock.now += 1.9
    sup.poll()
    assert fleet.replicas[1] is victim and sup.restarts == []  # still backing off
    clock.now += 0.2
    sup.poll()
    assert sup.restarts == [1] and fleet.replicas[1] is not victim and fleet.replicas[1].poll() is None
    assert f"replica 1 restarted (pid {fleet.replicas[1].pid})" in out.getvalue()


def test_backoff_doubles_for_short_lives_and_resets_after_a_long_one(fleet):
    clock, out = FakeClock(), io.StringIO()
    sup = ReplicaSupervisor(fleet, RestartPolicy(initial_backoff_s=1, max_backoff_s=5, reset_after_s=60), out, clock)
    waits = []
    for lived_s in (0, 0, 0, 0, 0, 61):
        clock.now += lived_s
        fleet.kill(0)
        sup.poll()
        waits.append(sup._restart_at[0] - clock.now)
        clock.now = sup._restart_at[0]
        sup.poll()  # restarted
    assert waits == [1, 2, 4, 5, 5, 1]
    assert [d.log.name for d in sup.deaths][:2] == ["replica-0.died-1.log", "replica-0.died-2.log"]
    assert all(d.log.is_file() for d in sup.deaths)


def test_an_exit_code_is_reported_as_such(tmp_path):
    f = StandInFleet(1, log_dir=tmp_path)
    f.exit_code = 3
    f.start_replica(0)
    try:
        _wait_dead(f.replicas[0])
        out = io.StringIO()
        sup = ReplicaSupervisor(f, RestartPolicy(), out, FakeClock())
        sup.poll()
        assert sup.deaths[0].how == "exited with code 3" and "died: exited with code 3" in out.getvalue()
    finally:
        f.stop(grace_s=1)


def test_the_temporary_log_dir_is_kept_when_a_replica_died(capsys):
    fleet = Fleet(1)
    try:
        _drop_logs(fleet, 0, died=True)
        assert fleet.log_dir.is_dir() and f"logs kept in {fleet.log_dir}" in capsys.readouterr().err
    finally:
        fleet.remove_temporary_logs()
