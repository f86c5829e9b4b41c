"""Targets naming several replicas get round_robin; a single address keeps gRPC's default policy."""
from __future__ import annotations

import json

import pytest

from pagedserve_client import _convert
from pagedserve_client.targets import channel_target


@pytest.mark.parametrize("target, expected", [
    ("127.0.0.1:5001", ("127.0.0.1:5001", False)),
    ("localhost:50051", ("localhost:50051", False)),
    ("dns:///pagedserve-grpc.default.svc.cluster.local:50051",
     ("dns:///pagedserve-grpc.default.svc.cluster.local:50051", True)),
    ("ipv4:127.0.0.1:5001,127.0.0.1:5002", ("ipv4:127.0.0.1:5001,127.0.0.1:5002", True)),
    ("127.0.0.1:5001, 127.0.0.1:5002", ("ipv4:127.0.0.1:5001,127.0.0.1:5002", True)),
    ("[::1]:5001,[::1]:5002", ("ipv6:[::1]:5001,[::1]:5002", True)),
])
def test_channel_target(target, expected):
    assert channel_target(target) == expected


@pytest.mark.parametrize("target", ["localhost:1,localhost:2", "127.0.0.1:1,[::1]:2", "127.0.0.1,127.0.0.2:5"])
def test_lists_of_names_or_mixed_families_are_refused(target):
    with pytest.raises(ValueError, match="target"):
        channel_target(target)


def test_round_robin_service_config_keeps_the_retry_policy():
    plain = json.loads(_convert.service_config_json())
    balanced = json.loads(_convert.service_config_json(round_robin=True))
    assert "loadBalancingConfig" not in plain
    assert balanced["loadBalancingConfig"] == [{"round_robin": {}}]
    assert balanced["methodConfig"] == plain["methodConfig"]
    options = dict(_convert.channel_options([], round_robin=True))
    assert json.loads(options["grpc.service_config"])["loadBalancingConfig"] == [{"round_robin": {}}]
