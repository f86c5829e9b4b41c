"""CUDA graphs of decode steps, on CPU: the fixed-grid decode launch (geometry from the batch size and the context
capacity only, empty partitions, padded rows) against the torch reference on the host emulator, and the graph
runner (engine/cuda_graphs.py) with :class:`graph_cases.HostReplay` standing in for the graph: static buffers,
padding, eager fallback, and greedy tokens equal to eager ones. Real graphs:
tests/kernel_tests/gpu/test_cuda_graphs_gpu.py."""
from __future__ import annotations

import functools

import pytest
import torch

import backend_cases as bc
import graph_cases as gc
import kernel_cases as kc
from pagedserve.attention.cuda import CudaAttentionBackend
from pagedserve.attention.torch_ref import TorchAttentionBackend
from pagedserve.worker.cuda_graphs import capture_cuda_graphs
from pagedserve.worker.compiled import COMPILE_BY_DEFAULT_ON_CPU, use_compiled
from pagedserve.worker.cuda_graphs import CudaGraphForward
from pagedserve.sampling_params import SamplingParams
from pagedserve import kernels
from pagedserve.kernels import ModuleKey
from pagedserve.kernels import geometry as geo
from simt import Simulator, unavailable

needs_sim = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
CPU = torch.device("cpu")
# Fixed grid split into partitions: 8 sequences at a 2048-token capacity -> 8 slots for the fixed 256-token
# partitions, of which the 700-token context reads 3 and the others 1; 3 padded rows.
SPLIT = dict(ctx=[1, 16, 17, 130, 700], heads=8, kv_heads=2, capacity=2048, num_padded=3)
# Capacity inside one partition: no merge; the decode kernel itself zeroes the padded rows.
SINGLE = dict(ctx=[1, 100, 256], heads=9, kv_heads=3, capacity=256, num_padded=2)
# 2 layers of SmolLM2's attention shape (9 heads, 3 KV heads, head_dim 64).
TINY_SHAPE = dict(bc.SMOLLM_SHAPE, num_hidden_layers=2, vocab_size=2048, intermediate_size=384, hidden_size=576)


@pytest.fixture(scope="module")
def sim():
    with Simulator().install() as s:
        yield s


@needs_sim
@pytest.mark.parametrize("dtype", kc.DTYPES, ids=str)
def test_fixed_grid_decode_with_empty_partitions(sim, dtype):
    plan = kc.check_decode_fixed(CPU, dtype, 128, 16, **SPLIT)
    assert (plan.num_partitions, plan.partition_size) == (8, 256)
    assert any(name.startswith("paged_decode_merge_kernel") for name, *_ in sim.launches)


@needs_sim
@pytest.mark.parametrize("window", [20, 200])
def test_fixed_grid_decode_sliding_window(sim, window):
    """The graph's fixed grid under a sliding window: planned for the window's reach (not the capacity), real rows
    equal the windowed reference, padded rows are zeros."""
    plan = kc.check_decode_fixed(CPU, torch.float16, 128, 16, **SPLIT, window=window)
    assert plan.sliding_window == window
    assert plan.num_partitions == 2  # a window of 20 or 200 keys may straddle one partition boundary
    assert plan.num_partitions < geo.plan_decode_fixed("float16", 8, 2048, 8, 2, 128, 16).num_partitions


@needs_sim
def test_fixed_grid_decode_single_partition(sim):
    plan = kc.check_decode_fixed(CPU, torch.bfloat16, 64, 32, **SINGLE)
    assert plan.num_partitions == 1


def test_fixed_plan_is_the_plan_at_capacity():
    """The fixed plan is the host planner's for every context at capacity (the largest grid a step can need);
    a host plan for short contexts would have one partition, which is why replays cannot reuse it. Either way the
    partitions are the fixed 256 keys: the plans differ in slots, not in any sequence's values."""
    fixed = geo.plan_decode_fixed("float16", 8, 2048, 8, 2, 128, 16)
    assert fixed == geo.plan_decode("float16", [2048] * 8, 8, 2, 128, 16)
    assert geo.plan_decode("float16", [100] * 8, 8, 2, 128, 16).num_partitions == 1
    assert geo.plan_decode_fixed("float16", 8, 2048, 8, 2, 128, 16, sliding_window=300).num_partitions == 3
    with pytest.raises(ValueError, match="num_seqs"):
        geo.plan_decode_fixed("float16", 0, 2048, 8, 2, 128, 16)


@pytest.mark.skipif(not kernels.nvrtc_available(), reason="NVRTC or the CUDA headers are not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fixed_grid_kernels_compile_with_nvrtc(arch):
    """The fixed grid launches instantiations the decode module holds; NVRTC compiles them for the GPU (no
    register spills), with the smem the plan asks for within the sm_80 opt-in limit (163 KiB)."""
    plan = geo.plan_decode_fixed("bfloat16", 64, 8192, 9, 3, 64, 16)
    key = ModuleKey("decode", "bfloat16", 64, 16, arch)
    names = (geo.decode_kernel_name("bfloat16", 64, 16, plan.gqa_tile), geo.decode_merge_kernel_name("bfloat16", 64))
    result = kernels.compile_to_cubin(key)
    for name in names:
        assert name in result.lowered_names and result.resources[name].spill_store_bytes == 0
    assert plan.num_partitions > 1 and plan.smem_bytes <= 163 * 1024 and plan.merge_smem_bytes <= 48 * 1024


@needs_sim
@pytest.mark.parametrize("old,new,case", [
    # the merge drops a context's last, partly filled partition
    ("const int used = min(num_slots, num_partitions(context_lens[seq], sliding_window));",
     "const int used = min(num_slots, num_partitions(context_lens[seq], sliding_window)) - 1;", SPLIT),
    ("if (ctx <= 0 && slot == 0)", "if (false)", SINGLE),  # padded rows left unwritten
], ids=["merge-floor", "padded-not-zeroed"])
def test_planted_fixed_grid_bug_is_caught(old, new, case):
    with Simulator(transform=kc.planted(old, new)).install():
        with pytest.raises(AssertionError):
            kc.check_decode_fixed(CPU, torch.float16, 64, 16, **case)


def test_policy_on_cuda_and_cpu():
    cuda, ref = CudaAttentionBackend(), TorchAttentionBackend()
    assert use_compiled(None, cuda, "cuda") and use_compiled(False, cuda, "cuda")
    assert not use_compiled(True, cuda, "cuda") and not use_compiled(None, cuda, "cuda", tensor_parallel_size=2)
    assert use_compiled(None, ref, "cuda") is False
    with pytest.raises(RuntimeError, match="cuda attention backend"):
        use_compiled(False, ref, "cuda")
    assert use_compiled(None, ref, "cpu") is COMPILE_BY_DEFAULT_ON_CPU
    with pytest.raises(ValueError, match="cannot be captured"):
        CudaGraphForward(None, ref, [(torch.zeros(1), torch.zeros(1))], 1024, 16)


@pytest.fixture(scope="module")
def tiny(random_llama_model):
    """The shared random Llama builder at SmolLM2's head shape (head_dim 64, which the CUDA kernels need)."""
    return random_llama_model(**TINY_SHAPE)


def graph_engine(sim, tiny, sizes=(1, 2, 4, 8), **overrides):
    """An engine on the emulated cuda backend whose runner replays host stand-ins of CUDA graphs."""
    model, cfg, tokenizer = tiny
    engine, info = gc.build(model, cfg, tokenizer, gc.engine_config("cpu", True, 8, **overrides),
                            backend=CudaAttentionBackend())
    runner = engine.executor.worker.runner
    runner.compiled = CudaGraphForward(model, runner.backend, runner.kv_caches, info.max_model_len,
                                       runner.block_size, sizes, graph_factory=functools.partial(gc.HostReplay, sim))
    runner.compiled.warm_up()
    return engine


@needs_sim
def test_graph_replay_greedy_equals_eager(sim, tiny):
    """11 prompts over 8 running (decode batches of 8, then 3 padded to 4), one sharing a 64-token prefix with
    another (prefix-cache hit), chunked prefill (steps with a prefill run eager)."""
    model, cfg, tokenizer = tiny
    prompts = gc.random_prompts(10, cfg.vocab_size, seed=0)
    prompts.append(prompts[4][:64] + prompts[1] if len(prompts[4]) >= 64 else prompts[1] * 2)
    eager, _ = gc.build(model, cfg, tokenizer, gc.engine_config("cpu", True, 8), backend=CudaAttentionBackend())
    expected = gc.greedy_tokens(eager, prompts, 8)
    engine = graph_engine(sim, tiny)
    assert gc.greedy_tokens(engine, prompts, 8) == expected
    graphs = engine.executor.worker.runner.compiled
    assert graphs.steps_by_size[8] > 0 and graphs.steps_by_size[4] > 0 and graphs.num_eager_steps > 0
    assert len({tuple(t) for t in expected.values()}) > 1, "outputs should depend on the prompt"


@needs_sim
def test_graph_replay_with_preemption_and_n(sim, tiny):
    """A KV cache too small for the batch (preemption and recompute) and n = 2 (children share the prompt's
    blocks); max_model_len 256 gives the single-partition fixed grid."""
    model, cfg, tokenizer = tiny
    prompts = gc.random_prompts(6, cfg.vocab_size, seed=1, lengths=(40, 90))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2)
    small = dict(num_kv_blocks=24, max_model_len=256)
    eager, _ = gc.build(model, cfg, tokenizer, gc.engine_config("cpu", True, 8, **small),
                        backend=CudaAttentionBackend())
    expected = gc.greedy_tokens(eager, prompts, 0, params=params)
    engine = graph_engine(sim, tiny, **small)
    assert gc.greedy_tokens(engine, prompts, 0, params=params) == expected
    assert engine.scheduler.num_preemptions > 0 and sum(engine.executor.worker.runner.compiled.steps_by_size.values()) > 0


@needs_sim
@torch.inference_mode()
def test_padded_rows_write_no_kv_and_match_eager(sim, tiny):
    """A decode step of 3 sequences replays the size-4 graph: its output equals the eager model's, and the KV
    caches change only at the 3 sequences' slots (the padded row has slot -1)."""
    model, *_ = tiny
    engine = graph_engine(sim, tiny)
    runner, graphs = engine.executor.worker.runner, engine.executor.worker.runner.compiled
    for k, v in runner.kv_caches:
        k.normal_(), v.normal_()
    ctx, tables = [5, 20, 33], [[0, 0, 0], [1, 2, 0], [3, 4, 5]]
    slots = [tables[i][(c - 1) // 16] * 16 + (c - 1) % 16 for i, c in enumerate(ctx)]
    i32 = dict(dtype=torch.int32)
    from pagedserve.attention.base import AttentionMetadata
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, **i32),
        context_lens=torch.tensor(ctx, **i32), query_start_loc=torch.arange(4, **i32),
        query_lens=torch.ones(3, **i32), max_query_len=1, max_context_len=max(ctx), num_decode_seqs=3,
        query_lens_cpu=[1] * 3, context_lens_cpu=ctx)
    ids, positions = torch.tensor([7, 8, 9]), torch.tensor([c - 1 for c in ctx])
    eager_caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    expected = model(ids, positions, eager_caches, meta, runner.backend)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    hidden = graphs(ids, positions, meta)
    assert graphs.steps_by_size[4] == 1
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    for (k, v), (k0, v0), (ke, ve) in zip(runner.kv_caches, before, eager_caches):
        changed = ((k != k0).flatten(2).any(-1) | (v != v0).flatten(2).any(-1)).flatten().nonzero().flatten()
        assert sorted(changed.tolist()) == sorted(slots)
        # not bit for bit: this random model's linears are torch's, whose results change with the padded row
        # (already layer 0's K/V); the attention itself is the same bits in the graph's grid and the eager plan
        # (kernel_cases.check_decode_fixed)
        torch.testing.assert_close(k, ke, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, ve, atol=1e-5, rtol=1e-5)


@needs_sim
def test_failed_capture_falls_back_to_eager(sim, tiny):
    """On CPU torch.cuda.graph cannot capture: with enforce_eager None the builder's capture logs and returns
    None (the engine runs eager); with enforce_eager False start-up fails."""
    model, cfg, tokenizer = tiny
    engine, info = gc.build(model, cfg, tokenizer, gc.engine_config("cpu", True, 2), backend=CudaAttentionBackend())
    runner = engine.executor.worker.runner
    for enforce_eager in (None, False):
        config = gc.engine_config("cpu", enforce_eager, 2)
        call = functools.partial(capture_cuda_graphs, config, model, runner.backend, runner.kv_caches,
                                 info.max_model_len)
        if enforce_eager is None:
            assert call() is None
        else:
            with pytest.raises(RuntimeError):
                call()
