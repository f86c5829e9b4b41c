"""``pagedserve serve``: the command line. Flags map one to one onto :class:`EngineConfig` / :class:`ServerConfig`."""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from .config import EngineConfig, ServerConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="gRPC LLM inference sidecar")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start the gRPC server", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=50051)
    s.add_argument("--model", default=None,
                   help="HF model directory or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--embedding-model", default=None,
                   help="HF / sentence-transformers directory (default: the embedded all-MiniLM-L6-v2)")
    s.add_argument("--no-embedding-model", action="store_true", help="serve no embedding model")
    s.add_argument("--no-generation-model", action="store_true", help="serve no generation model (Embed only)")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    s.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
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
    s.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks; overrides --kv-cache-memory")
    s.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    s.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds in-flight calls get after SIGTERM")
    s.add_argument("--log-level", default="info")
    s.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=None,
                   help="JSON log lines (default: when stdout is not a TTY)")
    return parser


def configs_from_args(args) -> tuple[ServerConfig, EngineConfig | None]:
    server = ServerConfig(host=args.host, port=args.port, shutdown_grace_s=args.shutdown_grace,
                          embedding_model="" if args.no_embedding_model else args.embedding_model)
    if args.no_generation_model:
        return server, None
    engine = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        block_size=args.block_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_waiting_requests=args.max_waiting_requests, kv_cache_memory_bytes=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching)
    return server, engine


async def serve(server_config: ServerConfig, engine_config: EngineConfig | None) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    from .server.app import create_server

    app, _ = await create_server(server_config, engine_config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load = asyncio.create_task(app.load_models())
    done, _ = await asyncio.wait([load, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if load in done and load.exception() is not None:
        await app.stop(0)
        raise load.exception()
    await stop.wait()
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
