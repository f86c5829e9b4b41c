"""Decoder-model embeddings (last-token pooling) through the generation engine's prefill (issue 9).

Oracle: HF transformers' LlamaModel on the same GGUF, ``last_hidden_state[:, -1]`` (what sentence-transformers'
lasttoken pooling takes for an unpadded input), L2-normalized.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
import torch

from pagedserve.sampling_params import SamplingParams
from pagedserve.errors import InvalidInputError

from support import run_to_completion, server_sharing_model

pytestmark = pytest.mark.e2e

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps KV memory in blocks.",
         "Bonjour, ça va? Très bien, merci.", "今天天气很好。",
         "A much longer sentence that goes on and on about embeddings, batching, prefill and pooling " * 6]


def hf_last_token_states(hf_llm, token_ids: list[list[int]]) -> np.ndarray:
    """``[N, hidden]`` float64: HF's final hidden state of each sequence's last token, one sequence at a time."""
    with torch.inference_mode():
        return np.stack([hf_llm.model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
                         for ids in token_ids])


def unit(a: np.ndarray) -> np.ndarray:
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def test_pooling_request_equals_hf_last_hidden_state_under_chunking_and_batching(make_engine, hf_llm, llm_parts):
    _, tokenizer, _ = llm_parts
    engine = make_engine(num_kv_blocks=256, block_size=16, max_num_batched_tokens=48, max_num_seqs=8)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert max(map(len, ids)) > 48  # the long one is prefilled in several chunks
    engine.add_request("gen", ids[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for i, seq in enumerate(ids):
        engine.add_pooling_request(f"emb{i}", seq)
    embeddings: dict[str, torch.Tensor] = {}

    def collect(_, deltas):
        for d in deltas:
            if d.embedding is not None:
                assert d.finish_reason == "stop" and d.usage.prompt_tokens == len(ids[int(d.request_id[3:])])
                embeddings[d.request_id] = d.embedding

    out = run_to_completion(engine, collect)
    assert len(out["gen"][0][0]) == 12  # generation went on alongside
    ours = np.stack([embeddings[f"emb{i}"].double().numpy() for i in range(len(ids))])
    ref = hf_last_token_states(hf_llm, ids)
    assert ours.shape == (len(TEXTS), 576)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)
    assert (unit(ours) * unit(ref)).sum(-1).min() > 0.99999
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks  # nothing leaked
    # The same input again: its full blocks come from the prefix cache and the vector does not change.
    engine.add_pooling_request("again", ids[-1])
    hits_before = engine.kv_cache.stats.hits_tokens
    again = {}
    run_to_completion(engine, lambda _, ds: again.update({d.request_id: d.embedding for d in ds}))
    assert engine.kv_cache.stats.hits_tokens - hits_before >= 16 * ((len(ids[-1]) - 1) // 16)
    np.testing.assert_allclose(again["again"].double().numpy(), ours[-1], atol=1e-4, rtol=1e-5)  # other chunking


def test_pooling_request_validation_names_the_field(make_engine):
    engine = make_engine(num_kv_blocks=64, max_model_len=64)
    with pytest.raises(InvalidInputError) as err:
        engine.add_pooling_request("a", [], field="inputs[2]")
    assert err.value.field == "inputs[2]"
    with pytest.raises(InvalidInputError) as err:
        engine.add_pooling_request("b", [5] * 65, field="inputs[0]")
    assert err.value.field == "inputs[0]" and "65 tokens" in str(err.value)
    with pytest.raises(InvalidInputError) as err:
        engine.add_pooling_request("c", [1, 10 ** 7])
    assert err.value.field == "inputs"
    engine.add_pooling_request("d", [5] * 64)  # exactly max_model_len tokens fit: nothing is generated after them
    run_to_completion(engine)
    assert not engine.groups and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.fixture(scope="module")
def llm_embed_server(server):
    with server_sharing_model(server, embedding_model="llm", num_kv_blocks=512, max_num_seqs=16,
                              max_num_batched_tokens=256, max_model_len=512, max_waiting_requests=8) as s:
        yield s


def test_embed_rpc_with_llm_embedding_matches_hf(llm_embed_server, hf_llm, tokenizer):
    from pagedserve_client import PagedServeClient

    with PagedServeClient(llm_embed_server.target, timeout_s=120) as client:
        info = client.model_info()
        assert info.embedding.pooling == "lasttoken" and info.embedding.embedding_dimension == 576
        assert info.embedding.max_input_tokens == llm_embed_server.engine.max_model_len
        resp = client.embed(TEXTS)
        ids = [tokenizer(t)["input_ids"] for t in TEXTS]
        assert resp.usage.prompt_tokens == sum(map(len, ids))
        ours = np.array([e.values for e in resp.embeddings], dtype=np.float64)
        ref = unit(hf_last_token_states(hf_llm, ids))
        np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)
        assert (ours * ref).sum(-1).min() > 0.99999
        # dimensions: unit vectors along the first k dimensions of the full one
        short = np.array([e.values for e in client.embed(TEXTS[:2], dimensions=64).embeddings])
        np.testing.assert_allclose(short, unit(ours[:2, :64]), atol=1e-5)
        # Generate still works on the same engine
        result = client.generate_text("Hello", max_tokens=4, temperature=0.0, ignore_eos=True)
        assert result.usage.completion_tokens == 4


def test_llm_embedding_too_long_input_and_truncate(llm_embed_server, hf_llm, tokenizer):
    from pagedserve_client import PagedServeClient

    limit = llm_embed_server.engine.max_model_len
    text = "word " * (limit + 50)
    with PagedServeClient(llm_embed_server.target, timeout_s=300) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.embed(["fine", text])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs[1]" in err.value.details()
        resp = client.embed([text], truncate=True)
    kept = tokenizer(text)["input_ids"][:limit]
    assert resp.usage.prompt_tokens == limit
    ref = unit(hf_last_token_states(hf_llm, [kept]))
    assert float((np.array(resp.embeddings[0].values) * ref[0]).sum()) > 0.9999


def test_cancelled_llm_embed_frees_its_blocks_and_generation_goes_on(llm_embed_server):
    asyncio.run(_cancel_scenario(llm_embed_server))
    engine = llm_embed_server.engine
    deadline = time.monotonic() + 30
    while engine.kv_cache.num_free_blocks != engine.kv_cache.num_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.groups


async def _cancel_scenario(s) -> None:
    from pagedserve_client import pb
    from pagedserve_client.v1 import inference_pb2_grpc

    async with grpc.aio.insecure_channel(s.target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        gen = stub.Generate(pb.GenerateRequest(
            prompt="Count to fifty:", sampling=pb.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)),
            timeout=120)
        long_inputs = ["token " * 450 for _ in range(6)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Embed(pb.EmbedRequest(inputs=long_inputs), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        ok = await stub.Embed(pb.EmbedRequest(inputs=["still answers"]), timeout=60)
        assert len(ok.embeddings) == 1
        tokens = [r async for r in gen]
        assert sum(len(r.token_ids) for r in tokens) == 40


def test_a_call_with_more_inputs_than_the_waiting_queue_holds(llm_embed_server):
    """40 texts against a waiting queue of 8: the embedder feeds them gradually; every vector in its place."""
    from pagedserve_client import PagedServeClient

    texts = [f"sentence number {i} about {'blocks' if i % 2 else 'tokens'}" for i in range(40)]
    with PagedServeClient(llm_embed_server.target, timeout_s=300) as client:
        together = np.array([e.values for e in client.embed(texts).embeddings])
        alone = np.array([client.embed([texts[i]]).embeddings[0].values for i in (0, 17, 39)])
    assert together.shape == (40, 576)
    np.testing.assert_allclose(together[[0, 17, 39]], alone, atol=1e-4)
