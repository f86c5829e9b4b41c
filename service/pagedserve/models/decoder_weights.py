"""Weight loading of :class:`~.decoder.DecoderForCausalLM` (HF names into fused, possibly tensor-parallel or
quantized parameters), as a mixin, and :func:`split_fused` for families whose checkpoints fuse projections."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from . import layers


class DecoderWeights:
    """The loading half of the decoder model (its ``tp``, ``layers``, ``tie_word_embeddings`` come from it)."""

    # ---- weights ----------------------------------------------------------------------------------------------
    _STACKED = {  # HF name fragment -> (our param fragment, shard index); ".gate_proj." also in experts
        "self_attn.q_proj.": ("self_attn.qkv_proj.", 0), "self_attn.k_proj.": ("self_attn.qkv_proj.", 1),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", 2), ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def hf_weights(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """The checkpoint's tensors under Llama's HF names (a family whose names differ overrides this)."""
        return iter(weights)

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
        for name, tensor in self.hf_weights(weights):
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            if name.endswith(".weight") and name.removesuffix(".weight") in params:
                name = name.removesuffix(".weight")  # norms are bare parameters
            target, shard = name, None
            for hf, (ours, idx) in self._STACKED.items():
                if hf in name:
                    target, shard = name.replace(hf, ours), idx
                    break
            target, tensor, padded = layers.take_for_rank(modules, target, shard, tensor)
            if self.tp.size > 1 and target.endswith(".self_attn.sinks"):   # per query head: this rank's heads
                local = self.layers[0].self_attn.num_heads
                tensor = tensor[self.tp.rank * local:(self.tp.rank + 1) * local]
            if self.tp.size > 1 and target.endswith((".self_attn.q_norm", ".self_attn.k_norm")) and \
                    self.layers[0].self_attn.qk_norm == "projection":   # OLMo 2: this rank's rows of the norm
                attn = self.layers[0].self_attn
                start = attn.projection_rows[0 if target.endswith("q_norm") else 1][0]
                tensor = tensor[start:start + (attn.q_size if target.endswith("q_norm") else attn.kv_size)]
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


def split_fused(name: str, tensor, fused: str, parts: list[tuple[str, int]]) -> Iterator[tuple[str, object]]:
    """A fused checkpoint tensor (rows ``[a | b | ...]``, e.g. Phi-3's ``qkv_proj``) as its named parts: ``parts``
    is ``[(name fragment, rows)]`` replacing ``fused`` in ``name``. A quantized weight (:mod:`.quant`, e.g. a GGUF
    file's Q4_0 ``attn_qkv``) is cut by rows as stored, its codes and scales untouched."""
    dense = isinstance(tensor, torch.Tensor)
    total = tensor.shape[0] if dense else tensor.codes.shape[0]
    if sum(rows for _, rows in parts) != total:
        raise ValueError(f"weight {name!r}: {total} rows, expected {sum(rows for _, rows in parts)}")
    start = 0
    for frag, rows in parts:
        yield name.replace(fused, frag), (tensor[start:start + rows] if dense
                                          else tensor.rows(torch.arange(start, start + rows)))
        start += rows
