"""BERT encoder forward (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding"), computing what HF ``transformers.BertModel`` returns as ``last_hidden_state``; the RoBERTa family
(RoBERTa, XLM-RoBERTa, CamemBERT: the same encoder with position ids after the padding index) is covered too.

Embeddings (word + token type + absolute position, then LayerNorm), then N post-LayerNorm layers of bidirectional
self-attention (padding keys masked out) and a GELU MLP. Weights come from a HF model directory's safetensors; the
HF weight names are mapped to ours in :func:`map_weight_name`, apart from the math. Q, K and V are fused into one
projection (``qkv_proj``) so each layer does one input GEMM for attention.

Sequences run packed end to end (:class:`PackedBatch`, the "unpadded" layout of TEI / FlashAttention varlen): every
per-token layer works on the ``[T, H]`` real tokens only, and only attention sees a padded ``[B, S]`` grid, so a
batch of mixed lengths wastes compute on padding in attention alone.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

# HF ``hidden_act`` names -> activation (HF ACT2FN semantics: "gelu" is the exact erf form).
HIDDEN_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


# HF model_type -> position ids start after the padding index (RoBERTa's create_position_ids_from_input_ids).
# The rest of these encoders is BERT's: same layers, same weight names under the "bert." / "roberta." prefix.
MODEL_TYPES = {"bert": False, "roberta": True, "xlm-roberta": True, "camembert": True}


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The fields of a HF ``config.json`` the forward needs (a :data:`MODEL_TYPES` encoder, absolute positions)."""

    architecture: str              # config.architectures[0], e.g. "BertModel"
    vocab_size: int
    hidden_size: int               # model width H
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int         # MLP width
    hidden_act: str                # key of HIDDEN_ACTIVATIONS
    max_position_embeddings: int   # rows of the absolute position table: the longest input, in tokens
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    position_offset: int = 0       # first position id: 0 for BERT, pad_token_id + 1 for the RoBERTa family

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.hidden_act not in HIDDEN_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; "
                             f"expected one of {sorted(HIDDEN_ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_input_tokens(self) -> int:
        """The longest input the position table allows, special tokens included."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_pretrained(cls, model_dir: str) -> BertConfig:
        """Read ``model_dir/config.json`` through ``transformers.AutoConfig``.

        Raises:
            FileNotFoundError: no config.json.
            ValueError: a model type not in :data:`MODEL_TYPES`, or a position embedding type other than
                "absolute".
        """
        from transformers import AutoConfig

        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
        hf = AutoConfig.from_pretrained(model_dir)
        if hf.model_type not in MODEL_TYPES:
            raise ValueError(f"{model_dir!r}: model_type {hf.model_type!r} is not supported "
                             f"(expected one of {sorted(MODEL_TYPES)})")
        position_type = getattr(hf, "position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"{model_dir!r}: position_embedding_type {position_type!r} is not supported")
        pad = hf.pad_token_id if hf.pad_token_id is not None else 0
        return cls(
            architecture=(hf.architectures or ["BertModel"])[0],
            vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads, intermediate_size=hf.intermediate_size,
            hidden_act=hf.hidden_act, max_position_embeddings=hf.max_position_embeddings,
            type_vocab_size=hf.type_vocab_size, layer_norm_eps=hf.layer_norm_eps,
            pad_token_id=pad, position_offset=pad + 1 if MODEL_TYPES[hf.model_type] else 0,
        )


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """B sequences laid end to end in T tokens (no padding), and how they map onto a right-padded ``[B, S]`` grid.

    Per-token layers (embeddings, projections, MLP, LayerNorm) run on the ``[T, H]`` packed tokens, so padding
    costs nothing there; only attention runs on the grid, with padded keys masked out.
    """

    lengths: torch.Tensor             # [B] int64, each >= 1
    max_len: int                      # S, the longest sequence
    positions: torch.Tensor           # [T] int64 position ids, 0 .. length-1 within each sequence
    grid_index: torch.Tensor | None   # [T] int64 flat grid slot b * S + t of each token; None: no padding (T = B*S)
    key_mask: torch.Tensor | None     # [B, 1, 1, S] bool, True for a real key; None: no padding

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str = "cpu") -> PackedBatch:
        lens = torch.tensor(lengths, dtype=torch.int64)
        s = int(lens.max())
        starts = torch.cumsum(lens, 0) - lens
        positions = torch.arange(int(lens.sum()), dtype=torch.int64) - torch.repeat_interleave(starts, lens)
        if bool((lens == s).all()):
            index = mask = None
        else:
            rows = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int64), lens)
            index = (rows * s + positions).to(device)
            mask = (torch.arange(s)[None, :] < lens[:, None])[:, None, None, :].to(device)
        return cls(lens.to(device), s, positions.to(device), index, mask)

    @property
    def num_seqs(self) -> int:
        return self.lengths.shape[0]

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, C]`` packed rows -> ``[B, S, C]`` (padded slots zero)."""
        b, s, c = self.num_seqs, self.max_len, x.shape[-1]
        if self.grid_index is None:
            return x.view(b, s, c)
        grid = x.new_zeros(b * s, c)
        grid.index_copy_(0, self.grid_index, x)
        return grid.view(b, s, c)

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """``[B, S, C]`` -> ``[T, C]``, the real tokens only."""
        flat = grid.reshape(-1, grid.shape[-1])
        return flat if self.grid_index is None else flat.index_select(0, self.grid_index)


class BertEmbeddings(nn.Module):
    """word + token type + absolute position embeddings, then LayerNorm (dropout is off at inference)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.position_offset = cfg.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """``input_ids``, ``positions`` ``[T]`` int64 (0-based within each sequence; the model's position offset
        is added here), ``token_type_ids`` ``[T]`` or None (all 0) -> ``[T, H]``."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.norm(x + self.position_embeddings(positions + self.position_offset))


class BertLayer(nn.Module):
    """One post-LN encoder layer: ``x = LN(x + Attn(x)); x = LN(x + MLP(x))``."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(h, 3 * h)           # rows: [query; key; value]
        self.o_proj = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.up_proj = nn.Linear(h, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, h)
        self.mlp_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = HIDDEN_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """``x`` ``[T, H]`` packed tokens of ``batch`` -> ``[T, H]``."""
        b, s, h = batch.num_seqs, batch.max_len, x.shape[-1]
        qkv = batch.to_grid(self.qkv_proj(x)).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)                                                  # each [B, heads, S, head_dim]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.key_mask)  # softmax(QK^T / sqrt(d)) V
        attn = batch.from_grid(attn.transpose(1, 2).reshape(b, s, h))
        x = self.attn_norm(x + self.o_proj(attn))
        return self.mlp_norm(x + self.down_proj(self.act(self.up_proj(x))))


class BertEncoder(nn.Module):
    """The BERT encoder stack without the pooler head; gives HF ``last_hidden_state``."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward_packed(self, input_ids: torch.Tensor, batch: PackedBatch,
                       token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Encode sequences packed end to end: ``input_ids`` ``[T]`` int64 (``T = batch.lengths.sum()``),
        ``token_type_ids`` ``[T]`` or None (a single segment) -> ``[T, H]`` hidden states in the model's dtype."""
        x = self.embeddings(input_ids, batch.positions, token_type_ids)
        for layer in self.layers:
            x = layer(x, batch)
        return x

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Encode a right-padded batch (HF ``BertModel`` calling convention).

        Args:
            input_ids: ``[B, S]`` int64 token ids, ``S <= max_position_embeddings``.
            attention_mask: ``[B, S]`` bool (True for real tokens, a prefix of each row), or None when no row is
                padded. Every row needs at least one real token.
            token_type_ids: ``[B, S]`` int64 segment ids, or None for all zeros (a single segment).

        Returns:
            ``[B, S, H]`` hidden states in the model's dtype; padded positions are zero.
        """
        b, s = input_ids.shape
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        batch = PackedBatch.from_lengths(real.sum(dim=1).tolist(), input_ids.device)
        types = None if token_type_ids is None else token_type_ids[real]
        hidden = self.forward_packed(input_ids[real], batch, types)
        out = hidden.new_zeros(b, s, hidden.shape[-1])
        out[real] = hidden
        return out


# HF names under "encoder.layer.{i}." -> (our name under "layers.{i}.", row shard of qkv_proj or None).
_LAYER_WEIGHTS = {
    "attention.self.query": ("qkv_proj", 0),
    "attention.self.key": ("qkv_proj", 1),
    "attention.self.value": ("qkv_proj", 2),
    "attention.output.dense": ("o_proj", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("up_proj", None),
    "output.dense": ("down_proj", None),
    "output.LayerNorm": ("mlp_norm", None),
}
_EMBEDDING_WEIGHTS = {"word_embeddings": "word_embeddings", "position_embeddings": "position_embeddings",
                      "token_type_embeddings": "token_type_embeddings", "LayerNorm": "norm"}
_IGNORED_PREFIXES = ("pooler.", "cls.", "lm_head.", "classifier.", "qa_outputs.", "embeddings.position_ids",
                     "embeddings.token_type_ids")


def map_weight_name(hf_name: str) -> tuple[str, int | None] | None:
    """Map a HF BERT checkpoint tensor name to ``(our parameter name, qkv shard index or None)``.

    Accepts names with or without the ``bert.`` / ``roberta.`` prefix (base model vs *For* checkpoints) and the old
    TF-style ``gamma``/``beta`` LayerNorm names. Returns None for tensors the encoder does not use (pooler, task heads,
    the ``position_ids`` buffer). Raises ValueError for an unknown embeddings/encoder tensor.
    """
    name = hf_name.removeprefix("bert.").removeprefix("roberta.")
    if name.startswith(_IGNORED_PREFIXES) or not name.startswith(("embeddings.", "encoder.layer.")):
        return None
    module, _, leaf = name.rpartition(".")
    leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)
    if module.startswith("embeddings."):
        ours = _EMBEDDING_WEIGHTS.get(module.removeprefix("embeddings."))
        if ours is not None:
            return f"embeddings.{ours}.{leaf}", None
    else:
        index, _, sub = module.removeprefix("encoder.layer.").partition(".")
        if index.isdigit() and sub in _LAYER_WEIGHTS:
            ours, shard = _LAYER_WEIGHTS[sub]
            return f"layers.{index}.{ours}.{leaf}", shard
    raise ValueError(f"unexpected BERT weight {hf_name!r}")


def safetensors_files(model_dir: str) -> list[str]:
    """``model.safetensors``, or the shards listed in ``model.safetensors.index.json``. Raises FileNotFoundError."""
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    raise FileNotFoundError(f"no model.safetensors (or model.safetensors.index.json) in {model_dir!r}")


def _copy_weight(param: torch.Tensor, shard: int | None, tensor: torch.Tensor, hf_name: str) -> None:
    target = param.data if shard is None else param.data.chunk(3, dim=0)[shard]
    if target.shape != tensor.shape:
        raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def load_bert(model_dir: str, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> BertEncoder:
    """Build a :class:`BertEncoder` from a HF model directory (config.json + safetensors) in eval mode.

    Raises:
        FileNotFoundError: config.json or the safetensors file is missing.
        ValueError: an unsupported config, an unknown or mis-shaped weight, or a weight missing from the file.
    """
    cfg = BertConfig.from_pretrained(model_dir)
    files = safetensors_files(model_dir)
    with torch.device("meta"):
        model = BertEncoder(cfg).to(dtype)
    model = model.to_empty(device=device)            # uninitialised: every tensor must come from the file
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int | None]] = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                target = map_weight_name(hf_name)
                if target is None:
                    continue
                if target[0] not in params:
                    raise ValueError(f"weight {hf_name!r} does not fit a {cfg.num_hidden_layers}-layer model")
                _copy_weight(params[target[0]], target[1], f.get_tensor(hf_name), hf_name)
                loaded.add(target)
    needed = {(n, s) for n in params for s in ((0, 1, 2) if ".qkv_proj." in n else (None,))}
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in needed - loaded)
    if missing:
        raise ValueError(f"{model_dir!r}: weights missing from the checkpoint: {missing[:8]}")
    return model.eval().requires_grad_(False)
