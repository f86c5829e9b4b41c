"""An HF model directory without tokenizer files is refused at load (models/loader.py ``load_tokenizer``), naming
``tokenizer``, before any weight is read; a directory with a tokenizer saved in it loads it."""
from __future__ import annotations

import pytest

from backend_cases import word_tokenizer
from pagedserve.config import EngineConfig
from pagedserve.engine.builder import build_engine
from pagedserve.models.loader import ModelSource


def _config(kind: str):
    from transformers import LlamaConfig, Qwen2Config

    cls, arch = (Qwen2Config, "Qwen2ForCausalLM") if kind == "qwen2" else (LlamaConfig, "LlamaForCausalLM")
    return cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, architectures=[arch])


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_a_directory_without_tokenizer_files_is_refused(tmp_path, kind):
    """Offline, transformers builds a 1-token tokenizer from a Qwen2 config alone (every call then failed "the
    prompt is empty") and fails on a Llama one with "Couldn't instantiate the backend tokenizer"; the weights file
    is never read: the refusal comes first."""
    _config(kind).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    source = ModelSource.resolve(str(tmp_path))
    with pytest.raises(ValueError, match=r"^tokenizer: model directory .* holds no tokenizer file .*tokenizer\.json"):
        source.load_tokenizer()
    with pytest.raises(ValueError, match=r"^tokenizer: "):     # the server's start-up path
        build_engine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32"))


def test_the_same_directory_with_a_tokenizer_loads_it(tmp_path):
    _config("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    word_tokenizer(256).save_pretrained(tmp_path)
    tokenizer = ModelSource.resolve(str(tmp_path)).load_tokenizer()
    assert tokenizer("t5 t7")["input_ids"] == [5, 7]
