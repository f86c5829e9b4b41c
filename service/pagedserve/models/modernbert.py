"""ModernBERT encoder and its sequence-classification head (Warner et al. 2024, "Smarter, Better, Faster, Longer: A
Modern Bidirectional Encoder"), computing what HF ``ModernBertForSequenceClassification`` returns as ``logits``.

Token embeddings then LayerNorm (no position table); N pre-LayerNorm layers (layer 0 without its attention norm)
of bidirectional self-attention with rotary positions (GPT-NeoX halves) and a GeGLU MLP (``Wi`` gives the input and
the gate: ``Wo(act(input) * gate)``); a final LayerNorm. Layers alternate global attention (every key, rope theta
``rope_parameters.full_attention``) and local attention (keys within ``local_attention // 2`` positions either
side, ``rope_parameters.sliding_attention``), as ``config.layer_types`` lists them. Linears and norms carry biases
only where the config says (``attention_bias``, ``mlp_bias``, ``norm_bias``, ``classifier_bias``; the classifier
always has one). The head pools the first token (``classifier_pooling: "cls"``) or the mean of the real tokens
("mean"), then ``norm(act(dense(x)))`` and the classifier.

Sequences run packed as in :mod:`.bert` (:class:`~pagedserve.models.bert.PackedBatch`): per-token layers on the
real tokens, attention on the padded grid with padded keys masked. Module and parameter names are HF's, so the
checkpoint's tensors load by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from ..kernels.elementwise_ref import rotary_embedding
from .bert import HIDDEN_ACTIVATIONS, PackedBatch, safetensors_files
from .rope import rope_table

FULL, SLIDING = "full_attention", "sliding_attention"


def _check(cond: bool, model_dir: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{model_dir!r}: {msg}")


def _layer_norm(cfg, h: int) -> nn.LayerNorm:
    return nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)


class ModernBertAttention(nn.Module):
    def __init__(self, cfg, local: bool):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, h // cfg.num_attention_heads
        self.Wqkv = nn.Linear(h, 3 * h, bias=cfg.attention_bias)   # rows: [query; key; value]
        self.Wo = nn.Linear(h, h, bias=cfg.attention_bias)
        self.window = cfg.local_attention // 2 if local else None  # keys at most this far either side

    def forward(self, x: torch.Tensor, batch: PackedBatch, rope: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]`` packed -> ``[T, H]``; ``rope`` this layer kind's cos/sin table."""
        t, h = x.shape
        q, k, v = self.Wqkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotary_embedding(batch.positions, q, rope), rotary_embedding(batch.positions, k, rope)
        b, s = batch.num_seqs, batch.max_len
        grid = [batch.to_grid(y.reshape(t, h)).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
                for y in (q, k, v)]
        mask = batch.key_mask
        if self.window is not None and s > self.window + 1:
            pos = torch.arange(s, device=x.device)
            near = ((pos[:, None] - pos[None, :]).abs() <= self.window)[None, None]
            mask = near if mask is None else mask & near
        out = F.scaled_dot_product_attention(*grid, attn_mask=mask)              # [B, heads, S, head_dim]
        return self.Wo(batch.from_grid(out.transpose(1, 2).reshape(b, s, h)))


class ModernBertMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = HIDDEN_ACTIVATIONS[cfg.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(value) * gate)


class ModernBertLayer(nn.Module):
    """``x = x + Attn(norm(x)); x = x + MLP(norm(x))`` (layer 0 without the attention norm)."""

    def __init__(self, cfg, index: int):
        super().__init__()
        self.kind = cfg.layer_types[index]
        self.attn_norm = nn.Identity() if index == 0 else _layer_norm(cfg, cfg.hidden_size)
        self.attn = ModernBertAttention(cfg, self.kind == SLIDING)
        self.mlp_norm = _layer_norm(cfg, cfg.hidden_size)
        self.mlp = ModernBertMLP(cfg)

    def forward(self, x: torch.Tensor, batch: PackedBatch, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), batch, rope)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = _layer_norm(cfg, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = ModernBertEmbeddings(cfg)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = _layer_norm(cfg, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor, batch: PackedBatch, ropes: dict[str, torch.Tensor]) -> torch.Tensor:
        """``input_ids`` ``[T]`` packed -> ``[T, H]`` (HF ``last_hidden_state``'s real tokens)."""
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, batch, ropes[layer.kind])
        return self.final_norm(x)


class ModernBertHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.act = HIDDEN_ACTIVATIONS[cfg.classifier_activation]
        self.norm = _layer_norm(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertSequenceClassifier(nn.Module):
    """HF ``ModernBertForSequenceClassification``'s forward on packed sequences (a
    :class:`~pagedserve.models.cross_encoder.SequenceClassifier`)."""

    def __init__(self, cfg):
        super().__init__()
        self.model = ModernBertModel(cfg)
        self.head = ModernBertHead(cfg)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
        self.pooling = cfg.classifier_pooling
        self.num_labels, self.vocab_size = cfg.num_labels, cfg.vocab_size
        self.max_input_tokens = cfg.max_position_embeddings
        self.architecture = (cfg.architectures or ["ModernBertForSequenceClassification"])[0]
        self.ropes: dict[str, torch.Tensor] = {}   # layer kind -> [max_position_embeddings, head_dim] float32

    def build_ropes(self, cfg, device: torch.device | str) -> None:
        """The cos/sin tables of each layer kind (computed, not stored in the checkpoint), float32 on ``device``."""
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.ropes = {kind: rope_table(dict(cfg.rope_parameters[kind]), head_dim, cfg.max_position_embeddings,
                                       device) for kind in set(cfg.layer_types)}

    def classify_packed(self, input_ids: torch.Tensor, batch: PackedBatch,
                        token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`~pagedserve.models.cross_encoder.SequenceClassifier.classify_packed` (ModernBERT has no
        segment ids: ``token_type_ids`` must be None or all 0)."""
        hidden = self.model(input_ids, batch, self.ropes)
        ends = torch.cumsum(batch.lengths, 0)
        if self.pooling == "cls":
            pooled = hidden[ends - batch.lengths]
        else:
            seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=hidden.device), batch.lengths)
            summed = hidden.new_zeros(batch.num_seqs, hidden.shape[1]).index_add_(0, seq, hidden)
            pooled = summed / batch.lengths[:, None].to(hidden.dtype)
        return self.classifier(self.head(pooled))


def check_config(cfg, model_dir: str) -> None:
    """Refuse at load what the forward above does not compute exactly, naming the config field.

    Raises:
        ValueError: an unknown layer type, rope type, pooling or activation.
    """
    _check(cfg.hidden_size % cfg.num_attention_heads == 0, model_dir,
           f"hidden_size {cfg.hidden_size} is not a multiple of num_attention_heads {cfg.num_attention_heads}")
    _check(set(cfg.layer_types) <= {FULL, SLIDING} and len(cfg.layer_types) == cfg.num_hidden_layers, model_dir,
           f"layer_types {cfg.layer_types!r}: expected {cfg.num_hidden_layers} of {FULL!r} / {SLIDING!r}")
    for kind in set(cfg.layer_types):
        params = (cfg.rope_parameters or {}).get(kind) or {}
        _check(params.get("rope_type", "default") == "default" and "rope_theta" in params, model_dir,
               f"rope_parameters.{kind} {params!r} is not supported (default rope with a rope_theta only)")
    _check(cfg.classifier_pooling in ("cls", "mean"), model_dir,
           f"classifier_pooling {cfg.classifier_pooling!r} is not supported (cls or mean)")
    for name in ("hidden_activation", "classifier_activation"):
        _check(getattr(cfg, name) in HIDDEN_ACTIVATIONS, model_dir,
               f"{name} {getattr(cfg, name)!r} is not supported; expected one of {sorted(HIDDEN_ACTIVATIONS)}")


def load_modernbert_classifier(model_dir: str, device: torch.device | str = "cpu",
                               dtype: torch.dtype = torch.float32) -> ModernBertSequenceClassifier:
    """Build a :class:`ModernBertSequenceClassifier` from a HF directory (config.json + safetensors), eval mode.

    Raises:
        FileNotFoundError: the weights are missing.
        ValueError: see :func:`check_config`; a tensor of the wrong shape, or one missing from the checkpoint.
    """
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    check_config(cfg, model_dir)
    with torch.device("meta"):
        model = ModernBertSequenceClassifier(cfg)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in params:
                    continue   # e.g. a masked-LM decoder left in the checkpoint
                tensor = f.get_tensor(name)
                _check(tensor.shape == params[name].shape, model_dir,
                       f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
                params[name].data.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    _check(not missing, model_dir, f"weights missing from the checkpoint: {missing[:8]}")
    model = model.to(dtype).eval().requires_grad_(False)
    model.build_ropes(cfg, device)
    return model
