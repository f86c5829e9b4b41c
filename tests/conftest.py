"""Shared fixtures: the embedded models' paths, an in-process gRPC server on port 0, HF oracles, and the tiny
random-weight Llama (built once per shape in the session) that engine tests run on without an embedded model."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from support import ServerThread, free_port  # noqa: E402,F401  (tests/support.py)

import pagedserve.worker.memory as _memory  # noqa: E402

# In-process engines of the session get a 1 GiB CPU KV cache unless a test sets kv_cache_memory_bytes: the default
# (2 GiB) is zeroed up front, and this one process holds many engines at once (the session server, module
# fixtures): at 2 GiB each the suite's process passed 24 GB and was OOM-killed. Servers started as subprocesses
# (support.ServerProcess) keep the default.
_memory.DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@pytest.fixture(scope="session")
def random_llama_model():
    """``random_llama_model(**overrides) -> (model, config, tokenizer)``: :func:`backend_cases.random_llama` on the
    CPU, shape :data:`backend_cases.TINY_LLAMA` with ``overrides`` (e.g. ``vocab_size=64``), built once per shape in
    the session (the same seed, so the same weights, whichever test asks first). Sharing is safe: the model is in
    eval mode without gradients, and each engine built on it allocates its own KV cache."""
    import torch

    import backend_cases as bc

    built: dict[tuple, tuple] = {}

    def get(**overrides):
        shape = {**bc.TINY_LLAMA, **overrides}
        key = tuple(sorted(shape.items()))
        if key not in built:
            built[key] = bc.random_llama(torch.device("cpu"), **shape)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama(random_llama_model):
    """The tiny random-weight Llama (:data:`backend_cases.TINY_LLAMA`): ``(model, config, word tokenizer)``."""
    return random_llama_model()


@pytest.fixture(scope="session")
def server():
    """The full server with both embedded models (CPU, fp32, torch attention), gRPC and HTTP."""
    from pagedserve.config import EngineConfig, ServerConfig

    s = ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=free_port()),
                     EngineConfig(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=32,
                                  quantization="none"))
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


@pytest.fixture(scope="module")
def hf_llm_f64(hf_llm):
    """:func:`hf_llm` in float64: the oracle for logit tolerances. Our fp32 forward and HF's own fp32 forward differ
    from it by their float32 rounding (measured on the e2e prompt: ours 6.0e-5, HF fp32 9.3e-5, 1.1e-4 apart: the
    own kernels sum in a fixed order of their own, for batch invariance, not MKL's). Per module: 1 GB."""
    import copy

    return copy.deepcopy(hf_llm).double().eval()


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


@pytest.fixture(scope="session")
def llm_int4(smollm_source, llm_parts):
    """The embedded GGUF loaded with ``quantization="auto"``: Q4_1 linears as int4, the Q8_0 embedding as stored,
    the tied LM head Q8_0 as stored (pagedserve's CPU kernels; int8 per channel on torch's), CPU, fp32
    activations around the kernels."""
    import torch

    from pagedserve.models.registry import build_model

    return build_model(smollm_source, llm_parts[2], torch.float32, "cpu", quantization="auto")
