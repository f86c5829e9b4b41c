"""Embed and EmbedStream over gRPC (embedded all-MiniLM-L6-v2): sentence-transformers agreement, the same vector
alone / anywhere in a batch / batched with other calls, truncate, dimensions, usage, and Embed and Generate both
making progress under load from the other."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import numpy as np
import pytest

pytestmark = pytest.mark.e2e

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps KV memory in blocks.",
         "Bonjour, ça va? Très bien, merci.", "今天天气很好。", "🎉 party time 🎂",
         "A much longer sentence that goes on and on about embeddings, batching, padding and masks " * 3]
FILLERS = ["x", "short filler", "a filler of middling length about nothing in particular at all",
           "long filler " * 40]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from pagedserve.models.loader import embedded_embedding_path

    return AutoTokenizer.from_pretrained(embedded_embedding_path())


@pytest.fixture(scope="module")
def st_vectors():
    from sentence_transformers import SentenceTransformer

    from pagedserve.models.loader import embedded_embedding_path

    model = SentenceTransformer(embedded_embedding_path(), device="cpu")
    return model.encode(TEXTS, normalize_embeddings=True)


@pytest.fixture(scope="module")
def alone(client) -> np.ndarray:
    """Each of TEXTS sent on its own."""
    return np.stack([vectors(client.embed([t]))[0] for t in TEXTS])


def vectors(resp) -> np.ndarray:
    return np.array([e.values for e in resp.embeddings], dtype=np.float64)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def long_text(tokenizer, min_tokens: int) -> str:
    text = "Embedding servers cut long inputs at the model's limit. "
    while len(tokenizer(text)["input_ids"]) <= min_tokens:
        text += "Every added sentence brings roughly a dozen more wordpiece tokens. "
    return text


def test_embed_matches_sentence_transformers(client, st_vectors):
    assert cosines(vectors(client.embed(TEXTS)), st_vectors).min() >= 0.9999


def test_same_vector_anywhere_in_a_mixed_length_batch(client, alone):
    for shift in range(len(TEXTS)):
        order = list(range(shift, len(TEXTS))) + list(range(shift))
        got = vectors(client.embed(FILLERS[: shift % 4] + [TEXTS[i] for i in order] + FILLERS[shift % 4:]))
        got = got[shift % 4: shift % 4 + len(TEXTS)]
        assert cosines(got, alone[order]).min() >= 0.9999
        assert np.abs(got - alone[order]).max() < 1e-5


def test_same_vector_while_other_calls_share_its_batch(server, client, alone):
    batcher = server.app.services.embedding
    before = batcher.num_shared_micro_batches
    for _ in range(3):   # concurrent calls nearly always overlap at once; retry in case the worker kept up
        calls = [[TEXTS[i % len(TEXTS)]] + FILLERS[: 1 + i % 4] for i in range(24)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda inputs: client.embed(inputs, timeout=60), calls))
        for i, resp in enumerate(responses):
            got = vectors(resp)[0]
            assert cosines(got, alone[i % len(TEXTS)]) >= 0.9999
            assert np.abs(got - alone[i % len(TEXTS)]).max() < 1e-5
        if batcher.num_shared_micro_batches > before:
            break
    assert batcher.num_shared_micro_batches > before, "no micro-batch ever carried inputs of two calls"


def test_usage_prompt_tokens_exact(client, hf_tokenizer):
    inputs = TEXTS + FILLERS
    assert client.embed(inputs).usage.prompt_tokens == sum(len(ids) for ids in hf_tokenizer(inputs)["input_ids"])


def test_empty_inputs_is_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as err:
        client.embed([])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs" in err.value.details()


def test_too_long_input_and_truncate(client, hf_tokenizer):
    text = long_text(hf_tokenizer, 300)
    with pytest.raises(grpc.RpcError) as err:
        client.embed(["fine", text])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs[1]" in err.value.details()
    ids = hf_tokenizer(text)["input_ids"]
    pre_text = hf_tokenizer.decode(ids[1:255])                # the first 254 wordpieces: [CLS] + 254 + [SEP] = 256
    assert hf_tokenizer(pre_text)["input_ids"] == ids[:255] + ids[-1:]
    expected = vectors(client.embed([pre_text]))[0]
    cut_alone = client.embed([text], truncate=True)
    cut_in_list = client.embed(["short one", text, TEXTS[3]], truncate=True)
    assert cut_alone.usage.prompt_tokens == 256
    assert cut_in_list.usage.prompt_tokens == 256 + sum(len(hf_tokenizer(t)["input_ids"]) for t in ("short one",
                                                                                                     TEXTS[3]))
    for got in (vectors(cut_alone)[0], vectors(cut_in_list)[1]):
        assert cosines(got, expected) >= 0.9999 and np.abs(got - expected).max() < 1e-5
    assert np.abs(vectors(client.embed(TEXTS, truncate=True)) - vectors(client.embed(TEXTS))).max() < 1e-6


def test_dimensions_give_unit_prefix_directions(client):
    full = vectors(client.embed(TEXTS))
    for k in (1, 16, 128, 384):
        got = vectors(client.embed(TEXTS, dimensions=k))
        assert got.shape == (len(TEXTS), k)
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        assert np.abs(got - full[:, :k] / np.linalg.norm(full[:, :k], axis=1, keepdims=True)).max() < 1e-5
    raw = vectors(client.embed(TEXTS, normalize=False, dimensions=16))
    assert np.abs(raw - full[:, :16]).max() < 1e-6                 # the model's own vectors are unit already
    for bad in (0, 385):
        with pytest.raises(grpc.RpcError) as err:
            client.embed(TEXTS, dimensions=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dimensions" in err.value.details()


def test_embed_stream_answers_each_request_in_place(client, alone):
    from pagedserve_client._convert import embed_request

    requests = [embed_request([TEXTS[i % len(TEXTS)], FILLERS[i % 4]], request_id=f"req-{i}") for i in range(20)]
    requests.append(embed_request(TEXTS, dimensions=8, request_id="dims"))
    responses = list(client.embed_stream(requests, timeout=120))
    assert [r.stream_index for r in responses] == list(range(len(requests)))
    assert [r.request_id for r in responses] == [r.request_id for r in requests]
    for i, resp in enumerate(responses[:-1]):
        assert len(resp.embeddings) == 2 and np.abs(vectors(resp)[0] - alone[i % len(TEXTS)]).max() < 1e-5
    last = vectors(responses[-1])
    assert last.shape == (len(TEXTS), 8)
    assert np.abs(last - alone[:, :8] / np.linalg.norm(alone[:, :8], axis=1, keepdims=True)).max() < 1e-5
    bad = [embed_request(["ok"], request_id="a"), embed_request([], request_id="b")]
    with pytest.raises(grpc.RpcError) as err:
        list(client.embed_stream(bad, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_deadline_drops_the_calls_pending_inputs(server, client, alone):
    batcher = server.app.services.embedding
    many = [f"{i} " + FILLERS[3] for i in range(3000)]          # minutes of work on 2 cores
    seen, done = [0], False

    def watch() -> None:                                       # the most inputs ever waiting in the pool
        while not done:
            seen[0] = max(seen[0], batcher.num_pending_inputs)
            time.sleep(0.01)

    watcher = concurrent.futures.ThreadPoolExecutor(1).submit(watch)
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.embed(many, timeout=6.0)             # room to tokenize and queue them on a busy machine
    finally:
        done = True
        watcher.result(10)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert seen[0] > 2000, "the call was cut before its inputs were queued"
    deadline = time.monotonic() + 30
    while batcher.num_pending_inputs:                          # the cancelled call's inputs leave the pool
        assert time.monotonic() < deadline, f"{batcher.num_pending_inputs} inputs still pending"
        time.sleep(0.05)
    assert np.abs(vectors(client.embed([TEXTS[0]], timeout=30))[0] - alone[0]).max() < 1e-5


async def _consume(stream, counts: list[int], i: int) -> None:
    async for response in stream:
        counts[i] += len(response.token_ids)


async def _embed_while_generating(target: str) -> None:
    from pagedserve_client import AsyncPagedServeClient

    async with AsyncPagedServeClient(target) as client:
        counts = [0] * 16
        streams = [client.generate(f"Story number {i}: once upon a time", max_tokens=1000, temperature=0.0,
                                   ignore_eos=True, timeout=300) for i in range(16)]
        tasks = [asyncio.ensure_future(_consume(s, counts, i)) for i, s in enumerate(streams)]
        try:
            deadline = time.monotonic() + 120
            while min(counts) == 0:
                assert time.monotonic() < deadline, "the 16 Generate streams did not start"
                await asyncio.sleep(0.05)
            tokens_before = sum(counts)
            for _ in range(3):
                resp = await client.embed(TEXTS + FILLERS, timeout=30)     # DEADLINE_EXCEEDED fails the test
                assert len(resp.embeddings) == len(TEXTS + FILLERS)
            assert not any(t.done() for t in tasks), "Generate streams ended before the Embed calls were done"
            assert sum(counts) > tokens_before, "Generate made no progress while Embed ran"
        finally:
            for s, t in zip(streams, tasks):
                await s.aclose()
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _generate_while_embedding(target: str) -> None:
    from pagedserve_client import AsyncPagedServeClient

    inputs = TEXTS + FILLERS
    async with AsyncPagedServeClient(target) as client:
        done_calls = [0]
        stop = asyncio.Event()

        async def embed_load() -> None:
            while not stop.is_set():
                await client.embed(inputs, timeout=120)
                done_calls[0] += 1

        load = [asyncio.ensure_future(embed_load()) for _ in range(4)]
        try:
            await asyncio.sleep(0.5)
            calls_before = done_calls[0]
            results = await asyncio.gather(*(client.generate_text(f"Count to {i}:", max_tokens=16, temperature=0.0,
                                                                  ignore_eos=True, timeout=60) for i in range(4)))
            assert all(r.usage.completion_tokens == 16 for r in results)
            assert not any(t.done() for t in load), "the Embed load ended before Generate was done"
            assert done_calls[0] > calls_before, "Embed made no progress while Generate ran"
        finally:
            stop.set()
            await asyncio.gather(*load)


def test_embed_answers_while_16_generate_streams_run(server):
    asyncio.run(_embed_while_generating(server.target))


def test_generate_answers_under_embed_load(server):
    asyncio.run(_generate_while_embedding(server.target))
