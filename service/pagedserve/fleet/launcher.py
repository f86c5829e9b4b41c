"""The ``pagedserve fleet`` command: start a :class:`~pagedserve.fleet.local.Fleet`, print its addresses and the
ready line, supervise its replicas (:class:`~pagedserve.fleet.supervisor.ReplicaSupervisor`) until SIGINT/SIGTERM
or the router exits, then stop everything and drop (or keep) the logs."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from . import local
from .local import Fleet
from .router import POLICIES
from .supervisor import ReplicaSupervisor


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``fleet`` subcommand on ``sub`` (the ``pagedserve`` subparsers)."""
    p = sub.add_parser("fleet", help="run N replicas and vllm-router on loopback ports (development)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=local.__doc__,
                       epilog="Arguments after -- go to every `pagedserve serve` replica.")
    p.add_argument("--replicas", "-n", type=int, default=2, help="number of replicas")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware", help="the router's policy")
    p.add_argument("--router-port", type=int, default=8080, help="the router's OpenAI API port")
    p.add_argument("--prometheus-port", type=int, default=29000, help="the router's own /metrics")
    p.add_argument("--http-base-port", type=int, default=8101, help="replica i's HTTP port is this + i")
    p.add_argument("--grpc-base-port", type=int, default=50151, help="replica i's gRPC port is this + i")
    p.add_argument("--log-dir", default=argparse.SUPPRESS,
                   help="per-process logs, kept (default: a new temporary directory, removed at exit unless a "
                        "process failed)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `pagedserve serve` arguments")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Start the fleet, print its addresses, run until SIGINT/SIGTERM or the router exits, then stop it all.
    While it runs, a replica that dies is reported and restarted with backoff (:mod:`pagedserve.fleet.supervisor`).
    Returns 0 after a signal, 1 when a process failed to start or the router died."""

    serve_args = list(args.serve_args)
    fleet = Fleet(args.replicas, serve_args[1:] if serve_args[:1] == ["--"] else serve_args,
                  http_base_port=args.http_base_port, grpc_base_port=args.grpc_base_port,
                  router_port=args.router_port, prometheus_port=args.prometheus_port, policy=args.policy,
                  log_dir=Path(args.log_dir) if getattr(args, "log_dir", None) else None)
    stop, started = threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        stop.set()
        if not started.is_set():  # still starting: leave start() at once
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    status, supervisor = 0, None
    try:
        print(f"pagedserve fleet: starting {args.replicas} replicas; logs in {fleet.log_dir}", flush=True)
        fleet.start()
        started.set()
        print(f"router  {fleet.router_url}  (policy {args.policy}; OpenAI API at {fleet.router_url}/v1)", flush=True)
        for i in range(args.replicas):
            print(f"replica {i}  http {fleet.http_url(i)}  grpc {fleet.grpc_target(i)}", flush=True)
        print(f"gRPC, round robin over all: pagedserve-client --target "
              f"ipv4:{','.join(fleet.grpc_target(i) for i in range(args.replicas))} ...", flush=True)
        print(f"pagedserve fleet: ready ({args.replicas} replicas and the router answer /health)", flush=True)
        supervisor = ReplicaSupervisor(fleet)
        while not stop.wait(0.5):
            supervisor.poll()
            if fleet.router.poll() is not None:
                print(f"pagedserve fleet: the router exited; see {fleet.log_dir / 'router.log'}", file=sys.stderr)
                status = 1
                break
    except RuntimeError as exc:
        print(f"pagedserve fleet: error: {exc}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:
        pass
    finally:
        fleet.stop()
        _drop_logs(fleet, status, died=bool(supervisor and supervisor.deaths))
    return status


def _drop_logs(fleet: Fleet, status: int, died: bool = False) -> None:
    """Remove the launcher's temporary log directory after a clean run; keep it (and say where) when a process
    failed or a replica died while the fleet ran."""
    if status == 0 and not died and fleet.remove_temporary_logs():
        print(f"pagedserve fleet: removed {fleet.log_dir}", flush=True)
    elif fleet.temporary_log_dir:
        print(f"pagedserve fleet: logs kept in {fleet.log_dir}", file=sys.stderr, flush=True)
