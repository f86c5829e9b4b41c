"""Text embeddings with a BERT-family encoder, following a sentence-transformers model directory's own configuration
(``modules.json``: Transformer -> Pooling -> optional Normalize; ``1_Pooling/config.json``;
``sentence_bert_config.json``), as ``SentenceTransformer.encode`` computes them.

Inputs are tokenized, sorted by length and run in micro-batches whose padded size stays under a token budget;
vectors come back in input order. A micro-batch runs packed (see :class:`pagedserve.models.bert.PackedBatch`) and
padded keys are masked in attention, so a text gives the same vector alone or in any batch.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.errors import InvalidInputError
from pagedserve.models.bert import BertEncoder, PackedBatch, load_bert

# sentence-transformers legacy Pooling config keys -> pooling mode names (newer configs store "pooling_mode").
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}
POOLING_MODES = ("mean", "cls", "lasttoken")


@dataclass(frozen=True, slots=True)
class EmbedResult:
    """The answer to one :meth:`Embedder.embed` call."""

    vectors: torch.Tensor   # [N, D'] float32 on CPU, row i for input i; D' = dimensions or the model's dimension
    prompt_tokens: int      # tokens run through the model over all inputs, special tokens included, after truncation


@dataclass(frozen=True, slots=True)
class SentenceTransformersConfig:
    """What a sentence-transformers directory says about the pipeline around the encoder."""

    model_dir: str               # directory holding config.json, the weights and the tokenizer
    pooling: str                 # one of POOLING_MODES
    normalize: bool              # a Normalize module follows pooling (the model's vectors are unit length)
    max_seq_length: int | None   # sentence_bert_config.json "max_seq_length", None when absent
    do_lower_case: bool          # sentence_bert_config.json "do_lower_case": lowercase text before tokenizing


def _read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _pooling_mode(pooling_dir: str) -> str:
    cfg = _read_json(os.path.join(pooling_dir, "config.json"))
    mode = cfg.get("pooling_mode")
    if mode is None:
        mode = [name for key, name in _LEGACY_POOLING_KEYS.items() if cfg.get(key)]
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else tuple(mode)
    if mode not in POOLING_MODES:
        raise ValueError(f"{pooling_dir}: pooling mode {mode!r} is not supported; expected one of {POOLING_MODES}")
    return mode


def read_sentence_transformers_config(path: str) -> SentenceTransformersConfig:
    """Read ``modules.json`` and the module configs under ``path``. A plain HF directory (no modules.json) gets
    sentence-transformers' defaults: mean pooling, no Normalize.

    Raises:
        FileNotFoundError: a module's directory or config file named by modules.json is missing.
        ValueError: a module type other than Transformer / Pooling / Normalize, or an unsupported pooling mode.
    """
    modules_path = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_path):
        return SentenceTransformersConfig(path, "mean", False, None, False)
    model_dir, pooling, normalize = path, "mean", False
    for module in _read_json(modules_path):
        kind = module["type"].rsplit(".", 1)[-1]
        module_dir = os.path.join(path, module.get("path", ""))
        if kind == "Transformer":
            model_dir = module_dir
        elif kind == "Pooling":
            pooling = _pooling_mode(module_dir)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{path}: sentence-transformers module {module['type']!r} is not supported")
    st_path = os.path.join(model_dir, "sentence_bert_config.json")
    st_cfg = _read_json(st_path) if os.path.isfile(st_path) else {}
    return SentenceTransformersConfig(model_dir, pooling, normalize, st_cfg.get("max_seq_length"),
                                      bool(st_cfg.get("do_lower_case", False)))


def pool_packed(hidden: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool sequences packed end to end into one vector each (sentence-transformers Pooling semantics).

    Args:
        hidden: ``[T, H]`` float32 token states, sequence b's tokens after those of sequences 0..b-1.
        lengths: ``[B]`` int64 token counts, each >= 1, summing to T.
        mode: "mean" (average of the tokens), "cls" (first token), "lasttoken" (last token).

    Returns:
        ``[B, H]`` float32.
    """
    ends = torch.cumsum(lengths, 0)
    if mode == "cls":
        return hidden[ends - lengths]
    if mode == "lasttoken":
        return hidden[ends - 1]
    seq_of_token = torch.repeat_interleave(torch.arange(lengths.shape[0], device=hidden.device), lengths)
    summed = hidden.new_zeros(lengths.shape[0], hidden.shape[1]).index_add_(0, seq_of_token, hidden)
    return summed / lengths[:, None].to(hidden.dtype)


def plan_micro_batches(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Group input indices by length: sorted shortest first, a batch grows while ``rows * longest`` (its padded
    token count) stays within ``max_batch_tokens``; a single longer input still gets a batch of its own."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if current and (len(current) + 1) * lengths[i] > max_batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def tokenize_inputs(tokenizer, texts: list[str], limit: int, truncate: bool = False,
                    lower_case: bool = False) -> list[list[int]]:
    """Token ids per text with the model's special tokens (``add_special_tokens=True``), for the Embed API.

    ``truncate`` keeps the first tokens so that each input is at most ``limit`` long, special tokens included (HF
    tokenizer truncation, as sentence-transformers does); ``lower_case`` lowercases the texts first.

    Raises:
        InvalidInputError: field "inputs" for an empty list; "inputs[i]" for a non-string, a text that tokenizes to
            nothing, or one longer than ``limit`` when ``truncate`` is false (the message gives both counts).
    """
    if not texts:
        raise InvalidInputError("at least one input is required", field="inputs")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInputError(f"must be a string, got {type(text).__name__}", field=f"inputs[{i}]")
    if lower_case:
        texts = [t.lower() for t in texts]
    ids = tokenizer(list(texts), add_special_tokens=True, truncation=truncate,
                    max_length=limit if truncate else None, verbose=False)["input_ids"]
    for i, seq in enumerate(ids):
        if not seq:
            raise InvalidInputError("tokenizes to no tokens", field=f"inputs[{i}]")
        if len(seq) > limit:
            raise InvalidInputError(f"input has {len(seq)} tokens, more than the model's limit of {limit} "
                                    f"tokens (set truncate to keep the first {limit})", field=f"inputs[{i}]")
    return ids


def check_dimensions(dimensions: int | None, dimension: int) -> None:
    """Raises InvalidInputError (field "dimensions") unless ``dimensions`` is None or in ``[1, dimension]``."""
    if dimensions is not None and not 0 < dimensions <= dimension:
        raise InvalidInputError(f"must be in [1, {dimension}], got {dimensions}", field="dimensions")


class Embedder:
    """Embeds texts with a BERT encoder plus sentence-transformers pooling / normalization.

    ``embed`` is synchronous; a lock serializes calls, so it may be called from any one (or several) worker
    threads, never on the asyncio event loop.
    """

    def __init__(self, model: BertEncoder, tokenizer, *, name: str, pooling: str, normalize_module: bool,
                 max_input_tokens: int, do_lower_case: bool = False, max_batch_tokens: int = 2048):
        if pooling not in POOLING_MODES:
            raise ValueError(f"pooling {pooling!r} is not one of {POOLING_MODES}")
        if not 0 < max_input_tokens <= model.config.max_input_tokens:
            raise ValueError(f"max_input_tokens {max_input_tokens} must be in "
                             f"[1, {model.config.max_input_tokens}] (the model's position table)")
        if max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {max_batch_tokens}")
        self._model, self._tokenizer = model, tokenizer
        self._name, self._pooling, self._normalize_module = name, pooling, normalize_module
        self._max_input_tokens, self._do_lower_case = max_input_tokens, do_lower_case
        self._max_batch_tokens = max_batch_tokens
        param = next(model.parameters())
        self._device, self._dtype = param.device, param.dtype
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        *, max_batch_tokens: int = 2048, name: str | None = None) -> Embedder:
        """Load a HF or sentence-transformers model directory (BERT family, safetensors weights).

        ``max_input_tokens`` is sentence_bert_config.json's ``max_seq_length`` (else the tokenizer's
        ``model_max_length``), capped by what the position table allows. ``name`` defaults to ``path``.

        Raises:
            FileNotFoundError: ``path`` does not exist, or config.json / weights / a module config is missing.
            ValueError: ``path`` is not a directory, or the model / pipeline is not supported.
        """
        from transformers import AutoTokenizer

        if not os.path.exists(path):
            raise FileNotFoundError(f"embedding model path {path!r} does not exist")
        if not os.path.isdir(path):
            raise ValueError(f"embedding model path {path!r} is not a directory")
        st = read_sentence_transformers_config(path)
        model = load_bert(st.model_dir, device=device, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(st.model_dir)
        limit = st.max_seq_length or tokenizer.model_max_length or model.config.max_input_tokens
        return cls(model, tokenizer, name=name or path, pooling=st.pooling, normalize_module=st.normalize,
                   max_input_tokens=min(int(limit), model.config.max_input_tokens),
                   do_lower_case=st.do_lower_case, max_batch_tokens=max_batch_tokens)

    tokenizer = property(lambda self: self._tokenizer, doc="the HF tokenizer (AutoTokenizer) of the model")
    device = property(lambda self: self._device, doc="where the model runs (torch.device)")
    name = property(lambda self: self._name, doc="served model name (defaults to the load path)")
    architecture = property(lambda self: self._model.config.architecture, doc="config.architectures[0]")
    dtype = property(lambda self: str(self._dtype).removeprefix("torch."), doc='weights dtype, e.g. "float32"')
    max_input_tokens = property(lambda self: self._max_input_tokens,
                                doc="longest input in tokens, special tokens included")
    dimension = property(lambda self: self._model.config.hidden_size, doc="length of a full embedding vector")
    pooling = property(lambda self: self._pooling, doc='"mean", "cls" or "lasttoken"')
    normalize_module = property(lambda self: self._normalize_module,
                                doc="the model's pipeline ends in Normalize: its vectors are unit length")
    max_batch_tokens = property(lambda self: self._max_batch_tokens,
                                doc="padded tokens (rows * longest) per micro-batch, unless one input is longer")

    def tokenize(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        """Token ids per text, special tokens included ([CLS] ... [SEP] for BERT).

        ``truncate`` keeps the first tokens so that each input is at most ``max_input_tokens`` long, special tokens
        included (HF tokenizer truncation, as sentence-transformers does).

        Raises:
            InvalidInputError: field "inputs" for an empty list; "inputs[i]" for a non-string, or for an input longer
                than ``max_input_tokens`` when ``truncate`` is false (the message gives both counts).
        """
        return tokenize_inputs(self._tokenizer, texts, self._max_input_tokens, truncate, self._do_lower_case)

    def embed(self, texts: list[str], normalize: bool = True, truncate: bool = False,
              dimensions: int | None = None) -> EmbedResult:
        """Embed texts (``SentenceTransformer.encode(texts, normalize_embeddings=normalize,
        truncate_dim=dimensions)`` semantics).

        The model's pipeline (pooling, its Normalize module if any) gives ``[N, dimension]`` vectors; ``dimensions``
        = k keeps the first k (Matryoshka, Kusupati et al. 2022); ``normalize`` then L2-normalizes each row.

        Raises:
            InvalidInputError: see :meth:`tokenize`; field "dimensions" when not in ``[1, dimension]``.
        """
        self.check_dimensions(dimensions)
        with self._lock:
            token_ids = self.tokenize(texts, truncate)
            vectors = self._encode(token_ids)
        return EmbedResult(self.finish(vectors, normalize, dimensions), sum(len(seq) for seq in token_ids))

    def embed_token_ids(self, token_ids: list[list[int]], normalize: bool = True,
                        dimensions: int | None = None) -> EmbedResult:
        """Like :meth:`embed` for already tokenized inputs (special tokens included, as :meth:`tokenize` gives).

        Raises:
            InvalidInputError: "inputs" for an empty list; "inputs[i]" for an empty, too long or out-of-vocabulary
                sequence; "dimensions" as in :meth:`embed`.
        """
        self.check_dimensions(dimensions)
        if not token_ids:
            raise InvalidInputError("at least one input is required", field="inputs")
        vocab_size = self._model.config.vocab_size
        for i, seq in enumerate(token_ids):
            if not 0 < len(seq) <= self._max_input_tokens:
                raise InvalidInputError(f"input has {len(seq)} tokens; expected 1 to {self._max_input_tokens}",
                                        field=f"inputs[{i}]")
            if min(seq) < 0 or max(seq) >= vocab_size:
                raise InvalidInputError(f"token ids must be in [0, {vocab_size})", field=f"inputs[{i}]")
        with self._lock:
            vectors = self._encode(token_ids)
        return EmbedResult(self.finish(vectors, normalize, dimensions), sum(len(seq) for seq in token_ids))

    def check_dimensions(self, dimensions: int | None) -> None:
        """Raises InvalidInputError (field "dimensions") unless ``dimensions`` is None or in ``[1, dimension]``."""
        check_dimensions(dimensions, self.dimension)

    @staticmethod
    def finish(vectors: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
        """The API's post-processing of pipeline vectors ``[N, dimension]``: keep the first ``dimensions``
        columns (all when None), then L2-normalize rows when ``normalize``. Returns ``[N, D']`` contiguous."""
        if dimensions is not None:
            vectors = vectors[:, :dimensions]
        if normalize:
            vectors = F.normalize(vectors, p=2, dim=-1)
        return vectors.contiguous()

    def encode_micro_batch(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Run one micro-batch as is (no regrouping): the model's pipeline vectors (pooled, then its Normalize
        module if any), ``[len(token_ids), dimension]`` float32 on CPU, row i for sequence i.

        ``token_ids`` come from :meth:`tokenize` (checked lengths); the caller picks the grouping (padding is
        masked, so the grouping never changes a vector). Thread safe: calls are serialized.
        """
        with self._lock, torch.inference_mode():
            out = self._forward_batch(token_ids)
        return F.normalize(out, p=2, dim=-1) if self._normalize_module else out

    def _encode(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Pooled (and, with a Normalize module, normalized) vectors ``[N, dimension]`` float32 CPU, input order."""
        out = torch.empty(len(token_ids), self.dimension, dtype=torch.float32)
        lengths = [len(seq) for seq in token_ids]
        with torch.inference_mode():
            for batch in plan_micro_batches(lengths, self._max_batch_tokens):
                out[batch] = self._forward_batch([token_ids[i] for i in batch])
        if self._normalize_module:
            out = F.normalize(out, p=2, dim=-1)
        return out

    def _forward_batch(self, seqs: list[list[int]]) -> torch.Tensor:
        """Run one micro-batch, packed (no padding outside attention): ``[b, dimension]`` float32 on CPU."""
        batch = PackedBatch.from_lengths([len(seq) for seq in seqs], self._device)
        input_ids = torch.tensor([t for seq in seqs for t in seq], dtype=torch.int64).to(self._device)
        hidden = self._model.forward_packed(input_ids, batch)
        return pool_packed(hidden.float(), batch.lengths, self._pooling).cpu()
