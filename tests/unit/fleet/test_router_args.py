"""`pagedserve route` builds vllm-router's command line: the sidecar settings, workers or pod discovery, and
pass-through flags that win; bad arguments are refused naming the flag."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve import cli
from pagedserve.fleet import router


def _argv(*args: str) -> list[str]:
    return router.router_argv(cli.build_parser({}).parse_args(["route", *args]))


def _value(argv: list[str], flag: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # the last occurrence wins in argparse


def test_worker_urls_and_sidecar_settings():
    argv = _argv("--worker-urls", "http://a:8000", "http://b:8000", "--policy", "round_robin")
    i = argv.index("--worker-urls")
    assert argv[i + 1:i + 3] == ["http://a:8000", "http://b:8000"]
    assert _value(argv, "--policy") == "round_robin"
    assert _value(argv, "--health-check-interval-secs") == "1"
    assert router.DOWN_WITHIN_S <= 10  # seconds, not the router's default minutes


def test_passthrough_flags_come_last_and_win():
    argv = _argv("--worker-urls", "http://a:8000", "--", "--health-check-interval-secs", "3")
    assert _value(argv, "--health-check-interval-secs") == "3"


def test_pod_discovery():
    argv = _argv("--selector", "app.kubernetes.io/name=pagedserve", "--service-discovery-namespace", "ml")
    assert "--service-discovery" in argv and "--worker-urls" not in argv
    assert _value(argv, "--selector") == "app.kubernetes.io/name=pagedserve"
    assert _value(argv, "--service-discovery-port") == "8000" and _value(argv, "--service-discovery-namespace") == "ml"


@pytest.mark.parametrize("args, message", [((), "either"), (("--worker-urls", "a:8000"), "--worker-urls"),
                                           (("--worker-urls", "http://a", "--selector", "x=y"), "either")])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        _argv(*args)


def test_the_router_accepts_every_setting():
    """vllm-router's own parser takes the whole command line (a renamed flag would fail here)."""
    pytest.importorskip("vllm_router")
    from vllm_router.launch_router import parse_router_args

    parsed = parse_router_args(_argv("--worker-urls", "http://a:8000", "--port", "9000"))
    assert parsed.port == 9000 and parsed.worker_urls == ["http://a:8000"]
    assert parsed.health_check_interval_secs == 1 and parsed.cb_failure_threshold == 2


def test_route_exits_2_on_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "pagedserve.cli", "route"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--worker-urls" in out.stderr
