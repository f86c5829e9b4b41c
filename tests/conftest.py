"""Shared fixtures: the embedded models' paths, an in-process gRPC server on port 0, HF oracles."""
from __future__ import annotations

import asyncio
import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


class ServerThread:
    """Runs :class:`pagedserve.server.app.App` on its own event loop in a daemon thread."""

    def __init__(self, server_config, engine_config):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.thread.start()
        self.app, self.port = self.run(self._start(server_config, engine_config))

    async def _start(self, server_config, engine_config):
        from pagedserve.server.app import create_server

        app, port = await create_server(server_config, engine_config)
        await app.load_models()
        return app, port

    def run(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def engine(self):
        return self.app.state.engine.engine

    def stop(self) -> None:
        self.run(self.app.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="session")
def server():
    """The full server with both embedded models (CPU, fp32, torch attention)."""
    from pagedserve.config import EngineConfig, ServerConfig

    s = ServerThread(ServerConfig(host="127.0.0.1", port=0),
                     EngineConfig(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=32))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    from pagedserve_client import PagedServeClient

    with PagedServeClient(server.target, timeout_s=300) as c:
        yield c


@pytest.fixture(scope="session")
def smollm_source():
    from pagedserve.models.loader import ModelSource

    return ModelSource.resolve(None)


@pytest.fixture(scope="session")
def hf_llm(smollm_source):
    """HF transformers' own LlamaForCausalLM on the same GGUF (dequantized to fp32): the model oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_source.directory, gguf_file=smollm_source.gguf_file,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(server):
    return server.engine.tokenizer


@pytest.fixture(scope="session")
def llm_parts(smollm_source):
    """The embedded model, tokenizer and HF config, loaded once, for tests that build their own engines."""
    import torch

    from pagedserve.models.registry import build_model

    cfg = smollm_source.load_config()
    model = build_model(smollm_source, cfg, torch.float32, "cpu")
    return model, smollm_source.load_tokenizer(), cfg


@pytest.fixture(scope="session")
def make_engine(llm_parts):
    """``make_engine(**EngineConfig fields) -> LLMEngine`` sharing one loaded model (CPU, fp32, torch attention)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine

    model, tokenizer, cfg = llm_parts

    def make(**kwargs):
        kwargs = {"device": "cpu", "dtype": "float32", "attention_backend": "torch", **kwargs}
        engine, _ = build_engine(EngineConfig(**kwargs), model=model, tokenizer=tokenizer, hf_config=cfg)
        return engine

    return make


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
