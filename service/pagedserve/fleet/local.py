"""``pagedserve fleet`` (``make fleet N=2``): N replicas on loopback ports and vllm-router in front, one command.

Replica ``i`` serves gRPC on ``--grpc-base-port + i`` and HTTP on ``--http-base-port + i``; the router listens on
``--router-port`` with the settings of ``pagedserve route``. Each child runs in a process group of its own, with
the kernel told to SIGKILL it if this process dies (``PR_SET_PDEATHSIG``); SIGINT (Ctrl-C) or SIGTERM here stops
the router, then the replicas (SIGTERM to each group, SIGKILL to what is left after ``grace_s``), so no process
outlives the fleet. Logs go to one file per process in ``--log-dir``; without one, in a new temporary directory
that is removed at exit (kept when a process failed or a replica died, so its log can be read). Once every
replica's ``/health`` and the router's answer, it prints a ``pagedserve fleet: ready`` line. From then on a replica
that dies is reported at once (which one, its pid, exit code or signal, its kept log) and restarted with backoff
(:mod:`pagedserve.fleet.supervisor`).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether GET ``url`` answers 200 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def free_port_pair(host: str = "127.0.0.1", attempts: int = 100) -> int:
    """A port p with p and p + 1 free on ``host`` a moment ago (a two-replica fleet's base port: replica i uses
    base + i). Raises RuntimeError when ``attempts`` tries found no such pair."""
    for _ in range(attempts):
        with socket.socket() as a:
            a.bind((host, 0))
            p = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind((host, p + 1))
                return p
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


@dataclass
class Fleet:
    """N pagedserve replicas and the router, as child processes of this one.

    Args:
        num_replicas: N >= 1.
        serve_args: extra ``pagedserve serve`` arguments for every replica (model, device, ...).
        http_base_port, grpc_base_port: replica i's ports are these + i.
        router_port, prometheus_port: the router's API and its own metrics.
        policy: the router's load-balancing policy.
        router_args: extra vllm-router arguments (after ``pagedserve route``'s own settings).
        log_dir: one ``replica-<i>.log`` / ``router.log`` per process (default: a new temporary directory, see
            :meth:`remove_temporary_logs`).
    """

    num_replicas: int
    serve_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    http_base_port: int = 8101
    grpc_base_port: int = 50151
    router_port: int = 8080
    prometheus_port: int = 29000
    policy: str = "cache_aware"
    router_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    replicas: list[subprocess.Popen | None] = field(default_factory=list, init=False)
    router: subprocess.Popen | None = field(default=None, init=False)

    def __post_init__(self):
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        self.temporary_log_dir = self.log_dir is None
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="pagedserve-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.replicas = [None] * self.num_replicas

    # ---- addresses ---------------------------------------------------------------------------------------------
    def http_url(self, i: int) -> str:
        return f"http://{self.host}:{self.http_base_port + i}"

    def grpc_target(self, i: int) -> str:
        return f"{self.host}:{self.grpc_base_port + i}"

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"

    @property
    def worker_urls(self) -> list[str]:
        return [self.http_url(i) for i in range(self.num_replicas)]

    # ---- processes ---------------------------------------------------------------------------------------------
    def _spawn(self, command: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.log_dir / log_name, "ab")
        try:
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    process_group=0, preexec_fn=_die_with_parent)
        finally:
            log.close()

    def start_replica(self, i: int) -> None:
        """Start replica ``i`` (again, after :meth:`kill`) on its ports."""
        command = [sys.executable, "-m", "pagedserve.cli", "serve", "--host", self.host,
                   "--port", str(self.grpc_base_port + i), "--http-port", str(self.http_base_port + i),
                   *self.serve_args]
        self.replicas[i] = self._spawn(command, f"replica-{i}.log")

    def start_router(self) -> None:
        command = [sys.executable, "-m", "pagedserve.cli", "route", "--host", self.host,
                   "--port", str(self.router_port), "--policy", self.policy, "--prometheus-host", self.host,
                   "--prometheus-port", str(self.prometheus_port), "--worker-urls", *self.worker_urls,
                   "--", *self.router_args]
        self.router = self._spawn(command, "router.log")

    def start(self, timeout_s: float = 600) -> Fleet:
        """Start every replica, wait for their ``/health``, then start the router and wait for it; on return every
        replica's ``/health`` and the router's answer 200. Raises RuntimeError (naming the log) when a process
        exits or is not ready within ``timeout_s``."""
        for i in range(self.num_replicas):
            self.start_replica(i)
        deadline = time.monotonic() + timeout_s
        for i in range(self.num_replicas):
            self.wait_replica(i, deadline - time.monotonic())
        self.start_router()
        self._wait(lambda: http_ok(self.router_url + "/health"), self.router, "router.log",
                   deadline - time.monotonic())
        for i in range(self.num_replicas):  # still up now that the router is
            self.wait_replica(i, deadline - time.monotonic())
        return self

    def wait_replica(self, i: int, timeout_s: float) -> None:
        self._wait(lambda: http_ok(self.http_url(i) + "/health"), self.replicas[i], f"replica-{i}.log", timeout_s)

    def _wait(self, ready, proc: subprocess.Popen | None, log_name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc is None or proc.poll() is not None:
                raise RuntimeError(f"{log_name[:-4]} exited; see {self.log_dir / log_name}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{log_name[:-4]} not ready in time; see {self.log_dir / log_name}")
            time.sleep(0.2)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to replica ``i``'s process group and reap it."""
        proc = self.replicas[i]
        if proc is not None:
            signal_group(proc, sig)
            proc.wait()

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the router, then the replicas: SIGTERM to each process group, SIGKILL to what is left after
        ``grace_s``. Safe to call twice."""
        for group in ([self.router], self.replicas):
            procs = [p for p in group if p is not None]
            for p in procs:
                signal_group(p, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                signal_group(p, signal.SIGKILL)  # whatever of the group is left (children included)
                p.wait()

    def keep_log(self, name: str, kept_name: str) -> Path:
        """Rename the log ``name`` to ``kept_name`` (so a restarted process's log does not bury it) and return the
        kept path; when ``name`` does not exist, the path it would have had."""
        kept = self.log_dir / kept_name
        try:
            (self.log_dir / name).rename(kept)
        except FileNotFoundError:
            pass
        return kept

    def remove_temporary_logs(self) -> bool:
        """Delete the log directory if this fleet made it (no ``log_dir`` given); a given one is kept. Returns
        whether it was removed."""
        if not self.temporary_log_dir:
            return False
        shutil.rmtree(self.log_dir, ignore_errors=True)
        return True

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.stop()
        if exc_type is None:  # after a failure the logs say why: kept
            self.remove_temporary_logs()


def signal_group(proc: subprocess.Popen | None, sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (children are started with ``process_group=0``); a group
    that is gone already is not an error."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)  # the child leads its own group (process_group=0)
    except (ProcessLookupError, PermissionError):
        pass
