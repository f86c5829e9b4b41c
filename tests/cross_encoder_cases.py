"""Tiny seeded random cross-encoder checkpoints (HF ``*ForSequenceClassification``, ``save_pretrained``), built
offline: BERT with the embedded all-MiniLM-L6-v2's WordPiece tokenizer files (copied, never imported), XLM-R and
ModernBERT with a small byte-level BPE tokenizer trained here with the ``tokenizers`` library. Shared by
tests/models/test_cross_encoder.py, tests/e2e/test_rerank_e2e.py and bench/rerank.py."""
from __future__ import annotations

import os
import shutil

#: MiniLM-L6's shape (cross-encoder/ms-marco-MiniLM-L6-v2), for the benchmark.
MINILM_L6 = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
#: A few-layer shape the tests run in milliseconds.
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps the KV cache in blocks.",
           "A reranker scores each document against the query.", "Bonjour, ça va? Très bien, merci.",
           "今天天气很好，我们去公园散步吧。", "Cross-encoders read the query and the document together.",
           "numbers 0 1 2 3 4 5 6 7 8 9 and symbols !?.,;:()[]{}"]


def _embedded_minilm() -> str:
    from pagedserve.models.loader import embedded_embedding_path

    return embedded_embedding_path()


def write_bert_cross_encoder(path: str, num_labels: int = 1, seed: int = 0, max_length: int = 128,
                             **shape) -> str:
    """A random ``BertForSequenceClassification`` (shape :data:`TINY` unless ``shape`` says) with MiniLM's
    tokenizer (``model_max_length`` = ``max_length``) in ``path``; returns ``path``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=30522, max_position_embeddings=512, num_labels=num_labels,
                        architectures=["BertForSequenceClassification"], **{**TINY, **shape})
    torch.manual_seed(seed)
    BertForSequenceClassification(config).eval().save_pretrained(path)
    source = _embedded_minilm()
    for name in _TOKENIZER_FILES:
        shutil.copy(os.path.join(source, name), os.path.join(path, name))
    _set_max_length(path, max_length)
    return path


def _set_max_length(path: str, max_length: int) -> None:
    import json

    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["model_max_length"] = max_length
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)


def bpe_tokenizer(vocab_size: int = 400, roberta: bool = True):
    """A byte-level BPE tokenizer trained on a few sentences: special tokens ``<s> <pad> </s> <unk> <mask>`` (ids
    0-4, XLM-R's order), pair template ``<s> a </s></s> b </s>`` (RoBERTa's) or ``[CLS] a [SEP] b [SEP]``-like
    ``<s> a </s> b </s>`` (``roberta=False``, ModernBERT's), wrapped as a transformers fast tokenizer without
    segment ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    pair = "<s> $A </s> </s> $B </s>" if roberta else "<s> $A </s> $B </s>"
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair=pair,
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<mask>", cls_token="<s>", sep_token="</s>",
                                   model_max_length=128, model_input_names=["input_ids", "attention_mask"])


def write_xlmr_cross_encoder(path: str, num_labels: int = 1, seed: int = 0, **shape) -> str:
    """A random ``XLMRobertaForSequenceClassification`` (positions after the padding index 1) with
    :func:`bpe_tokenizer` in ``path``; returns ``path``."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    tokenizer = bpe_tokenizer()
    config = XLMRobertaConfig(vocab_size=len(tokenizer), max_position_embeddings=130, type_vocab_size=1,
                              pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=num_labels,
                              architectures=["XLMRobertaForSequenceClassification"], **{**TINY, **shape})
    torch.manual_seed(seed)
    XLMRobertaForSequenceClassification(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_modernbert_cross_encoder(path: str, num_labels: int = 1, seed: int = 0, **overrides) -> str:
    """A random ``ModernBertForSequenceClassification`` (layers global, local, local; a local window of 8 tokens,
    far shorter than the tests' pairs) with :func:`bpe_tokenizer` (``<s> a </s> b </s>``) in ``path``; returns
    ``path``."""
    import torch
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    tokenizer = bpe_tokenizer(roberta=False)
    shape = {k: v for k, v in TINY.items()}
    config = ModernBertConfig(vocab_size=len(tokenizer), max_position_embeddings=128, local_attention=8,
                              pad_token_id=1, bos_token_id=0, eos_token_id=2, cls_token_id=0, sep_token_id=2,
                              num_labels=num_labels, architectures=["ModernBertForSequenceClassification"],
                              **{**shape, "num_hidden_layers": 3, **overrides})
    torch.manual_seed(seed)
    ModernBertForSequenceClassification(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
