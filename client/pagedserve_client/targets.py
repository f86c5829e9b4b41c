"""gRPC targets that name several replicas, and the client-side load balancing they get.

gRPC picks the first address that works (``pick_first``) unless the service config asks otherwise, so a target
that resolves to several replicas would send every call to one of them. These targets get the ``round_robin``
policy instead (a call goes to the next ready replica; a replica that goes away leaves the rotation until it
comes back):

- ``dns:///name:port``: every address the name resolves to, e.g. a Kubernetes headless Service
  (``dns:///pagedserve-grpc.default.svc.cluster.local:50051``); re-resolved when a connection drops.
- ``ipv4:10.0.0.5:50051,10.0.0.6:50051`` / ``ipv6:[::1]:50051,[::1]:50052``: gRPC's static address lists.
- ``10.0.0.5:50051,10.0.0.6:50051``: a comma-separated list of IP addresses without the scheme (it is added).

Anything else (``host:port``, ``unix:...``) is used unchanged, with gRPC's default policy.
"""
from __future__ import annotations

import ipaddress


def channel_target(target: str) -> tuple[str, bool]:
    """``(target for grpc, whether to balance round robin)``.

    Raises:
        ValueError: a comma-separated list whose entries are not ``ip:port`` (gRPC resolves host names only
            through ``dns:///``: give one name that resolves to every replica, or the IP addresses).
    """
    target = target.strip()
    if target.startswith("dns:"):
        return target, True
    if "," not in target:
        return target, False
    if target.startswith(("ipv4:", "ipv6:")):
        return target, True
    entries = [e.strip() for e in target.split(",")]
    families = {_family(e, target) for e in entries}
    if len(families) > 1:
        raise ValueError(f"target {target!r} mixes IPv4 and IPv6 addresses")
    return f"{families.pop()}:{','.join(entries)}", True


def _family(entry: str, target: str) -> str:
    host, sep, port = entry.rpartition(":")
    try:
        if not sep or not port.isdigit():
            raise ValueError
        address = ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        raise ValueError(f"target {target!r}: {entry!r} is not ip:port; a list of replicas takes IP addresses "
                         "(ipv4:a:port,b:port) or one DNS name (dns:///name:port)") from None
    return "ipv4" if address.version == 4 else "ipv6"
