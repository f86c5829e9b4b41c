"""Shared pieces of the benchmarks: workloads, CPU thread settings, the server subprocess, the gRPC load
generator, the HF transformers baseline and the statistics.

Definitions used everywhere (seconds unless a name says otherwise):
- TTFT (time to first token): from just before the Generate call is issued to the arrival of the first
  message carrying a token id.
- TPOT (time per output token): (e2e - ttft) / (num_tokens - 1), e2e being call issue to last message.
- output tokens/s: all output tokens of a run divided by the run's wall time (first request sent to last
  token received).
"""
from __future__ import annotations

import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion progress bars

INFERENCE_SERVICE = "pagedserve.v1.InferenceService"

QUICK_PROMPTS = (
    "Explain how a paged KV cache works in a language model server.", "Write a short poem about the sea at night.",
    "What is the capital of France, and why is it famous?", "List five tips for writing clean Python code.",
    "Summarize the plot of Romeo and Juliet in three sentences.", "How do vaccines train the immune system?",
    "Give me a recipe for a simple tomato soup.", "What are the differences between TCP and UDP?",
    "Describe the water cycle to a ten year old.", "Why is the sky blue?",
    "Translate 'good morning, how are you?' into Spanish and German.", "What does a compiler do?",
    "Suggest three names for a friendly robot.", "Explain recursion with an example.",
    "What causes the seasons on Earth?", "How should I prepare for a job interview?",
)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    prompt_token_ids: tuple[int, ...]  # the prompt, already tokenized (same ids go to both systems)
    max_new_tokens: int                 # output tokens to produce (EOS ignored, so exactly this many)


@dataclass
class StreamRecord:
    """What the load generator measured for one Generate stream."""

    num_tokens: int   # output tokens received
    ttft_s: float     # call issue to the first token
    e2e_s: float      # call issue to the last message

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (num_tokens - 1); None for single-token outputs."""
        return (self.e2e_s - self.ttft_s) / (self.num_tokens - 1) if self.num_tokens > 1 else None


# ---------------------------------------------------------------- threads, model files, workloads

def configure_threads(num_threads: int) -> dict:
    """Set this process's torch intra-op threads and return the settings used for every system.

    The server subprocess gets the same count through OMP_NUM_THREADS / MKL_NUM_THREADS (see server_env),
    which torch reads at start-up as its intra-op thread count.
    """
    import torch

    torch.set_num_threads(num_threads)
    return {"torch_intra_op_threads": torch.get_num_threads(), "omp_num_threads_server": num_threads,
            "cpu_count": os.cpu_count(), "torch_version": torch.__version__,
            "loadavg_1m_before": round(os.getloadavg()[0], 2)}  # well above 0: others were using the CPU


def server_env(num_threads: int) -> dict[str, str]:
    """Environment for the server subprocess: the thread count and offline hub access."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(num_threads), MKL_NUM_THREADS=str(num_threads), HF_HUB_OFFLINE="1")
    return env


def model_location() -> tuple[str, str]:
    """(directory, gguf file name) of the embedded SmolLM2 GGUF, as the server resolves it."""
    from pagedserve.models.loader import embedded_llm_path

    path = embedded_llm_path()
    return os.path.dirname(path), os.path.basename(path)


def load_tokenizer():
    """The embedded model's HF tokenizer (read from the GGUF by transformers)."""
    from transformers import AutoTokenizer

    directory, gguf_file = model_location()
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)


def load_hf_model(dtype: str = "float32"):
    """HF transformers' causal LM from the embedded GGUF, dequantized to ``dtype`` (a torch dtype name), in eval
    mode."""
    import torch
    from transformers import AutoModelForCausalLM
    directory, gguf_file = model_location()
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=getattr(torch, dtype))
    return model.eval()


def quick_workload(tokenizer, num_requests: int = 16, max_new_tokens: int = 64) -> list[BenchRequest]:
    """Issue 2's workload: chat prompts (rendered with the chat template), max_new_tokens each."""
    return [BenchRequest(chat_prompt_ids(tokenizer, QUICK_PROMPTS[i % len(QUICK_PROMPTS)]), max_new_tokens)
            for i in range(num_requests)]


def chat_prompt_ids(tokenizer, user_message: str) -> tuple[int, ...]:
    """One user message rendered with the model's chat template, generation prompt added, as token ids."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return tuple(int(t) for t in ids)


def warmup_request(tokenizer) -> BenchRequest:
    """A short request unlike the workloads' prompts (so it gives no prefix-cache hit), 8 new tokens."""
    return BenchRequest(tuple(tokenizer.encode("Warm-up: count from one to ten.")), 8)


def mixed_workload(tokenizer, num_requests: int = 64, seed: int = 0, prompt_len: tuple[int, int] = (50, 800),
                   output_len: tuple[int, int] = (16, 256)) -> list[BenchRequest]:
    """Issue 7's workload: prompt and output lengths uniform in the given inclusive ranges, prompt tokens
    drawn uniformly from the non-special vocabulary; everything from random.Random(seed)."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    requests = []
    for _ in range(num_requests):
        n_prompt = rng.randint(*prompt_len)
        n_out = rng.randint(*output_len)
        requests.append(BenchRequest(tuple(rng.choice(vocab) for _ in range(n_prompt)), n_out))
    return requests


# ---------------------------------------------------------------- our server

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagedserve serve` as a subprocess on a free port; `with` starts it, waits for SERVING, stops it.

    Raises RuntimeError when the process exits or is not SERVING within ready_timeout_s (log tail included).
    """

    def __init__(self, num_threads: int, extra_args: list[str] | None = None, ready_timeout_s: float = 600.0):
        self.port = free_port()
        self.http_port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.http_base_url = f"http://127.0.0.1:{self.http_port}/v1"
        exe = os.path.join(os.path.dirname(sys.executable), "pagedserve")
        self.argv = [exe, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--http-port",
                     str(self.http_port), "--embedding-model", "none", *(extra_args or [])]
        self.env = server_env(num_threads)
        self.ready_timeout_s = ready_timeout_s
        self.log = tempfile.NamedTemporaryFile(prefix="pagedserve-bench-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_serving(self) -> None:
        import grpc
        from pagedserve_client import PagedServeClient

        deadline = time.monotonic() + self.ready_timeout_s
        with PagedServeClient(self.target) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.health(INFERENCE_SERVICE, timeout=2.0) == "SERVING":
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"server not SERVING after {self.ready_timeout_s}s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 3000) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-num_chars:]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __exit__(self, *exc: object) -> None:
        self.stop()


CallMetadata = Callable[[], list[tuple[str, str]]]   # makes one call's extra gRPC metadata pairs


async def _one_stream(client, request: BenchRequest, limiter: asyncio.Semaphore, cache_salt: str = "",
                      metadata: CallMetadata | None = None) -> StreamRecord:
    async with limiter:
        start = time.perf_counter()
        first = None
        num_tokens = 0
        async for response in client.generate(prompt_token_ids=list(request.prompt_token_ids),
                                              max_tokens=request.max_new_tokens, temperature=0.0,
                                              ignore_eos=True, cache_salt=cache_salt,
                                              metadata=metadata() if metadata else None):
            if response.token_ids:
                num_tokens += len(response.token_ids)
                if first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
    if num_tokens != request.max_new_tokens:
        raise RuntimeError(f"asked {request.max_new_tokens} tokens, got {num_tokens}")
    return StreamRecord(num_tokens, first - start, end - start)


async def run_streams(target: str, requests: list[BenchRequest], concurrency: int,
                      timeout_s: float = 3600.0, cache_salt: str = "",
                      metadata: CallMetadata | None = None) -> tuple[list[StreamRecord], float]:
    """Send every request as its own Generate stream on one channel, at most `concurrency` in flight.
    ``cache_salt`` goes with every request (a new salt per run: no prefix-cache hits on an earlier run's blocks);
    ``metadata``, a function of no arguments, gives each call's extra gRPC metadata pairs (e.g. a traceparent).

    Returns (records in request order, wall seconds). Raises grpc.aio.AioRpcError on a failed call and
    RuntimeError when a stream returns a different number of tokens than asked.
    """
    from pagedserve_client import AsyncPagedServeClient

    limiter = asyncio.Semaphore(concurrency)
    async with AsyncPagedServeClient(target, timeout_s=timeout_s) as client:
        start = time.perf_counter()
        records = await asyncio.gather(*(_one_stream(client, r, limiter, cache_salt, metadata) for r in requests))
        wall_s = time.perf_counter() - start
    return list(records), wall_s


async def _one_http_stream(client, model: str, request: BenchRequest, limiter: asyncio.Semaphore) -> StreamRecord:
    async with limiter:
        start = time.perf_counter()
        first = None
        usage = None
        stream = await client.completions.create(
            model=model, prompt=list(request.prompt_token_ids), max_tokens=request.max_new_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
        end = time.perf_counter()
    num_tokens = usage.completion_tokens if usage is not None else 0
    if num_tokens != request.max_new_tokens:
        raise RuntimeError(f"asked {request.max_new_tokens} tokens, got {num_tokens}")
    return StreamRecord(num_tokens, (first or end) - start, end - start)


async def run_http_streams(base_url: str, requests: list[BenchRequest], concurrency: int,
                           timeout_s: float = 3600.0) -> tuple[list[StreamRecord], float]:
    """The same as :func:`run_streams` through the OpenAI-compatible HTTP API: the `openai` SDK's async client,
    one streamed /v1/completions call per request (prompt as token ids), at most `concurrency` in flight."""
    import httpx
    import openai

    limiter = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=timeout_s,
                                  http_client=httpx.AsyncClient(limits=limits, timeout=timeout_s)) as client:
        model = (await client.models.list()).data[0].id
        start = time.perf_counter()
        records = await asyncio.gather(*(_one_http_stream(client, model, r, limiter) for r in requests))
        wall_s = time.perf_counter() - start
    return list(records), wall_s


# ---------------------------------------------------------------- HF transformers baseline

class TimingStreamer:
    """A transformers streamer recording the arrival time of each new token (batch size 1).

    generate() calls put() once with the prompt, then once per new token, then end().
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.token_times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if self._seen_prompt:
            self.token_times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass

    def record(self) -> StreamRecord:
        return StreamRecord(len(self.token_times), self.token_times[0] - self.start,
                            self.token_times[-1] - self.start)


def hf_generate(model, batch: list[BenchRequest], pad_token_id: int, max_new_tokens: int,
                streamer: TimingStreamer | None = None):
    """HF `generate` on one left-padded batch: greedy, exactly max_new_tokens per row
    (min_new_tokens = max_new_tokens suppresses EOS). Returns the new tokens, int64 [batch, max_new_tokens]."""
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        input_ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
        attention_mask[row, width - len(r.prompt_token_ids):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=pad_token_id, streamer=streamer, temperature=None, top_p=None,
                             top_k=None)
    return out[:, width:]


def pad_id_of(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS id (masked out by the attention mask either way)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# ---------------------------------------------------------------- statistics

def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_summary(records: list[StreamRecord]) -> dict:
    """TTFT and TPOT P50/P99 (milliseconds) and mean over the records."""
    ttft = [r.ttft_s * 1e3 for r in records]
    tpot = [r.tpot_s * 1e3 for r in records if r.tpot_s is not None]
    return {"ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
            "ttft_ms_mean": statistics.fmean(ttft) if ttft else float("nan"),
            "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
            "tpot_ms_mean": statistics.fmean(tpot) if tpot else float("nan")}


def record_dicts(records: list[StreamRecord]) -> list[dict]:
    return [dict(asdict(r), tpot_s=r.tpot_s) for r in records]
