"""`pagedserve-client`: command line client for a pagedserve server.

    pagedserve-client [--target HOST:PORT] [--timeout S] generate "prompt" [sampling flags] [--chat] [--json]
        [--chat-template-kwargs JSON] [--[no-]include-reasoning]   (reasoning to stderr, content to stdout)
    pagedserve-client embed TEXT... [--no-normalize] [--truncate] [--dimensions K]
    pagedserve-client rerank --query Q TEXT... [--top-n N] [--return-text] [--truncate]
    pagedserve-client tokenize TEXT | detokenize ID... | info | health [--service S] | abort ID...
    pagedserve-client bench [--num-requests N] [--concurrency C] [--prompt P]... [--max-tokens M] [--out-dir D]

Exit status: 0 ok; 1 on a gRPC error ("error: <CODE>: <details>" on stderr) or, for health, a status other
than SERVING; 2 on bad command line arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from . import _convert
from .client import PagedServeClient
from .v1 import inference_pb2 as pb

# Repeated fields take one value per flag occurrence, so their flag is singular where the field name is plural.
_FLAG_NAMES = {"stop_token_ids": "--stop-token-id"}


def _sampling_flags() -> dict[str, tuple[str, Any]]:
    """SamplingParams field -> (CLI flag, kind), derived from the proto descriptor (one flag per field, a new field
    gets its flag with no change here). kind: int | float | bool | "str*" (repeatable) | "int*" | "bias*" |
    "json" (a message field, given as JSON text)."""
    from google.protobuf.descriptor import FieldDescriptor as FD

    flags: dict[str, tuple[str, Any]] = {}
    for fd in pb.SamplingParams.DESCRIPTOR.fields:
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            kind: Any = "bias*"
        elif fd.message_type is not None:
            kind = "json"          # a message field: JSON text, e.g. --structured-output '{"regex": "[0-9]+"}'
        elif fd.is_repeated:
            kind = "str*" if fd.cpp_type == FD.CPPTYPE_STRING else "int*"
        else:
            kind = {FD.CPPTYPE_BOOL: bool, FD.CPPTYPE_FLOAT: float, FD.CPPTYPE_DOUBLE: float,
                    FD.CPPTYPE_STRING: str}.get(fd.cpp_type, int)
        flags[fd.name] = (_FLAG_NAMES.get(fd.name, "--" + fd.name.replace("_", "-")), kind)
    return flags


SAMPLING_FLAGS = _sampling_flags()


def _logit_bias_item(text: str) -> tuple[int, float]:
    token_id, sep, bias = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, got {text!r}")
    return int(token_id), float(bias)


def _json_arg(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None


def _json_object(text: str) -> dict[str, Any]:
    value = _json_arg(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (unset flags leave the server default)")
    for field, (flag, kind) in SAMPLING_FLAGS.items():
        help_text = f"SamplingParams.{field}"
        if kind is bool:
            group.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif kind in ("str*", "int*", "bias*"):
            item_type = {"str*": str, "int*": int, "bias*": _logit_bias_item}[kind]
            group.add_argument(flag, dest=field, action="append", type=item_type, default=None,
                               help=f"{help_text} (repeatable)")
        elif kind == "json":
            group.add_argument(flag, dest=field, type=_json_arg, default=None, metavar="JSON",
                               help=f"{help_text} as JSON, e.g. '{{\"json_schema\": {{...}}}}', "
                                    f"'{{\"regex\": \"[0-9]+\"}}', '{{\"choice\": [\"yes\", \"no\"]}}'")
        else:
            group.add_argument(flag, dest=field, type=kind, default=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `pagedserve-client` (reads PAGEDSERVE_TARGET for the --target default)."""
    parser = argparse.ArgumentParser(prog="pagedserve-client", description="Client for a pagedserve gRPC server.")
    parser.add_argument("--target", default=os.environ.get("PAGEDSERVE_TARGET", _convert.DEFAULT_TARGET),
                        help="server host:port (default: $PAGEDSERVE_TARGET or %(default)s)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of each call, seconds")
    parser.add_argument("--api-key", default=None,
                        help=f"sent as `authorization: Bearer` metadata (default: ${_convert.API_KEY_ENV})")
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle: connect over TLS, verifying the server")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate (mutual TLS; with --tls-key)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None,
                        help="the name the server certificate must carry, when it differs from the target's host")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion to stdout")
    gen.add_argument("prompt", nargs="?", help='prompt text; "-" reads stdin')
    gen.add_argument("--token-ids", type=int, nargs="+", help="send token ids instead of a prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--system", help="system message (implies --chat)")
    gen.add_argument("--request-id", default="")
    gen.add_argument("--priority", type=int, default=0, help="lower is served first")
    gen.add_argument("--cache-salt", default="")
    gen.add_argument("--json", action="store_true", help="print each response as a JSON line")
    gen.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                     help='more chat template variables (with --chat), e.g. \'{"enable_thinking": false}\'')
    gen.add_argument("--include-reasoning", action=argparse.BooleanOptionalAction, default=None,
                     help="with a --reasoning-parser server: send the reasoning text (default) or drop it; "
                          "reasoning is written to stderr, the content to stdout")
    _add_sampling_flags(gen)

    emb = sub.add_parser("embed", help="embed texts; prints JSON vectors")
    emb.add_argument("texts", nargs="+", metavar="TEXT")
    emb.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                     help="L2-normalize each vector (server default: on)")
    emb.add_argument("--truncate", action=argparse.BooleanOptionalAction, default=None,
                     help="keep the first tokens of an input longer than the model's limit (server default: off, "
                          "such an input is INVALID_ARGUMENT)")
    emb.add_argument("--dimensions", type=int, default=None,
                     help="keep the first K dimensions, then normalize (default: all)")

    rr = sub.add_parser("rerank", help="score texts against a query, best first (JSON)")
    rr.add_argument("texts", nargs="+", metavar="TEXT")
    rr.add_argument("--query", required=True, help="the text every TEXT is scored against")
    rr.add_argument("--top-n", type=int, default=None, help="only the best N (default: all)")
    rr.add_argument("--return-text", action="store_true", help="echo each text in its result")
    rr.add_argument("--truncate", action="store_true",
                    help="cut a pair longer than the model's limit (default: such a pair is INVALID_ARGUMENT)")

    tok = sub.add_parser("tokenize", help="text to token ids (JSON)")
    tok.add_argument("text")
    tok.add_argument("--chat", action="store_true", help="tokenize the text as a user chat message")
    tok.add_argument("--system", help="system message (implies --chat)")
    tok.add_argument("--add-special-tokens", action=argparse.BooleanOptionalAction, default=None)
    tok.add_argument("--add-generation-prompt", action=argparse.BooleanOptionalAction, default=None)

    detok = sub.add_parser("detokenize", help="token ids to text")
    detok.add_argument("ids", type=int, nargs="+", metavar="ID")
    detok.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=None)

    sub.add_parser("info", help="served models and KV cache (JSON)")
    health = sub.add_parser("health", help="gRPC health check; exit 0 only when SERVING")
    health.add_argument("--service", default="", help='"" (the process) or pagedserve.v1.InferenceService')
    abort = sub.add_parser("abort", help="abort requests by id")
    abort.add_argument("ids", nargs="+", metavar="ID")
    _add_bench_parser(sub)
    return parser


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="latency benchmark: report (JSON) and TTFT/TPOT plot (PNG)")
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument("--concurrency", type=int, default=8, help="streams open at once")
    bench.add_argument("--prompt", action="append", default=None,
                       help="prompt text (repeatable; requests cycle through them)")
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="every request generates exactly --max-tokens tokens")
    bench.add_argument("--out-dir", default="bench-out", help="where bench_report.json and bench_latency.png go")
    bench.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _run_bench(client: PagedServeClient, args: argparse.Namespace) -> int:
    import pathlib

    from . import bench

    if args.num_requests < 1 or args.concurrency < 1:
        raise ValueError("--num-requests and --concurrency must be >= 1")
    prompts = args.prompt or [bench.DEFAULT_PROMPT]
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": args.ignore_eos}
    timings, wall_s = bench.run_bench(client, prompts, args.num_requests, args.concurrency, sampling, args.progress)
    summary = bench.summarize(timings, wall_s)
    config = {"target": client.target, "num_requests": args.num_requests, "concurrency": args.concurrency,
              "prompts": prompts, **sampling}
    report, png = bench.write_outputs(timings, summary, config, pathlib.Path(args.out_dir))
    print(bench.format_summary(summary))
    print(f"report: {report}\nplot: {png}")
    return 0 if summary["errors"] == 0 else 1


def _chat_or_none(args: argparse.Namespace, text: str) -> list[tuple[str, str]] | None:
    if not (args.chat or args.system is not None):
        return None
    system = [("system", args.system)] if args.system is not None else []
    return [*system, ("user", text)]


def _to_json(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _generate_inputs(args: argparse.Namespace) -> dict[str, Any]:
    if (args.prompt is None) == (args.token_ids is None):
        raise ValueError("give a prompt or --token-ids (exactly one)")
    if args.token_ids is not None:
        return {"prompt_token_ids": args.token_ids}
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    messages = _chat_or_none(args, prompt)
    return {"messages": messages} if messages is not None else {"prompt": prompt}


def _run_generate(client: PagedServeClient, args: argparse.Namespace) -> int:
    sampling = {field: getattr(args, field) for field in SAMPLING_FLAGS if getattr(args, field) is not None}
    if "logit_bias" in sampling:
        sampling["logit_bias"] = dict(sampling["logit_bias"])
    stream = client.generate(**_generate_inputs(args), request_id=args.request_id, priority=args.priority,
                             cache_salt=args.cache_salt, chat_template_kwargs=args.chat_template_kwargs,
                             include_reasoning=args.include_reasoning, **sampling)
    multi = (args.n or 1) > 1
    texts: dict[int, list[str]] = {}
    reasoning: dict[int, list[str]] = {}
    summary: list[str] = []
    usage = None
    try:
        for response in stream:
            if args.json:
                sys.stdout.write(json.dumps(_to_json(response), ensure_ascii=False) + "\n")
            elif not multi:
                if response.reasoning_text:
                    sys.stderr.write(response.reasoning_text)
                    sys.stderr.flush()
                sys.stdout.write(response.text)
            else:
                texts.setdefault(response.index, []).append(response.text)
                reasoning.setdefault(response.index, []).append(response.reasoning_text)
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                summary.append(_finish_line(response, multi))
                if multi and not args.json:
                    thought = "".join(reasoning[response.index])
                    if thought:
                        sys.stderr.write(f"--- reasoning {response.index} ---\n{thought}\n")
                    sys.stdout.write(f"--- completion {response.index} ---\n{''.join(texts[response.index])}\n")
            if response.HasField("usage"):
                usage = response.usage
            sys.stdout.flush()
    finally:
        stream.close()
    if not args.json and not multi and sys.stdout.isatty():
        sys.stdout.write("\n")
    for line in summary:
        print(line, file=sys.stderr)
    if usage is not None:
        print(f"usage: prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
              f"cached_prompt_tokens={usage.cached_prompt_tokens} reasoning_tokens={usage.reasoning_tokens}",
              file=sys.stderr)
    return 0


def _finish_line(response: pb.GenerateResponse, multi: bool) -> str:
    parts = [f"index={response.index}"] if multi else []
    parts.append(f"finish_reason={_convert.finish_reason_name(response.finish_reason)}")
    which = response.WhichOneof("matched_stop")
    if which is not None:
        parts.append(f"matched_stop={json.dumps(getattr(response, which), ensure_ascii=False)}")
    parts.append(f"request_id={response.request_id}")
    return " ".join(parts)


def _run_other(client: PagedServeClient, args: argparse.Namespace) -> int:
    """Every subcommand but generate; prints its result to stdout."""
    if args.command == "embed":
        response = client.embed(args.texts, args.normalize, args.truncate, args.dimensions)
        out: Any = {"embeddings": [list(e.values) for e in response.embeddings],
                    "usage": {"prompt_tokens": response.usage.prompt_tokens}}
    elif args.command == "rerank":
        response = client.rerank(args.query, args.texts, top_n=args.top_n, return_text=args.return_text,
                                 truncate=args.truncate)
        out = {"results": [_to_json(r) for r in response.results],
               "usage": {"prompt_tokens": response.usage.prompt_tokens}}
    elif args.command == "tokenize":
        messages = _chat_or_none(args, args.text)
        response = client.tokenize(None if messages else args.text, messages=messages,
                                   add_special_tokens=args.add_special_tokens,
                                   add_generation_prompt=args.add_generation_prompt)
        out = {"token_ids": list(response.token_ids), "tokens": list(response.tokens)}
    elif args.command == "detokenize":
        print(client.detokenize(args.ids, args.skip_special_tokens))
        return 0
    elif args.command == "info":
        out = _to_json(client.model_info())
    elif args.command == "health":
        status = client.health(args.service)
        print(status)
        return 0 if status == "SERVING" else 1
    else:
        out = {"aborted_request_ids": client.abort(args.ids)}
    print(json.dumps(out, ensure_ascii=False))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on argv (default sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        credentials, options = None, []
        if args.tls_ca or args.tls_cert or args.tls_key:
            credentials = _convert.tls_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        if args.tls_server_name:
            options.append(("grpc.ssl_target_name_override", args.tls_server_name))
        with PagedServeClient(args.target, timeout_s=args.timeout, credentials=credentials, channel_options=options,
                              api_key=args.api_key) as client:
            if args.command == "generate":
                return _run_generate(client, args)
            if args.command == "bench":
                return _run_bench(client, args)
            return _run_other(client, args)
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: CANCELLED: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
