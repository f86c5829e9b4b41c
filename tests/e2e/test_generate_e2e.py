"""End to end over gRPC against the embedded SmolLM2-135M-Instruct: HF transformers is the oracle."""
from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
import torch

from pagedserve_client import pb
from support import CHAT_PROMPTS, chat_ids, wait_all_blocks_free

pytestmark = pytest.mark.e2e

MULTILINGUAL_PROMPTS = [
    "Écris une phrase en français avec beaucoup d'accents: é, è, ê, à, ç.",
    "请用中文写一句关于春天的话。",
    "Reply with five emoji that describe a birthday party 🎉.",
    "Schreibe einen Satz über Bäume, Flüsse und Grüße auf Deutsch.",
]


def stream(client, **kwargs) -> list:
    return list(client.generate(**kwargs))


def test_forward_logits_match_hf(server, hf_llm_f64, tokenizer):
    """One prefill forward of our model against HF's LlamaForCausalLM run in float64: logits within 1e-4 (HF's own
    float32 forward is 9.3e-5 from it)."""
    from pagedserve.attention.base import AttentionMetadata
    from pagedserve.attention.torch_ref import TorchAttentionBackend
    from pagedserve.worker.kv_tensors import allocate_kv_caches

    model = server.engine.executor.model
    ids = chat_ids(tokenizer, CHAT_PROMPTS[0])
    T, bs = len(ids), 16
    nb = -(-T // bs)
    kv = allocate_kv_caches(model.num_layers, nb, bs, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T), block_tables=torch.arange(nb, dtype=torch.int32)[None],
        context_lens=torch.tensor([T], dtype=torch.int32), query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        query_lens=torch.tensor([T], dtype=torch.int32), max_query_len=T, max_context_len=T, num_decode_seqs=0,
        query_lens_cpu=[T], context_lens_cpu=[T])
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(T), kv, meta, TorchAttentionBackend()))
        ref = hf_llm_f64(torch.tensor([ids])).logits[0]
    assert (ours.double() - ref).abs().max().item() < 1e-4


def test_concurrent_greedy_equals_hf_generate(server, client, hf_llm, tokenizer):
    """8 chat prompts sent at once (they share batches): greedy tokens identical to HF generate. min_tokens on our
    side and min_new_tokens on HF's both mask EOS, so every completion runs its full length."""
    max_tokens = [16 + 4 * i for i in range(len(CHAT_PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(CHAT_PROMPTS)) as pool:
        futures = [pool.submit(stream, client, messages=[("user", p)], temperature=0.0, max_tokens=m, min_tokens=m)
                   for p, m in zip(CHAT_PROMPTS, max_tokens)]
        results = [f.result() for f in futures]
    for prompt, m, responses in zip(CHAT_PROMPTS, max_tokens, results):
        ours = [t for r in responses for t in r.token_ids]
        ids = chat_ids(tokenizer, prompt)
        with torch.inference_mode():
            out = hf_llm.generate(torch.tensor([ids]), max_new_tokens=m, min_new_tokens=m, do_sample=False)
        assert ours == out[0, len(ids):].tolist(), prompt
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == m
        assert responses[-1].usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("prompt", MULTILINGUAL_PROMPTS)
def test_stream_deltas_join_to_full_detokenization(client, tokenizer, prompt):
    responses = stream(client, messages=[("user", prompt)], temperature=0.0, max_tokens=48)
    for r in responses:
        assert "\ufffd" not in r.text
    ids = [t for r in responses for t in r.token_ids]
    text = "".join(r.text for r in responses)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_sampled_stream_with_seed_is_reproducible(client):
    kwargs = dict(prompt="Once upon a time", temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24)
    a = [t for r in stream(client, **kwargs) for t in r.token_ids]
    b = [t for r in stream(client, **kwargs) for t in r.token_ids]
    assert a == b and len(a) > 0


def test_stop_string_ends_before_match(client, tokenizer):
    base = stream(client, prompt="1, 2, 3, 4, 5, 6,", temperature=0.0, max_tokens=30, ignore_eos=True)
    full = "".join(r.text for r in base)
    assert " 9" in full
    responses = stream(client, prompt="1, 2, 3, 4, 5, 6,", temperature=0.0, max_tokens=30, stop=[" 9"])
    text = "".join(r.text for r in responses)
    assert text == full[:full.index(" 9")]
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert responses[-1].matched_stop_str == " 9"


def test_cancel_mid_generation_frees_all_blocks(client):
    wait_all_blocks_free(client)
    it = client.generate(prompt="Tell me a very long story about dragons.", max_tokens=400, ignore_eos=True,
                         temperature=0.0)
    got = 0
    for r in it:
        got += len(r.token_ids)
        if got >= 5:
            break
    it.close()
    wait_all_blocks_free(client)


def test_deadline_aborts_request_and_frees_blocks(client):
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(prompt="Count to one thousand:", max_tokens=500, ignore_eos=True, timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_all_blocks_free(client)


def test_no_input_is_invalid_argument(server):
    from pagedserve_client.v1 import inference_pb2_grpc

    with grpc.insecure_channel(server.target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input" in err.value.details()


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt="hi", temperature=-1.0), "sampling.temperature"),
    (dict(prompt="hi", top_p=0.0), "sampling.top_p"),
    (dict(prompt="hi", max_tokens=0), "sampling.max_tokens"),
    (dict(prompt_token_ids=[1, 2, 10 ** 6]), "prompt_token_ids"),
    (dict(prompt="hi", stop=[""]), "sampling.stop"),
    (dict(prompt_token_ids=[5] * 9000), "prompt"),
    (dict(prompt=""), "prompt"),
])
def test_bad_input_is_invalid_argument_naming_the_field(client, kwargs, field):
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(**kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    ok = stream(client, prompt="Hello", max_tokens=3, temperature=0.0)
    assert sum(len(r.token_ids) for r in ok) == 3


def test_prompt_at_max_model_len_is_rejected(server, client):
    n = server.engine.max_model_len
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(prompt_token_ids=[5] * n))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.value.details()


def test_duplicate_live_request_id_is_already_exists(client):
    it = client.generate(prompt="Write a long poem.", request_id="dup-1", max_tokens=200, ignore_eos=True)
    next(iter(it))
    with pytest.raises(grpc.RpcError) as err:
        list(client.generate(prompt="x", request_id="dup-1", max_tokens=2))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert client.abort(["dup-1"]) == ["dup-1"]
    rest = list(it)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert client.abort(["dup-1", "never-existed"]) == []
