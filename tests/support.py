"""Test helpers shared by several test modules in every folder (imported as ``support``: pyproject's pytest
``pythonpath`` puts tests/ on sys.path; conftest.py names clash across folders)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

#: The repository's root (tests/ is one level below it).
REPO_ROOT = Path(__file__).resolve().parents[1]

#: Two tools with small argument schemas (the tool-calling tests and scripts/record_outputs.py).
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time now", "parameters": TIME}}]

#: Chat prompts the generation tests send (through the model's chat template, :func:`chat_ids`).
CHAT_PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "List three prime numbers greater than 20.",
    "Explain what a hash table is to a child.",
    "Translate 'good morning, my friend' into French and Spanish.",
    "Write a short Python function that reverses a string.",
    "Give me two tips for sleeping better.",
    "What is 17 times 23? Show the steps.",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Runs :class:`pagedserve.entrypoints.app.App` on its own event loop in a daemon thread."""

    def __init__(self, server_config, engine_config, factory=None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.thread.start()
        self.app, self.port = self.run(self._start(server_config, engine_config, factory))

    async def _start(self, server_config, engine_config, factory):
        from pagedserve.entrypoints.app import create_server

        app, port = await create_server(server_config, engine_config, factory)
        await app.load_models()
        return app, port

    def run(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.app.http_port}"

    @property
    def engine(self):
        """The LLMEngine of the generation service."""
        return self.app.services.generation.engine.engine

    def stop(self) -> None:
        self.run(self.app.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def wait_until(predicate, timeout_s: float, what="") -> None:
    """Poll ``predicate`` every 20 ms; fail after ``timeout_s`` saying ``what`` (a string, or a callable giving one)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s: {what() if callable(what) else what}"
        time.sleep(0.02)


def assert_no_blocks_held(server, timeout_s: float = 30) -> None:
    """The server's engine goes idle with every KV block free (no request leaked)."""
    engine, front = server.engine, server.app.services.generation
    wait_until(lambda: not engine.has_unfinished() and not front.num_live_requests and not engine.groups,
               timeout_s, engine.stats)
    stats = engine.stats()
    assert stats["num_blocks_free"] == stats["num_blocks_total"], stats


def run_to_completion(engine, on_step=None) -> dict:
    """Step ``engine`` until idle; returns {request_id: {index: (token_ids, finish_reason, text)}}."""
    out: dict = {}
    while engine.has_unfinished():
        deltas = engine.step()
        if on_step is not None:
            on_step(engine, deltas)
        for d in deltas:
            ids, reason, text = out.setdefault(d.request_id, {}).get(d.index, ([], None, ""))
            out[d.request_id][d.index] = (ids + d.token_ids, d.finish_reason or reason, text + d.text)
    return out


@contextlib.contextmanager
def server_sharing_model(server, embedding_model: str = "", http_port: int = 0, server_kwargs: dict | None = None,
                         **engine_kwargs):
    """A second in-process server whose engine uses the session server's loaded weights (no embedding model
    unless ``embedding_model`` says, e.g. "llm"; no HTTP API unless ``http_port``), built through the same
    :class:`ServiceFactory` as any server, with an engine builder that reuses the weights."""
    from pagedserve.config import EngineConfig, ServerConfig
    from pagedserve.engine.builder import build_engine
    from pagedserve.serving.factory import ServiceFactory

    model, tokenizer = server.engine.executor.model, server.engine.tokenizer
    server_config = ServerConfig(host="127.0.0.1", port=0, http_port=http_port, embedding_model=embedding_model,
                                 **(server_kwargs or {}))
    engine_config = EngineConfig(device="cpu", dtype="float32", attention_backend="torch", **engine_kwargs)
    factory = ServiceFactory(server_config, engine_config,
                             build_engine=lambda config: build_engine(config, model=model, tokenizer=tokenizer))
    s = ServerThread(server_config, engine_config, factory)
    try:
        yield s
    finally:
        s.stop()


def prefill_hidden(model, ids: list[int], backend=None, kv_dtype=None):
    """Final hidden states ``[T, hidden]`` of one prefill of ``ids`` through a pagedserve model (``backend``, torch
    attention by default, a fresh KV cache of the model's (rank's) heads, block size 16, in ``kv_dtype``: float32 by
    default), under inference mode."""
    import torch

    from pagedserve.attention.base import AttentionMetadata
    from pagedserve.attention.torch_ref import TorchAttentionBackend
    from pagedserve.worker.kv_tensors import allocate_kv_caches

    T, bs = len(ids), 16
    nb = -(-T // bs)
    kv = allocate_kv_caches(model.num_layers, nb, bs, model.num_kv_heads, model.head_dim, kv_dtype or torch.float32,
                            "cpu")
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T), block_tables=torch.arange(nb, **i32)[None],
        context_lens=torch.tensor([T], **i32), query_start_loc=torch.tensor([0, T], **i32),
        query_lens=torch.tensor([T], **i32), max_query_len=T, max_context_len=T, num_decode_seqs=0,
        query_lens_cpu=[T], context_lens_cpu=[T])
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(T), kv, meta, backend or TorchAttentionBackend())


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn through ``tokenizer``'s chat template, generation prompt added."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def wait_all_blocks_free(client, timeout_s: float = 10.0):
    """Poll the server's ModelInfo through ``client`` until every KV block is free and no request runs or waits;
    returns that KV-cache message (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        kv = client.model_info().kv_cache
        if kv.num_blocks_free == kv.num_blocks_total and kv.num_requests_running == 0 \
                and kv.num_requests_waiting == 0:
            return kv
        assert time.monotonic() < deadline, f"blocks not freed: {kv}"
        time.sleep(0.05)


class ServerProcess:
    """`python -m pagedserve.cli serve` on a free port, JSON logs collected by a reader thread."""

    def __init__(self, *extra: str, http_port: int = 0):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", "0", "--http-port", str(http_port),
               "--embedding-model", "none",
               "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch", "--log-json", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            self.lines.put(line)

    def wait_event(self, event: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, "server exited:\n" + "".join(self.log[-30:])
                continue
            if line.startswith("{") and json.loads(line).get("event") == event:
                return json.loads(line)
        raise AssertionError(f"no {event!r} log line in {timeout_s}s:\n" + "".join(self.log[-30:]))


def kernel_switch(switch, on: bool, what: str):
    """Fixture body for a runtime-dispatched CPU kernel path: ``switch(mode)`` is its torch op (-1 query, 0 off, 1 on
    where the CPU has it, returns whether it is on). Turns it ``on`` or off for the test, skips when the CPU lacks
    ``what``, and restores the default after. Use as ``yield from kernel_switch(...)``."""
    import pytest

    default = switch(-1)
    if switch(1 if on else 0) != on:
        switch(1 if default else 0)
        pytest.skip(f"the CPU lacks {what}")
    try:
        yield
    finally:
        switch(1 if default else 0)
