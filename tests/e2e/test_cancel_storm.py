"""Cancel storm over gRPC: 200 streams cancelled at random points, some by deadlines of a few milliseconds."""
from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from pagedserve_client import pb
from pagedserve_client.v1 import inference_pb2_grpc

from support import ServerThread

pytestmark = pytest.mark.e2e

NUM_BLOCKS, BLOCK_SIZE = 64, 16


@pytest.fixture(scope="module")
def small_server():
    from pagedserve.config import EngineConfig, ServerConfig

    s = ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=0, embedding_model=""),
                     EngineConfig(device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=NUM_BLOCKS,
                                  block_size=BLOCK_SIZE, max_num_seqs=32, max_num_batched_tokens=512))
    yield s
    s.stop()


async def one_stream(stub, rng: random.Random, i: int) -> str:
    prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(5, 120))]
    req = pb.GenerateRequest(request_id=f"storm-{i}", prompt_token_ids=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(max_tokens=rng.randint(20, 200), ignore_eos=True))
    mode = rng.choice(["deadline", "cancel_after_tokens", "cancel_before_first", "cancel_after_time"])
    timeout = rng.uniform(0.001, 0.02) if mode == "deadline" else 60
    call = stub.Generate(req, timeout=timeout)
    try:
        if mode == "cancel_before_first":
            await asyncio.sleep(rng.uniform(0, 0.01))
            call.cancel()
        elif mode == "cancel_after_time":
            await asyncio.sleep(rng.uniform(0.01, 0.5))
            call.cancel()
        else:
            limit, n = rng.randint(1, 10), 0
            async for msg in call:
                n += len(msg.token_ids)
                if n >= limit:
                    call.cancel()
                    break
    except grpc.aio.AioRpcError as err:
        return err.code().name
    return (await call.code()).name


async def storm(target: str) -> list[str]:
    rng = random.Random(1234)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        return await asyncio.gather(*(one_stream(stub, random.Random(rng.random()), i) for i in range(200)))


def test_cancel_storm_frees_everything(small_server):
    outcomes = asyncio.run(storm(small_server.target))
    assert set(outcomes) <= {"CANCELLED", "DEADLINE_EXCEEDED", "OK"}, outcomes
    assert outcomes.count("DEADLINE_EXCEEDED") > 0
    engine = small_server.engine
    deadline = time.monotonic() + 10
    while engine.has_unfinished() or small_server.app.services.generation.num_live_requests:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.02)
    stats = engine.stats()
    assert stats["num_blocks_free"] == NUM_BLOCKS
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert not engine.groups
    # A request needing most of the pool is admitted at once and completes.
    preemptions = stats["num_preemptions"]
    prompt = list(range(1000, 1000 + BLOCK_SIZE * (NUM_BLOCKS - 4)))
    with grpc.insecure_channel(small_server.target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        msgs = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                                                     sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True)),
                                  timeout=120))
    assert sum(len(m.token_ids) for m in msgs) == 4
    assert engine.stats()["num_preemptions"] == preemptions


def test_embed_without_embedding_model_is_failed_precondition(small_server):
    with grpc.insecure_channel(small_server.target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(pb.EmbedRequest(inputs=["hello"]), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
