"""Tensor parallelism across machines: ``torchrun ... -m pagedserve.torchrun serve <serve flags>``.

Every process torchrun starts runs this with the same ``serve`` flags (``--tensor-parallel-size`` must equal
torchrun's world size, e.g. ``--nnodes 2 --nproc-per-node 1`` for size 2). Rank 0 runs the server (gRPC/HTTP,
scheduler, sampler, its shard) and joins the group through ``env://`` (MASTER_ADDR/MASTER_PORT from torchrun)
instead of spawning workers; every other rank runs :func:`.worker.tp_worker.worker_main` and exits when the server stops.
"""
from __future__ import annotations

import sys

from . import envs
from .worker.tp_worker import WorkerSpec, worker_main


def main(argv: list[str] | None = None) -> int:
    """Run rank ``$RANK`` of a torchrun job. Returns the process exit code."""
    from .cli import build_parser, configs_from_args
    from .cli import main as cli_main

    argv = sys.argv[1:] if argv is None else argv
    place = envs.torchrun_rank()
    rank, world = place.rank, place.world_size
    _, engine_config = configs_from_args(build_parser().parse_args(argv))
    if engine_config.tensor_parallel_size != world:
        print(f"pagedserve: error: tensor_parallel_size {engine_config.tensor_parallel_size} != torchrun's world "
              f"size {world}", file=sys.stderr)
        return 2
    if rank == 0:
        return cli_main(argv, tp_init_method="env://")   # the other ranks are torchrun's, not spawned here
    worker_main(WorkerSpec(engine_config, rank, world, "env://", place.local_rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
