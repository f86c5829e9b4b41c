"""`pagedserve fleet` leaves no process behind: SIGINT (Ctrl-C) and SIGTERM stop the router and every replica
and exit 0; a launcher killed with SIGKILL takes its children with it (PR_SET_PDEATHSIG). It prints a ready line
once everything answers /health, and removes the log directory at exit when it made it (a given one is kept). A
replica SIGKILLed under load is reported at once, restarted, back taking traffic through the router within 30 s,
and its log is kept."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from fleet_helpers import alive, children_of, write_tiny_llama
from support import free_port, wait_until

from pagedserve.fleet.local import free_port_pair

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm_router")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-cli"))


def _start(tiny_model: str, num_replicas: int, log_dir, router_port: int | None = None,
           http_base_port: int | None = None) -> tuple[subprocess.Popen, list[int], Path]:
    """The launcher, its children and its log directory (``log_dir`` None: the launcher's temporary default)."""
    router_port = router_port or free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "fleet", "-n", str(num_replicas), "--policy", "round_robin",
           "--router-port", str(router_port), "--prometheus-port", str(free_port()),
           "--http-base-port", str(http_base_port or free_port_pair()), "--grpc-base-port", str(free_port_pair()),
           *(["--log-dir", str(log_dir)] if log_dir is not None else []),
           "--", "--model", tiny_model, "--embedding-model", "none", "--device", "cpu", "--dtype", "float32",
           "--attention-backend", "torch", "--shutdown-grace-s", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # the addresses, then the ready line, once everything answers /health
        lines.append(line)
        if line.startswith("pagedserve fleet: ready"):
            break
    assert proc.poll() is None, "".join(lines)
    assert lines[0].startswith("pagedserve fleet: starting") and " logs in " in lines[0], lines
    assert any(line.startswith("gRPC, round robin") for line in lines), lines
    assert httpx.get(f"http://127.0.0.1:{router_port}/health", timeout=10).status_code == 200
    children = children_of(proc.pid)
    assert len(children) == num_replicas + 1, (children, lines)  # the replicas and the router
    return proc, children, Path(lines[0].split(" logs in ", 1)[1].strip())


@pytest.mark.parametrize("sig, num_replicas, given_log_dir", [(signal.SIGINT, 2, True), (signal.SIGTERM, 1, False)],
                         ids=["SIGINT-given-log-dir", "SIGTERM-temporary-log-dir"])
def test_a_signal_stops_everything(tiny_model, tmp_path, sig, num_replicas, given_log_dir):
    proc, children, log_dir = _start(tiny_model, num_replicas, tmp_path if given_log_dir else None)
    assert log_dir.is_dir() and (log_dir / "router.log").is_file()
    assert (log_dir == tmp_path) == given_log_dir
    proc.send_signal(sig)
    assert proc.wait(60) == 0, proc.stdout.read()
    assert not [pid for pid in children if alive(pid)]
    assert log_dir.is_dir() == given_log_dir  # the launcher's own temporary directory is gone


def test_children_die_with_a_killed_launcher(tiny_model, tmp_path):
    proc, children, _ = _start(tiny_model, 1, tmp_path)
    proc.kill()
    proc.wait(10)
    start = time.monotonic()
    wait_until(lambda: not [pid for pid in children if alive(pid)], 20, "children outlived the launcher")
    assert time.monotonic() - start < 20


def _pid_serving(pids: list[int], http_port: int) -> int:
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"--http-port" in argv and argv[argv.index(b"--http-port") + 1] == str(http_port).encode():
            return pid
    raise AssertionError(f"no child serves HTTP port {http_port}")


def _served(http_url: str) -> float:
    try:
        text = httpx.get(http_url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pagedserve:e2e_request_latency_seconds_count"))


def test_a_sigkilled_replica_is_reported_restarted_and_back_in_the_router(tiny_model):
    router_port, http_base = free_port(), free_port_pair()
    proc, children, log_dir = _start(tiny_model, 2, None, router_port=router_port, http_base_port=http_base)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    stop, outcomes = threading.Event(), []

    def load() -> None:  # round robin over both replicas until told to stop
        with httpx.Client(base_url=f"http://127.0.0.1:{router_port}", timeout=60) as client:
            while not stop.is_set():
                r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
                outcomes.append(r.status_code)
    workers = [threading.Thread(target=load) for _ in range(2)]
    try:
        for w in workers:
            w.start()
        wait_until(lambda: outcomes.count(200) >= 4, 60, lambda: f"no load through the router: {outcomes[-4:]}")
        victim = _pid_serving(children, http_base + 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: any(f"replica 1 (pid {victim}," in line for line in lines), 5, "the death went unreported")
        death = next(line for line in lines if f"replica 1 (pid {victim}," in line)
        assert "died: killed by signal SIGKILL" in death and str(log_dir / "replica-1.died-1.log") in death, death
        replica_url = f"http://127.0.0.1:{http_base + 1}"
        wait_until(lambda: _served(replica_url) >= 2, 30, lambda: "the restarted replica took no traffic in 30 s: " + "".join(lines))
        assert time.monotonic() - killed_at <= 30
        # the router's own health check may send it traffic a poll before the launcher's line is printed
        wait_until(lambda: any(line.startswith("pagedserve fleet: replica 1 is back") for line in lines), 5,
                   lambda: "no 'is back' line: " + "".join(lines))
        assert _pid_serving(children_of(proc.pid), http_base + 1) != victim
    finally:
        stop.set()
        for w in workers:
            w.join(60)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "".join(lines)
    assert outcomes.count(200) >= 8 and set(outcomes) <= {200, 502, 503}, outcomes
    # a replica died: the launcher's temporary log directory is kept, with the dead process's log in it
    assert (log_dir / "replica-1.died-1.log").stat().st_size > 0 and (log_dir / "replica-1.log").is_file()
    shutil.rmtree(log_dir)
