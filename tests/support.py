"""Test helpers shared by several test modules (imported as ``support``; conftest.py names clash across folders)."""
from __future__ import annotations

import asyncio
import contextlib
import threading


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
def server_sharing_model(server, embedding_model: str = "", **engine_kwargs):
    """A second in-process server whose engine uses the session server's loaded weights (no embedding model
    unless ``embedding_model`` says, e.g. "llm")."""
    from pagedserve.config import EngineConfig, ServerConfig
    from pagedserve.engine import builder

    original = builder.build_engine
    model, tokenizer = server.engine.runner.model, server.engine.tokenizer
    builder.build_engine = lambda config: original(config, model=model, tokenizer=tokenizer)
    try:
        s = ServerThread(ServerConfig(host="127.0.0.1", port=0, embedding_model=embedding_model),
                         EngineConfig(device="cpu", dtype="float32", attention_backend="torch", **engine_kwargs))
    finally:
        builder.build_engine = original
    try:
        yield s
    finally:
        s.stop()
