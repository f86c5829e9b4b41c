"""`pagedserve fleet` leaves no process behind: SIGINT (Ctrl-C) and SIGTERM stop the router and every replica
and exit 0; a launcher killed with SIGKILL takes its children with it (PR_SET_PDEATHSIG)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from fleet_helpers import alive, children_of, port_pair, write_tiny_llama
from support import free_port, wait_until

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm_router")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-cli"))


def _start(tiny_model: str, num_replicas: int, log_dir) -> tuple[subprocess.Popen, list[int]]:
    cmd = [sys.executable, "-m", "pagedserve.cli", "fleet", "-n", str(num_replicas), "--policy", "round_robin",
           "--router-port", str(free_port()), "--prometheus-port", str(free_port()),
           "--http-base-port", str(port_pair()), "--grpc-base-port", str(port_pair()), "--log-dir", str(log_dir),
           "--", "--model", tiny_model, "--embedding-model", "none", "--device", "cpu", "--dtype", "float32",
           "--attention-backend", "torch", "--shutdown-grace-s", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # the addresses are printed once the router is up
        lines.append(line)
        if line.startswith("gRPC, round robin"):
            break
    assert proc.poll() is None, "".join(lines)
    children = children_of(proc.pid)
    assert len(children) == num_replicas + 1, (children, lines)  # the replicas and the router
    return proc, children


@pytest.mark.parametrize("sig, num_replicas", [(signal.SIGINT, 2), (signal.SIGTERM, 1)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_everything(tiny_model, tmp_path, sig, num_replicas):
    proc, children = _start(tiny_model, num_replicas, tmp_path)
    proc.send_signal(sig)
    assert proc.wait(60) == 0, proc.stdout.read()
    assert not [pid for pid in children if alive(pid)]


def test_children_die_with_a_killed_launcher(tiny_model, tmp_path):
    proc, children = _start(tiny_model, 1, tmp_path)
    proc.kill()
    proc.wait(10)
    start = time.monotonic()
    wait_until(lambda: not [pid for pid in children if alive(pid)], 20, "children outlived the launcher")
    assert time.monotonic() - start < 20
