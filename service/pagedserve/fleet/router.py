"""``pagedserve route``: vllm-router (the ``router`` extra) in front of pagedserve replicas.

The router's own defaults suit long-lived GPU servers: a health check every 60 s, so a dead worker is noticed
only after minutes. A sidecar fleet restarts replicas often, so this command checks every second and gives up on
a worker after two failed checks, opens a worker's circuit after two failed requests and tries it again after 5 s,
and retries a failed request (on another worker when the policy picks one) up to three times. Every setting can
be overridden: arguments after ``--`` go to vllm-router unchanged, after ours (argparse: the last one wins).

Workers are given as URLs of their OpenAI-compatible HTTP port (``--worker-urls http://10.0.0.5:8000 ...``) or
found in Kubernetes by label (``--selector app.kubernetes.io/name=pagedserve --service-discovery-port 8000``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

POLICIES = ("cache_aware", "round_robin", "power_of_two", "consistent_hash", "random", "sticky_least_loaded")
# vllm-router flag -> value for a fleet of sidecar replicas (see the module docstring).
SIDECAR_SETTINGS: dict[str, str] = {
    "--health-check-interval-secs": "1",
    "--health-check-timeout-secs": "2",
    "--health-failure-threshold": "2",
    "--health-success-threshold": "1",
    "--worker-startup-timeout-secs": "600",
    "--worker-startup-check-interval": "1",
    "--cb-failure-threshold": "2",
    "--cb-success-threshold": "1",
    "--cb-timeout-duration-secs": "5",
    "--cb-window-duration-secs": "10",
    "--retry-max-retries": "3",
    "--retry-initial-backoff-ms": "50",
    "--retry-max-backoff-ms": "1000",
    "--request-timeout-secs": "600",
}
# Seconds the router takes at most to stop sending to a dead worker: failed checks x (interval + timeout).
DOWN_WITHIN_S = int(SIDECAR_SETTINGS["--health-failure-threshold"]) * (
    int(SIDECAR_SETTINGS["--health-check-interval-secs"]) + int(SIDECAR_SETTINGS["--health-check-timeout-secs"]))


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``route`` subcommand on ``sub`` (the ``pagedserve`` subparsers)."""
    p = sub.add_parser("route", help="start vllm-router in front of pagedserve replicas",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__,
                       epilog="Arguments after -- go to vllm-router unchanged (`vllm-router --help` lists them).")
    p.add_argument("--worker-urls", nargs="+", default=[], metavar="URL",
                   help="replicas' HTTP API URLs (http://host:http-port)")
    p.add_argument("--host", default="0.0.0.0", help="address the router binds")
    p.add_argument("--port", type=int, default=8080, help="router port (OpenAI-compatible HTTP)")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware",
                   help="load-balancing policy; cache_aware matches prompt token prefixes via /render")
    p.add_argument("--prometheus-host", default="0.0.0.0", help="address of the router's own /metrics")
    p.add_argument("--prometheus-port", type=int, default=29000, help="port of the router's own /metrics")
    p.add_argument("--selector", nargs="+", default=[], metavar="KEY=VALUE",
                   help="Kubernetes pod discovery by these labels (instead of --worker-urls)")
    p.add_argument("--service-discovery-port", type=int, default=8000, help="discovered pods' HTTP API port")
    p.add_argument("--service-discovery-namespace", default=None, help="namespace to watch (default: all)")
    p.add_argument("--api-key", default=None, help="API key the router sends to the replicas")
    p.add_argument("router_args", nargs=argparse.REMAINDER, help="-- then vllm-router arguments")
    p.set_defaults(run=run)
    return p


def router_argv(args: argparse.Namespace) -> list[str]:
    """vllm-router's command-line arguments for parsed ``route`` arguments.

    Raises ValueError when neither (or both) of ``worker_urls`` and ``selector`` is given, or a URL is not http(s).
    """
    if bool(args.worker_urls) == bool(args.selector):
        raise ValueError("give the replicas either as --worker-urls or as a Kubernetes --selector (one of them)")
    bad = [u for u in args.worker_urls if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"--worker-urls: {bad[0]!r} is not an http:// or https:// URL")
    argv = ["--host", args.host, "--port", str(args.port), "--policy", args.policy,
            "--prometheus-host", args.prometheus_host, "--prometheus-port", str(args.prometheus_port)]
    if args.worker_urls:
        argv += ["--worker-urls", *args.worker_urls]
    else:
        argv += ["--service-discovery", "--selector", *args.selector,
                 "--service-discovery-port", str(args.service_discovery_port)]
        if args.service_discovery_namespace:
            argv += ["--service-discovery-namespace", args.service_discovery_namespace]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    for flag, value in SIDECAR_SETTINGS.items():
        argv += [flag, value]
    extra = list(args.router_args)
    return argv + (extra[1:] if extra[:1] == ["--"] else extra)


def router_command(argv: list[str]) -> list[str]:
    """The command that runs vllm-router with ``argv`` in this Python. Raises RuntimeError when the ``router``
    extra is not installed."""
    if importlib.util.find_spec("vllm_router") is None:
        raise RuntimeError("vllm-router is not installed: pip install 'pagedserve[router]'")
    return [sys.executable, "-m", "vllm_router.launch_router", *argv]


def run(args: argparse.Namespace) -> int:
    """Replace this process by vllm-router (signals then reach the router itself). Returns 2 on a bad argument,
    1 when the router is not installed; otherwise does not return."""
    try:
        command = router_command(router_argv(args))
    except ValueError as exc:
        print(f"pagedserve route: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"pagedserve route: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)
    return 0  # not reached
