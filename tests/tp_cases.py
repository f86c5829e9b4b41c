"""Rank functions for the tensor-parallel tests (spawned processes import them from here)."""
from __future__ import annotations

import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.models import layers
from pagedserve.models.layers import TPGroup

HIDDEN, HEAD_DIM, INTER, VOCAB, TOKENS = 48, 8, 96, 50, 7   # VOCAB 50: not a multiple of 3 (padded shard)


def _full_weights(num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.1  # noqa: E731
    return {"q": r(num_heads * HEAD_DIM, HIDDEN), "k": r(num_kv_heads * HEAD_DIM, HIDDEN),
            "v": r(num_kv_heads * HEAD_DIM, HIDDEN), "qkv_bias": [r(num_heads * HEAD_DIM), r(num_kv_heads * HEAD_DIM),
                                                                  r(num_kv_heads * HEAD_DIM)],
            "gate": r(INTER, HIDDEN), "up": r(INTER, HIDDEN), "down": r(HIDDEN, INTER), "down_bias": r(HIDDEN),
            "embed": r(VOCAB, HIDDEN), "head": r(VOCAB, HIDDEN), "x": r(TOKENS, HIDDEN), "xi": r(TOKENS, INTER),
            "ids": torch.randint(0, VOCAB, (TOKENS,), generator=g)}


def _load_column(layer, pieces: list[torch.Tensor], biases=None) -> None:
    local = [layer.take(p, i, "weight") for i, p in enumerate(pieces)]
    layer.linear.weight.data.copy_(torch.cat(local))
    if biases is not None:
        layer.linear.bias.data.copy_(torch.cat([layer.take(b, i, "bias") for i, b in enumerate(biases)]))


def layer_errors(tp: TPGroup, num_heads: int, num_kv_heads: int) -> dict[str, float]:
    """Max |parallel - unsplit| of each layer on this rank (the LM head's only on rank 0)."""
    w = _full_weights(num_heads, num_kv_heads)
    x, errors = w["x"], {}
    local_q, local_kv, kv0 = layers.split_heads(num_heads, num_kv_heads, tp)
    qkv = layers.qkv_linear(HIDDEN, num_heads, num_kv_heads, HEAD_DIM, True, tp)
    _load_column(qkv, [w["q"], w["k"], w["v"]], w["qkv_bias"])
    q_rows = slice(tp.rank * local_q * HEAD_DIM, (tp.rank + 1) * local_q * HEAD_DIM)
    kv_rows = slice(kv0 * HEAD_DIM, (kv0 + local_kv) * HEAD_DIM)
    want = torch.cat([x @ w["q"][q_rows].T + w["qkv_bias"][0][q_rows], x @ w["k"][kv_rows].T + w["qkv_bias"][1][kv_rows],
                      x @ w["v"][kv_rows].T + w["qkv_bias"][2][kv_rows]], dim=-1)
    errors["qkv"] = (qkv(x) - want).abs().max().item()
    gate_up = layers.merged_column_linear(HIDDEN, INTER, 2, False, tp)
    _load_column(gate_up, [w["gate"], w["up"]])
    n = INTER // tp.size
    cols = slice(tp.rank * n, (tp.rank + 1) * n)
    want = torch.cat([x @ w["gate"][cols].T, x @ w["up"][cols].T], dim=-1)
    errors["gate_up"] = (gate_up(x) - want).abs().max().item()
    down = layers.row_linear(INTER, HIDDEN, True, tp)
    down.linear.weight.data.copy_(down.take(w["down"], None, "weight"))
    if tp.rank == 0:
        down.linear.bias.data.copy_(down.take(w["down_bias"], None, "bias"))
    errors["down"] = (down(w["xi"][:, cols]) - (w["xi"] @ w["down"].T + w["down_bias"])).abs().max().item()
    embed = layers.vocab_embedding(VOCAB, HIDDEN, tp)
    part = embed.take(w["embed"], None, "weight")
    embed.embedding.weight.data.zero_()[:part.shape[0]].copy_(part)
    errors["embedding"] = (embed(w["ids"]) - w["embed"][w["ids"]]).abs().max().item()
    for name, tied in (("lm_head_tied", embed), ("lm_head", None)):
        head = layers.ParallelLMHead(VOCAB, HIDDEN, tp, tied)
        if tied is None:
            part = head.take(w["head"], None, "weight")
            head.linear.weight.data.zero_()[:part.shape[0]].copy_(part)
        logits = head(x)
        full = x @ (w["embed"] if tied is not None else w["head"]).T
        if tp.rank == 0:
            errors[name] = (logits - full).abs().max().item()
        else:
            assert logits is None
    return errors


def run_rank(rank: int, size: int, port: int, fn_name: str, args: tuple, results) -> None:
    """Join a gloo group of ``size`` on ``port`` and put ``(rank, fn(tp, *args))`` (or the traceback) on ``results``."""
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=60))
        torch.set_num_threads(1)
        out = globals()[fn_name](TPGroup(rank, size), *args)
        results.put((rank, out))
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def run_group(size: int, fn_name: str, *args, timeout_s: float = 240) -> dict[int, object]:
    """Run ``fn_name(tp, *args)`` on ``size`` spawned ranks; {rank: result}. Raises AssertionError with a rank's
    traceback when it failed."""
    import multiprocessing

    from pagedserve.executor.tensor_parallel import free_port

    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=run_rank, args=(r, size, port, fn_name, args, results)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        out = dict(results.get(timeout=timeout_s) for _ in range(size))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, value in out.items():
        assert not isinstance(value, str), f"rank {rank} failed:\n{value}"
    return out


def save_random_llama(directory: str, num_heads: int = 4, num_kv_heads: int = 2) -> None:
    """An HF Llama checkpoint (safetensors, config, a word tokenizer) with random N(0, 0.1) weights and an untied
    head: 2 layers, hidden 64, head_dim 16, vocab 512 (small enough to load in every spawned rank at once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from backend_cases import word_tokenizer

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=16,
                      max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    word_tokenizer(cfg.vocab_size).save_pretrained(directory)


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """float32 ``[T, vocab]`` logits of one prefill of ``ids`` through a pagedserve model (torch attention, a
    fresh KV cache of this rank's heads)."""
    from support import prefill_hidden

    hidden = prefill_hidden(model, ids)
    with torch.inference_mode():
        return model.compute_logits(hidden)


def greedy_over_grpc(client, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of token-id prompts, sent at once (they share batches)."""
    import concurrent.futures

    def one(ids):
        return [t for r in client.generate(prompt_token_ids=ids, temperature=0.0, max_tokens=max_tokens,
                                           min_tokens=max_tokens) for t in r.token_ids]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


class ExecutorModel:
    """An executor seen as a model for :func:`prefill_logits`: its forward and LM head (every rank joins), its
    local model's shapes."""

    def __init__(self, executor):
        self.executor = executor
        model = executor.model
        self.num_layers, self.num_kv_heads, self.head_dim = model.num_layers, model.num_kv_heads, model.head_dim

    def __call__(self, input_ids, positions, kv_caches, meta, backend):
        return self.executor.execute_model(input_ids, positions, kv_caches, meta, backend)

    def compute_logits(self, hidden):
        return self.executor.compute_logits(hidden)


def checkpoint_prefill_logits(tp: TPGroup, directory: str, ids: list[int], quantization: str = "none",
                              linear_kernels: str = "auto"):
    """Rank function: the float32 ``[T, vocab]`` logits (as nested lists: a tensor would travel as a shared-memory
    handle that dies with the rank) of one prefill of ``ids`` through the checkpoint in ``directory`` (or a GGUF
    file) built at this rank's shard (rank 0; None elsewhere), with ``quantization`` and ``linear_kernels`` as
    :func:`~pagedserve.models.registry.build_model` takes them."""
    from pagedserve.models.loader import ModelSource
    from pagedserve.models.registry import build_model

    source = ModelSource.resolve(directory)
    model = build_model(source, source.load_config(), torch.float32, "cpu", quantization=quantization, tp=tp,
                        linear_kernels=linear_kernels)
    logits = prefill_logits(model, ids)
    return logits.tolist() if tp.rank == 0 else None
