"""One decoder-only causal LM assembled from options, over a paged KV cache; each family is a small file naming its
options (:mod:`.llama`, :mod:`.qwen`, :mod:`.phi3`, :mod:`.granite`, :mod:`.olmo2`, :mod:`.smollm3`).

The math of HF transformers' ``LlamaForCausalLM`` and the families built on it: RMSNorm, rotary embedding
(neox-style, over all or the first ``rotary_dim`` features of a head; tables of :mod:`.rope`), grouped-query
attention (Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020); the options are what the families change: per-head
(Qwen3) or whole-projection (OLMo 2) q/k RMSNorm, norms after the sublayers instead of before (OLMo 2), layers
without rotary (SmolLM3's NoPE layers), embedding/residual/attention multipliers and a logits divisor (Granite),
biases. The forward runs on a flattened batch of the step's new tokens, attention delegated to an
:class:`~pagedserve.attention.base.AttentionBackend` that reads and writes the paged KV cache; Q/K/V and gate/up
projections are fused into one matmul each. ``forward`` has no host synchronization.

What a family's config asks for and this decoder cannot run exactly is refused when the model is built, naming the
config field (:class:`UnsupportedConfig`); what is exact only up to a context length (a rope type that changes with
the length) sets :attr:`DecoderSpec.max_exact_len`, which caps the engine's context. Sliding-window layers (Mistral,
Qwen2's upper layers, Phi-3, ...) pass their window to the attention backend, which masks keys outside it.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..attention.base import AttentionBackend, AttentionMetadata
from ..kernels import elementwise_ref as ops
from . import layers
from .layers import SINGLE, TPGroup
from .config_checks import UnsupportedConfig, layer_windows, require
from .decoder_spec import DecoderSpec
from .decoder_weights import DecoderWeights, split_fused  # noqa: F401 (split_fused: the families' import)
from .moe import SparseMoeBlock
from .rope import inv_freq_and_factor, rope_parameters, rope_table, rotary_dim_of


def llama_biases(cfg) -> dict:
    """Llama's bias options: Q/K/V and output from ``attention_bias``, gate/up and down from ``mlp_bias``."""
    bias = bool(getattr(cfg, "attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


class DecoderAttention(nn.Module):
    def __init__(self, cfg, spec: DecoderSpec, layer_idx: int, rotary_dim: int, tp: TPGroup = SINGLE):
        super().__init__()
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # this rank's heads (all of them at size 1)
        self.num_heads, self.num_kv_heads, first_kv = layers.split_heads(total_heads, total_kv_heads, tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = spec.attention_multiplier if spec.attention_multiplier is not None else self.head_dim ** -0.5
        self.layer_idx = layer_idx
        self.rotary_dim = rotary_dim if (spec.rope_layers is None or spec.rope_layers[layer_idx]) else 0
        #: keys this layer's queries see, counting their own (None: the whole context)
        self.sliding_window = spec.sliding_windows[layer_idx] if spec.sliding_windows else None
        self.qk_norm, self.eps = spec.qk_norm, cfg.rms_norm_eps
        self.softcap = spec.attn_softcap
        if spec.attention_sinks:   # this rank's heads' sink logits (load_weights slices the checkpoint's)
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.qkv_proj = layers.qkv_linear(cfg.hidden_size, total_heads, total_kv_heads, self.head_dim,
                                          spec.qkv_bias, tp)
        self.o_proj = layers.row_linear(total_heads * self.head_dim, cfg.hidden_size, spec.o_bias, tp)
        if spec.qk_norm == "head":
            self.q_norm = nn.Parameter(torch.ones(self.head_dim))
            self.k_norm = nn.Parameter(torch.ones(self.head_dim))
        elif spec.qk_norm == "projection":   # OLMo 2: this rank's slice of weights normed over the whole row
            self.tp = tp
            self.q_norm = nn.Parameter(torch.ones(self.q_size))
            self.k_norm = nn.Parameter(torch.ones(self.kv_size))
            #: (first row, width of the whole projection, ranks holding each row) of q and k: load_weights slices
            #: the checkpoint's norm weights by the first, the forward's mean square uses the others
            self.projection_rows = ((tp.rank * self.q_size, total_heads * self.head_dim, 1),
                                    (first_kv * self.head_dim, total_kv_heads * self.head_dim,
                                     max(1, tp.size // total_kv_heads)))

    def _qk(self, positions, qkv: torch.Tensor, ew: ops.ElementwiseOps, cos_sin) -> torch.Tensor:
        """``[T, heads + kv_heads, head_dim]``: q and k normed as the spec says and rotated."""
        T, H, Hk, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk_size = self.q_size + self.kv_size
        if self.qk_norm == "none":
            # q and k rotated in one call: their heads are adjacent in the fused output ([T, H + Hk, D], strided)
            qk = qkv[:, :qk_size].view(T, H + Hk, D)
        elif self.qk_norm == "head":
            q = ew.rms_norm(qkv[:, :self.q_size].reshape(T * H, D), self.q_norm, self.eps)[0]
            k = ew.rms_norm(qkv[:, self.q_size:qk_size].reshape(T * Hk, D), self.k_norm, self.eps)[0]
            qk = torch.cat([q.view(T, H, D), k.view(T, Hk, D)], dim=1)
        elif self.tp.size == 1:
            q = ew.rms_norm(qkv[:, :self.q_size].contiguous(), self.q_norm, self.eps)[0]
            k = ew.rms_norm(qkv[:, self.q_size:qk_size].contiguous(), self.k_norm, self.eps)[0]
            qk = torch.cat([q, k], dim=-1).view(T, H + Hk, D)
        else:
            (_, q_total, q_copies), (_, k_total, k_copies) = self.projection_rows
            q = self._sliced_rms_norm(qkv[:, :self.q_size], self.q_norm, q_total, q_copies)
            k = self._sliced_rms_norm(qkv[:, self.q_size:qk_size], self.k_norm, k_total, k_copies)
            qk = torch.cat([q, k], dim=-1).view(T, H + Hk, D)
        if self.rotary_dim == D:
            return ew.rotary_embedding(positions, qk, cos_sin)
        if self.rotary_dim == 0:
            return qk
        rotated = ew.rotary_embedding(positions, qk[..., :self.rotary_dim], cos_sin)
        return torch.cat([rotated, qk[..., self.rotary_dim:]], dim=-1)

    def _sliced_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, total: int, copies: int) -> torch.Tensor:
        """RMSNorm of rows split across the tensor-parallel ranks (transformers' ``Olmo2RMSNorm`` over the whole
        projection): ``x`` ``[T, n]`` is this rank's slice of ``[T, total]`` rows, each element held by ``copies``
        ranks (replicated KV heads); the float32 sum of squares is all-reduced, so every rank scales its slice by
        the whole row's ``rsqrt(mean square + eps)``, then by its slice of ``weight``. Returns ``[T, n]``."""
        xf = x.float()
        sq = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        return weight * (xf * torch.rsqrt(sq / (total * copies) + self.eps)).to(x.dtype)

    def forward(self, positions, hidden, kv_cache, meta, backend: AttentionBackend, cos_sin):
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk = self._qk(positions, qkv, backend.elementwise, cos_sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].reshape(T, self.num_kv_heads, self.head_dim)
        sinks = getattr(self, "sinks", None)
        if meta is None:  # compiled forward: attention + KV write as one opaque op reading the step context
            out = torch.ops.pagedserve.paged_attention(q, k, v, self.layer_idx, self.scale, self.sliding_window or 0,
                                                       self.softcap or 0.0, sinks)
        else:
            out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                  softcap=self.softcap, sinks=sinks)
        return self.o_proj(out.reshape(T, self.q_size))


class DecoderMLP(nn.Module):
    def __init__(self, cfg, spec: DecoderSpec, tp: TPGroup = SINGLE):
        super().__init__()
        self.gate_up_proj = layers.merged_column_linear(cfg.hidden_size, cfg.intermediate_size, 2, spec.mlp_bias, tp)
        self.down_proj = layers.row_linear(cfg.intermediate_size, cfg.hidden_size, spec.mlp_bias, tp)
        self.gelu = spec.mlp_act == "gelu_tanh"

    def forward(self, x, elementwise: ops.ElementwiseOps = ops.TORCH_OPS):
        act = elementwise.gelu_tanh_and_mul if self.gelu else elementwise.silu_and_mul
        return self.down_proj(act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, spec: DecoderSpec, layer_idx: int, rotary_dim: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, spec, layer_idx, rotary_dim, tp)
        sparse = spec.moe is not None and spec.moe.sparse_layers[layer_idx]
        self.mlp = SparseMoeBlock(cfg.hidden_size, spec.moe, tp) if sparse else DecoderMLP(cfg, spec, tp)
        self.eps, self.post_norms = cfg.rms_norm_eps, spec.norm_layout == "post"
        self.sandwich = spec.norm_layout == "sandwich"
        self.residual_multiplier = spec.residual_multiplier
        if self.sandwich:
            for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                setattr(self, name, nn.Parameter(torch.ones(cfg.hidden_size)))
        elif self.post_norms:
            self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
            self.post_feedforward_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        else:
            self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
            self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, positions, hidden, residual, kv_cache, meta, backend, cos_sin):
        ew = backend.elementwise
        if self.post_norms:  # OLMo 2: h = x + norm(attn(x)); out = h + norm(mlp(h)); the residual is the stream
            h = self.self_attn(positions, hidden, kv_cache, meta, backend, cos_sin)
            hidden = hidden + ew.rms_norm(h, self.post_attention_layernorm, self.eps)[0]
            h = self.mlp(hidden, ew)
            return hidden + ew.rms_norm(h, self.post_feedforward_layernorm, self.eps)[0], None
        if self.sandwich:  # Gemma: h = x + post(attn(in(x))); out = h + post_ff(mlp(pre_ff(h)))
            h, residual = ew.rms_norm(hidden, self.input_layernorm, self.eps, residual)
            h = self.self_attn(positions, h, kv_cache, meta, backend, cos_sin)
            h = ew.rms_norm(h, self.post_attention_layernorm, self.eps)[0]
            h, residual = ew.rms_norm(h, self.pre_feedforward_layernorm, self.eps, residual)
            h = self.mlp(h, ew)
            return ew.rms_norm(h, self.post_feedforward_layernorm, self.eps)[0], residual
        m = self.residual_multiplier
        h, residual = ew.rms_norm(hidden, self.input_layernorm, self.eps, residual)
        h = self.self_attn(positions, h, kv_cache, meta, backend, cos_sin)
        h, residual = ew.rms_norm(h if m == 1.0 else h * m, self.post_attention_layernorm, self.eps, residual)
        h = self.mlp(h, ew)
        return (h if m == 1.0 else h * m), residual


class DecoderForCausalLM(DecoderWeights, nn.Module):
    """The model. Built from a transformers ``PretrainedConfig``; weights come from :meth:`load_weights`.

    A family subclasses it and overrides :meth:`family_spec` (the options its config sets; its own refusals raised
    there) and, where its checkpoint names differ, :meth:`hf_weights`.

    Attributes used by the engine: ``num_layers``, ``num_kv_heads`` (this rank's), ``head_dim``, ``vocab_size``,
    ``max_exact_len`` (see :class:`DecoderSpec`). ``tp``: this process's tensor-parallel rank and size
    (:mod:`.layers`); at size 1 the layers are plain ones.

    Raises:
        UnsupportedConfig: a config field the decoder cannot run exactly (named in the message).
    """

    #: Whether the family reads ``sliding_window`` / ``layer_types`` as its HF class does (Mistral, Mixtral, Qwen2/3,
    #: Phi-3, SmolLM3). False where transformers ignores them (Llama, Granite, OLMo 2): a stray field changes nothing.
    sliding_window_attention: bool = False

    @classmethod
    def spec_of(cls, cfg) -> DecoderSpec:
        """The options of ``cfg``: :meth:`family_spec` under what every family shares (the MLP is SwiGLU; in a
        family with :attr:`sliding_window_attention`, each layer's window from :func:`~.config_checks.layer_windows`
        unless the family set them)."""
        spec = cls.family_spec(cfg)
        if spec.mlp_act == "silu":
            require(cfg, "hidden_act", ("silu",), "the MLP runs SwiGLU")
        if cls.sliding_window_attention and spec.sliding_windows is None:
            spec = replace(spec, sliding_windows=layer_windows(cfg))
        return spec

    @classmethod
    def family_spec(cls, cfg) -> DecoderSpec:
        """What this family's config sets (Llama's: the biases of :func:`llama_biases`); families override it."""
        return DecoderSpec(**llama_biases(cfg))

    def __init__(self, cfg, tp: TPGroup = SINGLE):
        super().__init__()
        spec = self.spec_of(cfg)
        self.config, self.tp, self.spec = cfg, tp, spec
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        sets, self.layer_rope = self.rope_parameter_sets(cfg)
        self.rope_params, self.extra_rope_params = sets[0], list(sets[1:])
        self.rotary_dim = rotary_dim_of(cfg, head_dim, self.rope_params)
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise UnsupportedConfig(f"partial_rotary_factor gives {self.rotary_dim} rotary features per head; "
                                    f"it must be even and positive")
        # validates the rope parameters before any weight is read (under build_model's meta device: no data)
        for params in sets:
            _, _, exact = inv_freq_and_factor(params, self.rotary_dim, cfg.max_position_embeddings)
            if exact is not None:
                kind = params.get("rope_type")
                spec = self.spec = spec.capped(exact, f"rope_parameters.rope_type={kind!r} (transformers changes "
                                                      f"its frequencies past {exact} tokens)")
        self.max_exact_len, self.max_exact_len_reason = spec.max_exact_len, spec.max_exact_len_reason
        self.embed_tokens = layers.vocab_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, i, self.rotary_dim, tp)
                                    for i in range(cfg.num_hidden_layers))
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
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        for i in range(len(self.extra_rope_params)):
            self.register_buffer(f"cos_sin_cache_{i + 1}", torch.empty(0), persistent=False)
        if not self.norm.is_meta:  # under a meta device, build_model calls this after to_empty()
            self.reset_rotary_cache()

    @property
    def plain_llama(self) -> bool:
        """Whether every layer is Llama's, sliding windows allowed (what the fused C++ decode stack,
        :mod:`.fused_decode`, runs)."""
        s = self.spec
        return (s.qk_norm == "none" and s.norm_layout == "pre" and s.rope_layers is None and s.moe is None
                and s.embedding_multiplier == 1.0 and s.residual_multiplier == 1.0 and s.logits_scaling == 1.0
                and s.attention_multiplier is None and self.rotary_dim == self.head_dim and s.mlp_act == "silu"
                and s.attn_softcap is None and s.final_softcap is None and not s.attention_sinks
                and not self.extra_rope_params)

    def attention_features(self) -> dict[str, str]:
        """What the attention layers need of the backend beyond causal attention, each with the config field
        asking for it (:func:`~pagedserve.attention.base.check_features` refuses a backend lacking one)."""
        s, cfg, needs = self.spec, self.config, {}
        if s.sliding_windows and any(s.sliding_windows):
            needs["sliding_window"] = f"sliding_window={getattr(cfg, 'sliding_window', None)!r}"
        if s.attn_softcap is not None:
            needs["softcap"] = f"attn_logit_softcapping={s.attn_softcap!r}"
        if s.attention_sinks:
            needs["sinks"] = f"model_type={getattr(cfg, 'model_type', '')!r} (attention sinks)"
        return needs

    @classmethod
    def rope_parameter_sets(cls, cfg) -> tuple[list[dict], tuple[int, ...] | None]:
        """``(rope parameter dicts, per layer the index of its dict or None: all use the first)``. One set
        (:func:`~.rope.rope_parameters`) unless a family's layers rotate differently (Gemma 3's local layers)."""
        return [rope_parameters(cfg)], None

    @property
    def host_sync_reason(self) -> str | None:
        """Why the forward reads the host mid-step (so it cannot be compiled or graph-captured), or None."""
        if self.spec.moe is not None:
            return "the mixture-of-experts layers count each expert's tokens on the host (models/moe.py)"
        return None

    def refresh_fused_decode(self) -> None:
        """(Re)build :attr:`fused_decode` from the layers' VNNI state, None where it cannot run (called by
        :func:`.cpu_linear.use_vnni`)."""
        from .fused_decode import FusedDecode

        self.fused_decode = FusedDecode.build(self)

    def reset_rotary_cache(self) -> None:
        """(Re)build the fp32 ``[max_position_embeddings, rotary_dim]`` rotary table (:mod:`.rope`) on the model's
        device."""
        n = self.config.max_position_embeddings
        self.cos_sin_cache = rope_table(self.rope_params, self.rotary_dim, n, self.norm.device)
        for i, params in enumerate(self.extra_rope_params):
            setattr(self, f"cos_sin_cache_{i + 1}", rope_table(params, self.rotary_dim, n, self.norm.device))

    def _rope_tables(self) -> list[torch.Tensor]:
        """Each layer's rotary table."""
        if self.layer_rope is None:
            return [self.cos_sin_cache] * self.num_layers
        tables = [self.cos_sin_cache] + [getattr(self, f"cos_sin_cache_{i + 1}")
                                         for i in range(len(self.extra_rope_params))]
        return [tables[i] for i in self.layer_rope]

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
        if self.spec.embedding_multiplier != 1.0:
            hidden = hidden * self.spec.embedding_multiplier
        residual = None
        for i, (layer, kv, cos_sin) in enumerate(zip(self.layers, kv_caches, self._rope_tables())):
            layer_meta = None if meta is None else meta.for_layer(i)   # its KV group's block tables
            hidden, residual = layer(positions, hidden, residual, kv, layer_meta, backend, cos_sin)
        hidden, _ = backend.elementwise.rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab_size]`` float32 logits (a quantized LM head when the weights are), divided
        by the spec's ``logits_scaling`` and soft-capped by its ``final_softcap``. Under tensor parallelism every
        rank must call it; rank 0 gets the gathered logits, the others None."""
        if self.tp.size > 1:
            logits = self.lm_head(hidden)
        elif self.lm_head is None:
            logits = torch.nn.functional.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if logits is not None and self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        cap = self.spec.final_softcap
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


