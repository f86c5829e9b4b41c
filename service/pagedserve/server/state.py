"""What the servicer reads: the engines once loaded, and the lifecycle flags."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field


@dataclass
class ServerState:
    engine: object | None = None          # AsyncEngine once the generation model is loaded
    engine_info: object | None = None     # builder.EngineInfo
    embedder: object | None = None        # engine.embedder.Embedder once loaded
    embed_batcher: object | None = None   # engine.embed_batcher.EmbedBatcher over the embedder once loaded
    loading: bool = True                  # models still loading
    shutting_down: bool = False
    embed_executor: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-embed"))
