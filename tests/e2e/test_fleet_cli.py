"""`pagedserve fleet` leaves no process behind: SIGINT (Ctrl-C) and SIGTERM stop the router and every replica
and exit 0; a launcher killed with SIGKILL takes its children with it (PR_SET_PDEATHSIG). It prints a ready line
once everything answers /health, and removes the log directory at exit when it made it (a given one is kept)."""
from __future__ import annotations

import signal
import subprocess
import sys
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


def _start(tiny_model: str, num_replicas: int, log_dir) -> tuple[subprocess.Popen, list[int], Path]:
    """The launcher, its children and its log directory (``log_dir`` None: the launcher's temporary default)."""
    router_port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "fleet", "-n", str(num_replicas), "--policy", "round_robin",
           "--router-port", str(router_port), "--prometheus-port", str(free_port()),
           "--http-base-port", str(free_port_pair()), "--grpc-base-port", str(free_port_pair()),
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
