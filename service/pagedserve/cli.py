"""``pagedserve serve``: the command line. Flags map one to one onto :class:`EngineConfig` / :class:`ServerConfig`.

Every flag can also be given as an environment variable ``PAGEDSERVE_<DEST>``, where ``<DEST>`` is the flag's
destination upper-cased (``--max-num-seqs`` -> ``PAGEDSERVE_MAX_NUM_SEQS``; ``--no-enable-prefix-caching`` ->
``PAGEDSERVE_ENABLE_PREFIX_CACHING=false``; switches take 1/0, true/false, yes/no, on/off). A flag on the command
line wins over the environment, which wins over the built-in default.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Mapping

from .config import ENV_PREFIX, EngineConfig, ServerConfig, environment_settings

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}
# PAGEDSERVE_* variables that belong to other programs (the client CLI) and are not serve flags.
FOREIGN_ENV = {"target"}


def _add_server_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds in-flight calls get after SIGTERM/SIGINT; then open streams end with ABORT")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics over HTTP at /metrics on this port (default: off)")
    s.add_argument("--metrics-host", default="0.0.0.0", help="address the metrics endpoint binds")
    s.add_argument("--max-send-message-bytes", type=int, default=16 * 1024 * 1024)
    s.add_argument("--max-receive-message-bytes", type=int, default=16 * 1024 * 1024)
    s.add_argument("--keepalive-time-ms", type=int, default=30_000,
                   help="grpc.keepalive_time_ms: the server pings an idle connection after this long")
    s.add_argument("--keepalive-timeout-ms", type=int, default=10_000,
                   help="grpc.keepalive_timeout_ms: unanswered ping deadline before the connection is closed")
    s.add_argument("--keepalive-permit-without-calls", action=argparse.BooleanOptionalAction, default=True,
                   help="grpc.keepalive_permit_without_calls: accept client pings with no call open")
    s.add_argument("--http2-min-ping-interval-without-data-ms", type=int, default=1_000,
                   help="grpc.http2.min_ping_interval_without_data_ms: fastest client ping rate accepted")
    s.add_argument("--http2-max-ping-strikes", type=int, default=2,
                   help="grpc.http2.max_ping_strikes: too-fast pings tolerated before GOAWAY (0: no limit)")
    s.add_argument("--http2-max-pings-without-data", type=int, default=0,
                   help="grpc.http2.max_pings_without_data: server pings with no data between (0: no limit)")
    s.add_argument("--log-level", default="info")
    s.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=None,
                   help="JSON log lines (default: when stdout is not a TTY)")


def _add_engine_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--model", default=None,
                   help="HF model directory or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--embedding-model", default=None,
                   help="HF / sentence-transformers directory (default: the embedded all-MiniLM-L6-v2): a BERT-family "
                        "encoder, or a decoder (Llama-family) embedding model, served by an engine of its own with "
                        "last-token pooling; or 'llm': embed with --model itself through the generation engine")
    s.add_argument("--no-embedding-model", action="store_true", help="serve no embedding model")
    s.add_argument("--max-embed-batch-tokens", type=int, default=2048,
                   help="padded tokens (rows * longest input) per embedding micro-batch; inputs of concurrent "
                        "Embed calls share micro-batches grouped by length")
    s.add_argument("--embed-threads", type=int, default=None,
                   help="torch intra-op threads of the embedding worker (default: half of them on CPU when a "
                        "generation model runs too, else all)")
    s.add_argument("--no-generation-model", action="store_true", help="serve no generation model (Embed only)")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    s.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    s.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weight-only quantized linears: none (dequantize to --dtype), int8 (per output channel), int4 "
                        "(per group of --quant-group-size; GGUF Q4_0/Q4_1 as stored), auto (a GGUF file keeps its own "
                        "scheme where a kernel exists, an HF checkpoint stays unquantized)")
    s.add_argument("--quant-group-size", type=int, default=32, choices=[32, 64, 128],
                   help="weights per int4 scale/zero when quantizing at load")
    s.add_argument("--attention-backend", default="auto", choices=["auto", "cuda", "torch"])
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    s.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's, "
                   "capped to the KV cache capacity)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="running requests at most")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="new tokens per step at most")
    s.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="tokens one prefill may take per step (0: the whole budget)")
    s.add_argument("--max-waiting-requests", type=int, default=1024)
    s.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (default 1 GiB on CPU)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA without --kv-cache-memory: fraction of GPU memory to use; the KV cache gets what a "
                        "profiled forward pass at --max-num-batched-tokens leaves")
    s.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks; overrides --kv-cache-memory and --gpu-memory-utilization")
    s.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``pagedserve`` parser, with ``serve``'s defaults taken from ``PAGEDSERVE_*`` variables in ``environ``
    (default: the process environment). A bad value exits with status 2, naming the variable."""
    parser = argparse.ArgumentParser(prog="pagedserve", description="gRPC LLM inference sidecar")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the gRPC server", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       epilog=f"Every flag is also read from {ENV_PREFIX}<FLAG> (upper case, '-' as '_'; "
                              f"switches take true/false; --no-enable-prefix-caching is "
                              f"{ENV_PREFIX}ENABLE_PREFIX_CACHING=false); the command line wins.")
    _add_server_flags(s)
    _add_engine_flags(s)
    apply_environment(s, environment_settings(environ))
    return parser


def _env_value(action: argparse.Action, raw: str):
    """Convert one environment string the way the command line would; raises ValueError."""
    if action.nargs == 0:  # store_true / store_false / BooleanOptionalAction: the value is the destination's
        word = raw.strip().lower()
        if word not in TRUE_WORDS | FALSE_WORDS:
            raise ValueError(f"expected one of {sorted(TRUE_WORDS | FALSE_WORDS)}, got {raw!r}")
        return word in TRUE_WORDS
    value = action.type(raw) if action.type is not None else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{value!r} is not one of {list(action.choices)}")
    return value


def apply_environment(parser: argparse.ArgumentParser, settings: Mapping[str, str]) -> None:
    """Set ``parser``'s defaults from ``settings`` (destination -> raw string, see
    :func:`pagedserve.config.environment_settings`). Unknown names are warned about on stderr."""
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    defaults = {}
    for dest, raw in settings.items():
        name = ENV_PREFIX + dest.upper()
        if dest not in actions:
            if dest not in FOREIGN_ENV:
                print(f"pagedserve: warning: ignoring unknown environment variable {name}", file=sys.stderr)
            continue
        try:
            defaults[dest] = _env_value(actions[dest], raw)
        except ValueError as exc:
            parser.error(f"{name}: {exc}")
    parser.set_defaults(**defaults)


def configs_from_args(args) -> tuple[ServerConfig, EngineConfig | None]:
    """The two configs from parsed ``serve`` arguments. Raises ValueError for an out-of-range value."""
    server = ServerConfig(
        host=args.host, port=args.port, shutdown_grace_s=args.shutdown_grace,
        embedding_model="" if args.no_embedding_model else args.embedding_model,
        max_embed_batch_tokens=args.max_embed_batch_tokens, embed_threads=args.embed_threads,
        generation=not args.no_generation_model,
        max_send_message_bytes=args.max_send_message_bytes, max_receive_message_bytes=args.max_receive_message_bytes,
        keepalive_time_ms=args.keepalive_time_ms, keepalive_timeout_ms=args.keepalive_timeout_ms,
        keepalive_permit_without_calls=args.keepalive_permit_without_calls,
        http2_min_ping_interval_without_data_ms=args.http2_min_ping_interval_without_data_ms,
        http2_max_ping_strikes=args.http2_max_ping_strikes,
        http2_max_pings_without_data=args.http2_max_pings_without_data,
        metrics_host=args.metrics_host, metrics_port=args.metrics_port)
    if args.no_generation_model:
        return server, None
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        quantization=args.quantization, quant_group_size=args.quant_group_size,
        block_size=args.block_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_waiting_requests=args.max_waiting_requests, kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching)
    return server, engine


async def serve(server_config: ServerConfig, engine_config: EngineConfig | None) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully; a second signal skips what is left of the grace.

    Raises whatever loading the models raised (after stopping the server).
    """
    from .server.app import create_server

    app, _ = await create_server(server_config, engine_config)
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .logging import configure_logging

    configure_logging(args.log_level, args.log_json)
    try:
        server_config, engine_config = configs_from_args(args)
    except ValueError as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(server_config, engine_config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
