"""A sentence-transformers model directory's pipeline around its model (``modules.json``: Transformer -> Pooling ->
optional Normalize; ``1_Pooling/config.json``; ``sentence_bert_config.json``), as ``SentenceTransformer`` reads it."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

# sentence-transformers legacy Pooling config keys -> pooling mode names (newer configs store "pooling_mode").
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}
POOLING_MODES = ("mean", "cls", "lasttoken")


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
