"""CUDA graphs of decode steps on a GPU: graph replay gives eager's greedy tokens at batch 1, 8 and 64 on a
random-weight Llama of SmolLM2-135M's shape (cuda attention backend, fp32 so that greedy ties cannot flip between
the eager decode plan and the graphs' fixed grid), and TPOT with and without graphs, printed (not asserted) and
written to ``$PAGEDSERVE_DEVICE_LOGS/cuda_graphs_tpot.txt`` when scripts/device_check.sh sets it. The emulator
version of the same checks: tests/kernel_tests/test_cuda_graphs_simt.py."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import backend_cases as bc
import graph_cases as gc
from pagedserve.worker.compiled import DEFAULT_COMPILE_SIZES

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cupy")

BATCHES = (1, 8, 64)
BIG_BUDGET = dict(max_num_batched_tokens=8192)  # each batch prefills in one step, then decodes at full size


@pytest.fixture(scope="module")
def engines():
    """(eager engine, graph engine, graph engine's info, config) over one SmolLM2-shaped model."""
    model, cfg, tokenizer = bc.random_llama(torch.device("cuda"), **bc.SMOLLM_SHAPE)
    eager, eager_info = gc.build(model, cfg, tokenizer, gc.engine_config("cuda", True, 64, **BIG_BUDGET))
    graphs, info = gc.build(model, cfg, tokenizer, gc.engine_config("cuda", False, 64, **BIG_BUDGET))
    assert not eager_info.compiled and not eager_info.cuda_graphs and eager.executor.worker.runner.compiled is None
    return eager, graphs, info, cfg


def test_graph_replay_greedy_equals_eager_at_batch_1_8_64(engines):
    eager, graphs, info, cfg = engines
    assert info.compiled and info.cuda_graphs and info.compile_s > 0
    runner = graphs.executor.worker.runner.compiled
    assert runner.sizes == list(DEFAULT_COMPILE_SIZES)
    for batch in BATCHES:
        prompts = gc.random_prompts(batch, cfg.vocab_size, seed=batch)
        expected = gc.greedy_tokens(eager, prompts, 12, tag=f"b{batch}-")
        replays = runner.steps_by_size[batch]
        got = gc.greedy_tokens(graphs, prompts, 12, tag=f"b{batch}-")
        assert runner.steps_by_size[batch] > replays, f"batch {batch}: no decode step replayed its graph"
        assert got == expected, f"batch {batch}: graph replay tokens differ from eager"


def test_tpot_with_and_without_graphs(engines, capsys):
    """Mean decode step time (TPOT) once every request decodes, 32 tokens each, eager then graphs, per batch."""
    eager, graphs, _, cfg = engines
    lines = []
    for batch in BATCHES:
        prompts = gc.random_prompts(batch, cfg.vocab_size, seed=100 + batch)
        gc.decode_tpot_s(graphs, prompts, 4)  # warm: cuBLAS heuristics and allocator for this batch
        gc.decode_tpot_s(eager, prompts, 4)
        eager_s = gc.decode_tpot_s(eager, prompts, 32)
        graph_s = gc.decode_tpot_s(graphs, prompts, 32)
        lines.append(f"TPOT batch {batch}: eager {eager_s * 1e3:.2f} ms, cuda graphs {graph_s * 1e3:.2f} ms "
                     f"({eager_s / graph_s:.2f}x) [SmolLM2-135M shape, fp32, {torch.cuda.get_device_name()}]")
        assert eager_s > 0 and graph_s > 0
    logs = os.environ.get("PAGEDSERVE_DEVICE_LOGS")
    if logs:
        Path(logs, "cuda_graphs_tpot.txt").write_text("\n".join(lines) + "\n")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
