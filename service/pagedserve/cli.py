"""``pagedserve serve``: the command line. Flags are derived one to one from the fields of :class:`ServerConfig`
and :class:`EngineConfig` (:mod:`pagedserve.config_flags`). ``pagedserve route`` and ``pagedserve fleet`` (several
replicas behind vLLM's router) live in :mod:`pagedserve.fleet`.

Every flag can also be given as an environment variable ``PAGEDSERVE_<FIELD>`` (``--max-num-seqs`` ->
``PAGEDSERVE_MAX_NUM_SEQS``; ``--no-enable-prefix-caching`` -> ``PAGEDSERVE_ENABLE_PREFIX_CACHING=false``; switches
take 1/0, true/false, yes/no, on/off). A flag on the command line wins over the environment, which wins over the
field's default.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import sys
from collections.abc import Mapping

from .config import EngineConfig, ServerConfig
from .config_flags import add_flags, build_config, environment_defaults, flag_specs
from .envs import ENV_PREFIX, pagedserve_settings
from .fleet import launcher as fleet_launcher
from .fleet import router as fleet_router

SPECS = flag_specs(ServerConfig, EngineConfig)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``pagedserve`` parser, with ``serve``'s defaults taken from ``PAGEDSERVE_*`` variables in ``environ``
    (default: the process environment). A bad value exits with status 2, naming the variable; an unknown
    variable is warned about on stderr."""
    parser = argparse.ArgumentParser(prog="pagedserve", description="gRPC + OpenAI-compatible HTTP LLM sidecar")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the servers", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       epilog=f"Every flag is also read from {ENV_PREFIX}<FLAG> (upper case, '-' as '_'; "
                              f"switches take true/false; --no-enable-prefix-caching is "
                              f"{ENV_PREFIX}ENABLE_PREFIX_CACHING=false); the command line wins.")
    add_flags(s, SPECS)
    defaults, unknown, errors = environment_defaults(SPECS, pagedserve_settings(environ))
    for name in unknown:
        print(f"pagedserve: warning: ignoring unknown environment variable {name}", file=sys.stderr)
    for name, message in errors.items():
        s.error(f"{name}: {message}")
    s.set_defaults(**defaults)
    fleet_router.add_parser(sub)   # pagedserve route
    fleet_launcher.add_parser(sub)    # pagedserve fleet
    return parser


def configs_from_args(args) -> tuple[ServerConfig, EngineConfig]:
    """The two configs from parsed ``serve`` arguments. Raises ValueError for an out-of-range value."""
    return build_config(ServerConfig, SPECS, args), build_config(EngineConfig, SPECS, args)


async def serve(server_config: ServerConfig, engine_config: EngineConfig | None,
                tp_init_method: str | None = None) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully; a second signal skips what is left of the grace.
    ``tp_init_method``: the tensor-parallel group's init method when the workers exist already (torchrun's
    ``env://``); None spawns them.

    Raises whatever loading the models raised (after stopping the server).
    """
    from .entrypoints.app import create_server
    from .serving.factory import ServiceFactory

    factory = None
    if tp_init_method is not None:
        from .engine.builder import build_engine

        factory = ServiceFactory(server_config, engine_config,
                                 functools.partial(build_engine, tp_init_method=tp_init_method))
    app, _ = await create_server(server_config, engine_config, factory)
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            app.end_grace_now()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    load = asyncio.create_task(app.load_models())
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([load, waiter], return_when=asyncio.FIRST_COMPLETED)
    if load in done and load.exception() is not None:
        waiter.cancel()
        await app.stop(0)
        raise load.exception()
    await waiter
    load.cancel()
    await app.stop()


def main(argv: list[str] | None = None, tp_init_method: str | None = None) -> int:
    """``pagedserve ...``; ``tp_init_method`` as in :func:`serve` (torchrun's rank 0). Returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        return args.run(args)
    from .logging import configure_logging

    try:
        server_config, engine_config = configs_from_args(args)
    except ValueError as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(server_config.log_level, server_config.log_json)
    try:
        asyncio.run(serve(server_config, engine_config, tp_init_method))
    except (RuntimeError, ValueError, OSError) as exc:   # a model that cannot load on this machine: one line, exit 1
        print(f"pagedserve: error: start-up failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
