"""Each tensor-parallel layer on 2 and 3 gloo ranks equals the unsplit layer within 1e-6 (fp32), including
replicated KV heads and a vocabulary that does not divide by the size."""
from __future__ import annotations

import pytest

from pagedserve.models.layers import TPGroup, split_heads
from tp_cases import run_group


@pytest.mark.parametrize("size,heads,kv_heads", [(2, 4, 2), (3, 6, 3), (2, 4, 1)])
def test_parallel_layers_equal_unsplit(size, heads, kv_heads):
    results = run_group(size, "layer_errors", heads, kv_heads)
    assert set(results[0]) == {"qkv", "gate_up", "down", "embedding", "lm_head_tied", "lm_head"}
    for rank, errors in results.items():
        for layer, err in errors.items():
            assert err <= 1e-6, (rank, layer, err)


def test_split_heads():
    assert split_heads(9, 3, TPGroup(1, 3)) == (3, 1, 1)
    assert split_heads(4, 1, TPGroup(1, 2)) == (2, 1, 0)       # replicated: both ranks hold KV head 0
    assert split_heads(8, 2, TPGroup(3, 4)) == (2, 1, 1)       # ranks 2, 3 share KV head 1
    with pytest.raises(ValueError, match="9 query heads and 3 KV heads"):
        split_heads(9, 3, TPGroup(0, 2))


def test_metrics_carry_the_size_as_a_label():
    from prometheus_client import generate_latest

    from pagedserve.serving.metrics import ServerMetrics

    stats = dict(num_requests_running=0, num_requests_waiting=0, usage=0.0, prefix_cache_queries_tokens=0,
                 prefix_cache_hits_tokens=0, num_preemptions=0)
    metrics = ServerMetrics()
    metrics.bind_engine(lambda: stats, "m", 3)
    text = generate_latest(metrics.registry).decode()
    assert 'pagedserve:model_info{model_name="m",tensor_parallel_size="3"} 1.0' in text
