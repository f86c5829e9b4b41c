"""Process-group set-up for tensor parallelism: the compute group (gloo on CPU, NCCL on CUDA, the collective
timeout) and the gloo control group rank 0 broadcasts each step's inputs on. Gloo timeouts are per process: rank 0
sends with the collective timeout (a hung worker fails the send), workers wait for the next step without one."""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..models.layers import TPGroup

CONTROL_TIMEOUT = timedelta(days=365)   # workers wait for the next step as long as the server lives
STARTUP_TIMEOUT_S = 600.0   # rendezvous and shard loading: spawned ranks import torch and read the checkpoint
_startup_group = None       # gloo group with the start-up timeout (see wait_for_all_ranks)


def init_groups(rank: int, size: int, device: torch.device, init_method: str, timeout_s: float):
    """Join the group (every rank calls this; it blocks until all have, up to :data:`STARTUP_TIMEOUT_S`). Returns
    ``(TPGroup, control group)``: the TPGroup's collectives (gloo or NCCL) and rank 0's control sends time out after
    ``timeout_s``; the rendezvous itself and :func:`wait_for_all_ranks` get the longer start-up timeout, so a slow
    start (a loaded machine, a large checkpoint) is not taken for a hung rank.

    init_method: ``tcp://host:port`` or ``env://`` (torchrun's MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE).
    Raises RuntimeError / DistBackendError when the rendezvous fails or times out.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    global _startup_group
    startup = timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=startup)
    compute = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s) if rank == 0 else CONTROL_TIMEOUT)
    _startup_group = dist.new_group(backend="gloo", timeout=startup)
    return TPGroup(rank, size, compute), control


def wait_for_all_ranks() -> None:
    """Barrier with the start-up timeout: every rank calls it once its shard is loaded, before the first step."""
    dist.barrier(group=_startup_group)


def send(control, message) -> None:
    """Rank 0: broadcast a picklable message (tensors on CPU) to every worker."""
    dist.broadcast_object_list([message], src=0, group=control)


def receive(control):
    """Workers: the next message rank 0 broadcast."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def die_with_parent(poll_s: float = 0.5) -> None:
    """Exit this process as soon as its parent is gone (a watcher thread polls ``os.getppid()``), so no worker
    outlives a server killed without a chance to stop it. (Not PR_SET_PDEATHSIG: that fires when the parent
    *thread* that spawned us exits, and the server spawns workers from a loading thread.)"""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="pagedserve-parent-watch", daemon=True).start()
