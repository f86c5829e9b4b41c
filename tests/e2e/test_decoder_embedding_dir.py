"""A decoder embedding model directory as --embedding-model: its own engine, last-token pooling (issue 9).

The model is a small random-weight Llama saved with transformers, with SmolLM2's tokenizer and a
sentence-transformers pipeline (Transformer -> Pooling lasttoken -> Normalize, max_seq_length 64); the oracle is
sentence-transformers loading the same directory.
"""
from __future__ import annotations

import json
import os

import grpc
import numpy as np
import pytest

from support import ServerThread

pytestmark = pytest.mark.e2e

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps KV memory in blocks.",
         "Bonjour, ça va?", "今天天气很好。"]
MAX_SEQ_LENGTH = 64


def write_decoder_embedding_dir(path: str, tokenizer, pooling: str = "lasttoken") -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    modes = {f"pooling_mode_{m}": m == pooling for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **modes}, f)
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False}, f)


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory, llm_parts):
    path = str(tmp_path_factory.mktemp("decoder-embedding"))
    write_decoder_embedding_dir(path, llm_parts[1])
    return path


@pytest.fixture(scope="module")
def decoder_server(decoder_dir):
    from pagedserve.config import EngineConfig, ServerConfig

    s = ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=0, embedding_model=decoder_dir,
                                  generation_model=False), EngineConfig())
    yield s
    s.stop()


def test_decoder_directory_embeds_like_sentence_transformers(decoder_dir, decoder_server):
    from sentence_transformers import SentenceTransformer

    from pagedserve_client import PagedServeClient

    st = SentenceTransformer(decoder_dir, device="cpu")
    expected = np.stack([st.encode([t])[0] for t in TEXTS])  # one at a time: no padding inside the oracle
    with PagedServeClient(decoder_server.target, timeout_s=120) as client:
        info = client.model_info().embedding
        assert (info.architecture, info.pooling, info.embedding_dimension, info.max_input_tokens) == \
            ("LlamaForCausalLM", "lasttoken", 64, MAX_SEQ_LENGTH)
        ours = np.array([e.values for e in client.embed(TEXTS).embeddings])
        np.testing.assert_allclose(ours, expected, atol=2e-5)
        long_text = "word " * 200
        with pytest.raises(grpc.RpcError) as err:
            client.embed([long_text])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs[0]" in err.value.details()
        truncated = np.array(client.embed([long_text], truncate=True).embeddings[0].values)
        with pytest.raises(grpc.RpcError) as err:
            client.generate_text("hi", max_tokens=2)  # no generation model on this server
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    np.testing.assert_allclose(truncated, st.encode([long_text])[0], atol=2e-5)  # ST cuts at max_seq_length


def test_decoder_embedding_config_recognizes_directories(tmp_path, llm_parts):
    from pagedserve.embedding.decoder import decoder_embedding_config
    from pagedserve.models.loader import embedded_embedding_path

    assert decoder_embedding_config(embedded_embedding_path()) is None  # BERT: the encoder path serves it
    assert decoder_embedding_config(str(tmp_path)) is None              # no config.json
    mean_dir = str(tmp_path / "mean")
    write_decoder_embedding_dir(mean_dir, llm_parts[1], pooling="mean_tokens")
    with pytest.raises(ValueError, match="lasttoken pooling only"):
        decoder_embedding_config(mean_dir)
