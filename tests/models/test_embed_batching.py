"""EmbedBatcher (engine/embed_batcher.py): inputs of concurrent calls share length-grouped micro-batches under the
token budget, each call gets its own vectors in its own order, turns are fair, cancellation drops pending inputs."""
from __future__ import annotations

import asyncio
import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from pagedserve.embedding.batcher import EmbedBatcher, default_num_threads
from pagedserve.embedding.encoder import Embedder
from pagedserve.errors import EngineUnavailableError, InvalidInputError

WORDS = "paged attention keeps the key value cache in blocks so that many requests share memory well".split()


def sentence(i: int) -> str:
    """A deterministic text of 1 to 60 words, distinct for each i."""
    n = 1 + (i * 37) % 60
    return f"item {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


class GatedEmbedder:
    """Wraps an Embedder: records every micro-batch (its token id lists) and can hold the worker at a gate."""

    def __init__(self, inner: Embedder):
        self.inner = inner
        self.batches: list[list[tuple[int, ...]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode_micro_batch(self, token_ids):
        self.entered.set()
        assert self.gate.wait(60)
        self.batches.append([tuple(seq) for seq in token_ids])
        return self.inner.encode_micro_batch(token_ids)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    from pagedserve.models.loader import embedded_embedding_path

    return Embedder.from_pretrained(embedded_embedding_path())


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [sentence(i) for i in range(30)]


@pytest.fixture(scope="module")
def alone(embedder, texts) -> torch.Tensor:
    """Each text embedded on its own: the reference vectors."""
    return torch.cat([embedder.embed([t]).vectors for t in texts])


def _close(batcher: EmbedBatcher) -> None:
    batcher.close()
    batcher.join(10)


def _held(embedder, budget: int = 4096) -> tuple[EmbedBatcher, GatedEmbedder]:
    """A batcher whose worker is held inside a first one-input micro-batch until gated.gate is set."""
    gated = GatedEmbedder(embedder)
    gated.gate.clear()
    return EmbedBatcher(gated, budget), gated


async def _start_held(batcher: EmbedBatcher, gated: GatedEmbedder) -> asyncio.Task:
    first = asyncio.ensure_future(batcher.embed(["warm the worker up"]))
    while not gated.entered.is_set():
        await asyncio.sleep(0.01)
    return first


def test_concurrent_calls_share_batches_and_keep_their_order(embedder, texts, alone):
    batcher, gated = _held(embedder, budget=1024)
    calls = [texts[k::6] for k in range(6)]          # 6 calls of 5 mixed-length texts each, interleaved lengths

    async def main():
        first = await _start_held(batcher, gated)
        tasks = [asyncio.ensure_future(batcher.embed(c)) for c in calls]
        while batcher.num_pending_inputs < len(texts):
            await asyncio.sleep(0.01)
        gated.gate.set()
        return await first, await asyncio.gather(*tasks)

    try:
        _, results = asyncio.run(main())
    finally:
        _close(batcher)
    for k, result in enumerate(results):
        want = alone[k::6]
        assert result.vectors.shape == want.shape
        assert F.cosine_similarity(result.vectors.double(), want.double()).min() >= 0.9999
        assert (result.vectors - want).abs().max() < 1e-5
        assert result.prompt_tokens == sum(len(embedder.tokenizer(t)["input_ids"]) for t in calls[k])
    owner = {tuple(embedder.tokenizer(t)["input_ids"]): k for k in range(6) for t in calls[k]}
    shared = [b for b in gated.batches[1:] if len({owner[s] for s in b}) > 1]
    assert shared, "no micro-batch held inputs of more than one call"
    for b in gated.batches:
        assert len(b) == 1 or len(b) * max(map(len, b)) <= 1024
    assert sum(len(b) for b in gated.batches[1:]) == len(texts)    # every input ran exactly once


def test_length_grouping_keeps_padding_small(embedder):
    batcher, gated = _held(embedder, budget=2048)
    short, long = ["tiny"] * 12, [sentence(59) + " extra words" * 4] * 12

    async def main():
        first = await _start_held(batcher, gated)
        tasks = [asyncio.ensure_future(batcher.embed(short[:6] + long[:6])),
                 asyncio.ensure_future(batcher.embed(long[6:] + short[6:]))]
        while batcher.num_pending_inputs < 24:
            await asyncio.sleep(0.01)
        gated.gate.set()
        await first
        return await asyncio.gather(*tasks)

    try:
        asyncio.run(main())
    finally:
        _close(batcher)
    for b in gated.batches[1:]:
        assert len({len(s) for s in b}) == 1, "a short and a long input were padded together"
    assert len(gated.batches) == 3                  # the shorts of both calls together, the longs together


def test_turns_are_fair_small_call_not_stuck_behind_a_large_one(embedder):
    batcher, gated = _held(embedder, budget=64)   # about 4 short inputs per micro-batch
    large = [f"large call text number {i}" for i in range(80)]
    order: list[str] = []

    async def run(name, inputs):
        await batcher.embed(inputs)
        order.append(name)

    async def main():
        first = await _start_held(batcher, gated)
        big = asyncio.ensure_future(run("large", large))
        while batcher.num_pending_inputs < len(large):
            await asyncio.sleep(0.01)
        small = asyncio.ensure_future(run("small", ["a small call that came later"]))
        while batcher.num_pending_inputs < len(large) + 1:
            await asyncio.sleep(0.01)
        gated.gate.set()
        await asyncio.gather(first, big, small)

    try:
        asyncio.run(main())
    finally:
        _close(batcher)
    assert order == ["small", "large"]
    assert len(gated.batches) >= 8            # the large call needed many micro-batches


def test_cancel_drops_pending_inputs(embedder, alone, texts):
    batcher, gated = _held(embedder)
    doomed = [f"cancelled input {i} " + "word " * i for i in range(20)]

    async def main():
        first = await _start_held(batcher, gated)
        victim = asyncio.ensure_future(batcher.embed(doomed))
        keeper = asyncio.ensure_future(batcher.embed(texts[:5]))
        while batcher.num_pending_inputs < 25:
            await asyncio.sleep(0.01)
        victim.cancel()
        await asyncio.sleep(0.05)
        assert batcher.num_pending_inputs == 5
        gated.gate.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await victim
        return await keeper

    try:
        kept = asyncio.run(main())
    finally:
        _close(batcher)
    assert (kept.vectors - alone[:5]).abs().max() < 1e-5
    dropped = {tuple(embedder.tokenizer(t)["input_ids"]) for t in doomed}
    assert not dropped & {s for b in gated.batches for s in b}


def test_options_and_errors_match_embedder(embedder, texts):
    batcher = EmbedBatcher(embedder, 512)
    long_text = "tokens " * 400

    async def main():
        dims = await batcher.embed(texts[:4], dimensions=16)
        raw = await batcher.embed(texts[:4], normalize=False)
        cut = await batcher.embed([long_text, "short"], truncate=True)
        with pytest.raises(InvalidInputError, match="inputs\\[1\\]"):
            await batcher.embed(["ok", long_text])
        with pytest.raises(InvalidInputError, match="dimensions"):
            await batcher.embed(["ok"], dimensions=0)
        with pytest.raises(InvalidInputError, match="inputs"):
            await batcher.embed([])
        return dims, raw, cut

    try:
        dims, raw, cut = asyncio.run(main())
    finally:
        _close(batcher)
    for got, want in ((dims, embedder.embed(texts[:4], dimensions=16)),
                      (raw, embedder.embed(texts[:4], normalize=False)),
                      (cut, embedder.embed([long_text, "short"], truncate=True))):
        assert got.vectors.shape == want.vectors.shape and got.prompt_tokens == want.prompt_tokens
        assert (got.vectors - want.vectors).abs().max() < 1e-5
    assert cut.prompt_tokens == embedder.max_input_tokens + 3


def test_close_fails_waiting_calls(embedder):
    batcher, gated = _held(embedder)

    async def main():
        first = await _start_held(batcher, gated)
        waiting = asyncio.ensure_future(batcher.embed(["never runs"]))
        while batcher.num_pending_inputs < 1:
            await asyncio.sleep(0.01)
        batcher.close()
        gated.gate.set()
        with pytest.raises(EngineUnavailableError):
            await waiting
        await first                               # the micro-batch already running still finishes
        with pytest.raises(EngineUnavailableError):
            await batcher.embed(["after close"])

    asyncio.run(main())
    batcher.join(10)


class LengthsOnly:
    """A model-free stand-in: a "text" is its token count; records each micro-batch's lengths."""

    dimension = 4

    def __init__(self):
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()

    def check_dimensions(self, dimensions):
        pass

    def tokenize(self, texts, truncate=False):
        return [[7] * (int(t) if t.isdigit() else len(t.split())) for t in texts]

    def encode_micro_batch(self, token_ids):
        self.entered.set()
        assert self.gate.wait(60)
        self.batches.append([len(seq) for seq in token_ids])
        return torch.tensor([[float(len(seq)), 0.0, 0.0, 0.0] for seq in token_ids])


@pytest.mark.parametrize("seed", range(4))
def test_micro_batch_policy_on_random_lengths(seed):
    import random

    rng = random.Random(seed)
    calls = [[str(rng.randint(1, 200)) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    stub = LengthsOnly()
    batcher = EmbedBatcher(stub, 512, max_padding_fraction=0.3, small_batch_tokens=64)

    async def main():
        first = await _start_held(batcher, stub)
        tasks = [asyncio.ensure_future(batcher.embed(c, normalize=False)) for c in calls]
        while batcher.num_pending_inputs < sum(map(len, calls)):
            await asyncio.sleep(0.01)
        stub.gate.set()
        await first
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(main())
    finally:
        _close(batcher)
    for c, result in zip(calls, results):                      # each call's own vectors, in its own order
        assert result.vectors[:, 0].tolist() == [float(t) for t in c]
        assert result.prompt_tokens == sum(int(t) for t in c)
    stub.batches.pop(0)                                        # the call that held the worker
    assert sorted(n for b in stub.batches for n in b) == sorted(int(t) for c in calls for t in c)
    for b in stub.batches:
        padded = len(b) * max(b)
        assert len(b) == 1 or padded <= 512
        assert padded <= 64 or padded - sum(b) <= 0.3 * padded
    assert len(stub.batches) < sum(map(len, calls)) / 2        # batches are shared, not one input each


def test_worker_threads_are_its_own(embedder):
    class ThreadsSeen(GatedEmbedder):
        def encode_micro_batch(self, token_ids):
            self.batches.append(torch.get_num_threads())
            return self.inner.encode_micro_batch(token_ids)

    before = torch.get_num_threads()
    seen = ThreadsSeen(embedder)
    batcher = EmbedBatcher(seen, num_threads=1)
    try:
        asyncio.run(batcher.embed(["threads"]))
    finally:
        _close(batcher)
    later: list[int] = []
    fresh = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    fresh.start()
    fresh.join()
    assert seen.batches == [1] and torch.get_num_threads() == before and later == [before]
    assert default_num_threads(False) is None and default_num_threads(True, "cuda") is None
    assert default_num_threads(True) == max(1, before // 2)


def test_bad_settings(embedder):
    with pytest.raises(ValueError, match="max_batch_tokens"):
        EmbedBatcher(embedder, 0)
    with pytest.raises(ValueError, match="num_threads"):
        EmbedBatcher(embedder, num_threads=0)
