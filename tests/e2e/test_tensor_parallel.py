"""Tensor parallelism end to end on gloo (CPU): the embedded SmolLM2 (9 query heads, 3 KV heads) at
``--tensor-parallel-size 3`` gives the same greedy tokens as size 1 and as HF transformers, logits within 1e-4;
size 2 is refused at start-up naming the head counts; the quantized model (int4/Q8_0 as stored) at size 3 gives the
quantized size-1 model's greedy tokens. One size-3 server (3 processes) serves the whole module."""
from __future__ import annotations

import pytest
import torch

from support import CHAT_PROMPTS, REPO_ROOT, ServerThread, chat_ids
from tp_cases import ExecutorModel, greedy_over_grpc, prefill_logits

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tp3_server():
    from pagedserve.config import EngineConfig, ServerConfig

    s = ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=0, embedding_model=""),
                     EngineConfig(device="cpu", dtype="float32", attention_backend="torch", quantization="none",
                                  tensor_parallel_size=3, max_num_seqs=8, num_kv_blocks=256, max_model_len=2048))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tp3_client(tp3_server):
    from pagedserve_client import PagedServeClient

    with PagedServeClient(tp3_server.target, timeout_s=600) as c:
        yield c


def test_model_info_reports_the_size(tp3_client, client):
    assert tp3_client.model_info().generation.tensor_parallel_size == 3
    assert client.model_info().generation.tensor_parallel_size == 1


def test_size3_greedy_equals_size1_and_hf(tp3_client, client, hf_llm, tokenizer):
    """Four chat prompts at once, 20 tokens each (EOS masked by min_tokens): size 3 == size 1 == HF generate."""
    prompts = [chat_ids(tokenizer, p) for p in CHAT_PROMPTS[:4]]
    ours3 = greedy_over_grpc(tp3_client, prompts, 20)
    ours1 = greedy_over_grpc(client, prompts, 20)
    assert ours3 == ours1
    for ids, got in zip(prompts, ours3):
        with torch.inference_mode():
            out = hf_llm.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert got == out[0, len(ids):].tolist()


def test_size3_logits_match_size1_and_hf(tp3_server, server, hf_llm_f64, tokenizer):
    """One prefill through rank 0's TensorParallelExecutor (the workers join) of the prompt the size-1 HF test uses
    (test_generate_e2e.test_forward_logits_match_hf): within 1e-4 of HF in float64."""
    ids = chat_ids(tokenizer, CHAT_PROMPTS[0])
    tp_model = ExecutorModel(tp3_server.engine.executor)
    assert tp_model.num_kv_heads == 1 and tp3_server.engine.executor.model.tp.size == 3
    ours3 = prefill_logits(tp_model, ids)
    ours1 = prefill_logits(server.engine.executor.model, ids)
    with torch.inference_mode():
        ref = hf_llm_f64(torch.tensor([ids])).logits[0].float()
    assert ours3.shape == ref.shape
    diffs = {"size3-hf": (ours3 - ref).abs().max().item(), "size1-hf": (ours1 - ref).abs().max().item(),
             "size3-size1": (ours3 - ours1).abs().max().item()}
    print(f"\nmax |logit difference| over {len(ids)} positions: {diffs}")
    # HF in float64 is the oracle: both sizes lie within 1e-4 of it (size 1's own test), so within 2e-4 of each other
    # (they round differently: size 3 sums three partial matmuls)
    assert diffs["size3-hf"] < 1e-4 and diffs["size3-size1"] < 2e-4, diffs


def test_size2_refused_naming_the_head_counts():
    from pagedserve.config import EngineConfig
    from pagedserve.engine.builder import build_engine

    with pytest.raises(ValueError, match="9 query heads and 3 KV heads"):
        build_engine(EngineConfig(device="cpu", dtype="float32", quantization="none", tensor_parallel_size=2))


def test_quantized_shards_must_hold_whole_groups(smollm_source, llm_parts):
    """A size whose row-parallel shards would cut GGUF's 32-weight blocks (hidden 576 / 4 = 144) is refused, naming
    the size that does not split."""
    from pagedserve.config import EngineConfig
    from pagedserve.worker.tp_worker import check_quantization

    cfg = llm_parts[2]
    with pytest.raises(ValueError, match="hidden_size 576 does not split into shards of whole groups of 32"):
        check_quantization(EngineConfig(quantization="auto", tensor_parallel_size=4), smollm_source,
                           torch.device("cpu"), cfg)
    check_quantization(EngineConfig(quantization="auto", tensor_parallel_size=3), smollm_source,
                       torch.device("cpu"), cfg)   # 192 and 512 columns per shard: whole blocks


_QUANTIZED_TP_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from pagedserve.config import EngineConfig
from pagedserve.engine.builder import build_engine
from pagedserve.sampling_params import SamplingParams
from support import CHAT_PROMPTS, chat_ids, run_to_completion

outs, infos = [], []
for size in (3, 1):
    engine, info = build_engine(EngineConfig(device="cpu", dtype="float32", attention_backend="torch",
                                             quantization="auto", tensor_parallel_size=size, num_kv_blocks=128,
                                             max_model_len=1024))
    infos.append(info.quantization)
    for i, p in enumerate(CHAT_PROMPTS[:3]):
        engine.add_request(f"r{i}", chat_ids(engine.tokenizer, p), SamplingParams(max_tokens=8, temperature=0.0))
    done = run_to_completion(engine)
    outs.append([done[f"r{i}"][0][0] for i in range(3)])
    engine.close()
print(json.dumps({"outs": outs, "infos": infos}))
"""


def test_size3_quantized_equals_size1_quantized():
    """The embedded GGUF kept quantized (int4 Q4_1 linears, Q8_0 embedding and tied LM head, each rank holding its
    rows or whole-block columns) at size 3: the same greedy tokens as the quantized model at size 1 (a process of
    its own: one tensor-parallel group per process, and this module's size-3 server holds one)."""
    import json
    import os
    import subprocess
    import sys

    tests_dir = str(REPO_ROOT / "tests")   # where support.py is
    out = subprocess.run([sys.executable, "-c", _QUANTIZED_TP_SCRIPT, tests_dir], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert all("120 linear int4-g32 (Q4_1 as stored)" in q for q in got["infos"]), got["infos"]
    assert got["outs"][0] == got["outs"][1]
