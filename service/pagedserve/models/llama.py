"""Llama-family causal LM forward over a paged KV cache (Llama 2/3, Mistral, Qwen2, SmolLM).

Follows HF transformers' ``LlamaForCausalLM`` math (RMSNorm, neox-style rotary embedding, grouped-query attention
(Ainslie et al. 2023), SwiGLU MLP), but on a flattened batch of the step's new tokens, with attention delegated to an
:class:`~pagedserve.attention.base.AttentionBackend` that reads and writes the paged KV cache. Q/K/V and gate/up
projections are fused into one matmul each. ``forward`` has no host synchronization.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..kernels import elementwise_ref as ops
from . import layers
from .layers import SINGLE, TPGroup
from ..attention.base import AttentionBackend, AttentionMetadata


class LlamaAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, tp: TPGroup = SINGLE):
        super().__init__()
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # this rank's heads (all of them at size 1)
        self.num_heads, self.num_kv_heads, _ = layers.split_heads(total_heads, total_kv_heads, tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.layer_idx = layer_idx
        qkv_bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
        self.qkv_proj = layers.qkv_linear(cfg.hidden_size, total_heads, total_kv_heads, self.head_dim, qkv_bias, tp)
        self.o_proj = layers.row_linear(total_heads * self.head_dim, cfg.hidden_size,
                                        bool(getattr(cfg, "attention_bias", False)), tp)

    def forward(self, positions, hidden, kv_cache, meta, backend: AttentionBackend, cos_sin):
        T, qk_size = hidden.shape[0], self.q_size + self.kv_size
        qkv = self.qkv_proj(hidden)
        # q and k rotated in one call: their heads are adjacent in the fused output ([T, H + Hkv, D], strided rows)
        qk = backend.elementwise.rotary_embedding(
            positions, qkv[:, :qk_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim), cos_sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, qk_size:].reshape(T, self.num_kv_heads, self.head_dim)
        if meta is None:  # compiled forward: attention + KV write as one opaque op reading the step context
            out = torch.ops.pagedserve.paged_attention(q, k, v, self.layer_idx, self.scale)
        else:
            out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, tp: TPGroup = SINGLE):
        super().__init__()
        self.gate_up_proj = layers.merged_column_linear(cfg.hidden_size, cfg.intermediate_size, 2, False, tp)
        self.down_proj = layers.row_linear(cfg.intermediate_size, cfg.hidden_size, False, tp)

    def forward(self, x, elementwise: ops.ElementwiseOps = ops.TORCH_OPS):
        return self.down_proj(elementwise.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, positions, hidden, residual, kv_cache, meta, backend, cos_sin):
        ew = backend.elementwise
        h, residual = ew.rms_norm(hidden, self.input_layernorm, self.eps, residual)
        h = self.self_attn(positions, h, kv_cache, meta, backend, cos_sin)
        h, residual = ew.rms_norm(h, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(h, ew), residual


class LlamaForCausalLM(nn.Module):
    """The model. Built from a transformers ``PretrainedConfig``; weights come from :meth:`load_weights`.

    Attributes used by the engine: ``num_layers``, ``num_kv_heads`` (this rank's), ``head_dim``, ``vocab_size``.
    ``tp``: this process's tensor-parallel rank and size (:mod:`.layers`); at size 1 the layers are plain ones.
    """

    def __init__(self, cfg, tp: TPGroup = SINGLE):
        super().__init__()
        if getattr(cfg, "rope_scaling", None) not in (None, {}) and \
                (cfg.rope_scaling.get("rope_type") or cfg.rope_scaling.get("type")) not in ("default", None):
            raise ValueError(f"rope_scaling {cfg.rope_scaling} is not supported yet")
        self.config, self.tp = cfg, tp
        self.embed_tokens = layers.vocab_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if tp.size > 1:
            self.lm_head = layers.ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp,
                                                 self.embed_tokens if self.tie_word_embeddings else None)
        else:
            self.lm_head = None if self.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        attn = self.layers[0].self_attn
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_hidden_layers, attn.num_kv_heads, attn.head_dim
        self.vocab_size = cfg.vocab_size
        self.quantization = "none"  # what GetModelInfo reports; set by load_weights for quantized weights
        self.linear_kernels = "torch"  # whose kernels run the linears; models.registry sets "pagedserve-cpu"
        self.fused_decode = None  # a .fused_decode.FusedDecode when cpu_linear.use_vnni made one (decode steps in C++)
        theta = getattr(cfg, "rope_theta", None)
        if theta is None:
            theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rope_theta = float(theta)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        if not self.norm.is_meta:  # under a meta device, build_model calls this after to_empty()
            self.reset_rotary_cache()

    def refresh_fused_decode(self) -> None:
        """(Re)build :attr:`fused_decode` from the layers' VNNI state, None where it cannot run (called by
        :func:`.cpu_linear.use_vnni`)."""
        from .fused_decode import FusedDecode

        self.fused_decode = FusedDecode.build(self)

    def reset_rotary_cache(self) -> None:
        """(Re)build the fp32 ``[max_position_embeddings, head_dim]`` rotary table on the model's device."""
        device = self.norm.device
        self.cos_sin_cache = ops.rotary_cos_sin_cache(
            self.head_dim, self.config.max_position_embeddings, self.rope_theta, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """One step over the flattened batch.

        Args:
            input_ids: ``[T]`` int64 token ids of the step's new tokens.
            positions: ``[T]`` int64 absolute positions.
            kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: the step's attention metadata; None inside a compiled forward, whose attention layers call the
                ``pagedserve::paged_attention`` custom op (:mod:`pagedserve.attention.opaque`) instead, reading the
                metadata and caches from the step context (``kv_caches`` is then unused).
            backend: the attention backend; its ``elementwise`` ops run the RMSNorms, rotary embedding and SwiGLU.
                A decode-only step that :attr:`fused_decode` takes runs the whole stack in one C++ call instead
                (:mod:`.fused_decode`: the same kernels, the same result).

        Returns:
            Final hidden states ``[T, hidden]`` (after the last RMSNorm), the model dtype.
        """
        hidden = self.embed_tokens(input_ids)
        fused = self.fused_decode
        if fused is not None and fused.takes(hidden.shape[0], meta, backend, kv_caches):
            return fused(hidden, positions, kv_caches, meta, self.cos_sin_cache)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv, meta, backend, self.cos_sin_cache)
        hidden, _ = backend.elementwise.rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab_size]`` float32 logits (a quantized LM head when the weights are).
        Under tensor parallelism every rank must call it; rank 0 gets the gathered logits, the others None."""
        if self.tp.size > 1:
            return self.lm_head(hidden)
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    # ---- weights ----------------------------------------------------------------------------------------------
    _STACKED = {  # HF name fragment -> (our param fragment, shard index)
        "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, object]], plan=None) -> None:
        """Copy HF-named tensors (``model.layers.0.self_attn.q_proj.weight``...) into the fused parameters.

        With a :class:`~.quant_load.QuantPlan`, the model's linears and embedding are placeholders
        (:func:`~.quant_load.prepare_model`): their weights (tensors or quantized weights) are collected and the
        layers built at the end (:func:`~.quant_load.finalize`). Without one, quantized weights are dequantized.

        Raises:
            ValueError: on an unknown name, a shape mismatch, or parameters left unloaded.
        """
        from . import quant_load

        if self.tp.size > 1 and self.tie_word_embeddings and plan is None:  # (re)tie: to_empty() gives each module its own tensor
            self.lm_head.linear.weight = self.embed_tokens.embedding.weight
        params = dict(self.named_parameters())
        modules = dict(self.named_modules()) if self.tp.size > 1 else {}
        pending = {n: m for n, m in self.named_modules()
                   if isinstance(m, (quant_load.PendingLinear, quant_load.PendingEmbedding))}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            name = name.replace("input_layernorm.weight", "input_layernorm") \
                .replace("post_attention_layernorm.weight", "post_attention_layernorm")
            if name == "norm.weight":
                name = "norm"
            target, shard = name, None
            for hf, (ours, idx) in self._STACKED.items():
                if hf in name:
                    target, shard = name.replace(hf, ours), idx
                    break
            target, tensor, padded = layers.take_for_rank(modules, target, shard, tensor)
            if tensor is None:  # nothing of it on this rank (a row-parallel bias off rank 0)
                continue
            owner = target.removesuffix(".weight")
            if owner in pending:
                pending[owner].add(shard, tensor)
                continue
            if not isinstance(tensor, torch.Tensor):
                tensor = tensor.dequantize()
            if target not in params:
                raise ValueError(f"unexpected weight {name!r}")
            param = params[target]
            dst = param.data if shard is None else self._shard(param.data, target, shard)
            if padded and dst.shape[0] > tensor.shape[0]:  # the last vocabulary shard: zero padding rows
                dst.zero_()
                dst = dst[:tensor.shape[0]]
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(f"{target}#{shard}")
        expected = {f"{n}#{s}" for n in params for s in self._shards_of(n)}
        missing = expected - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}...")
        if pending:
            quant_load.finalize(self, plan, tied_lm_head=self.tie_word_embeddings)
            self.quantization = plan.summary()

    def _shards_of(self, name: str) -> list:
        if "qkv_proj" in name:
            return [0, 1, 2]
        if "gate_up_proj" in name:
            return [0, 1]
        return [None]

    def _shard(self, data: torch.Tensor, name: str, idx: int) -> torch.Tensor:
        if "qkv_proj" in name:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [data.shape[0] // 2] * 2
        start = sum(sizes[:idx])
        return data[start:start + sizes[idx]]
