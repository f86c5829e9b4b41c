"""Embed over gRPC against sentence-transformers on the embedded all-MiniLM-L6-v2."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps KV memory in blocks.",
         "Bonjour, ça va? Très bien, merci.", "今天天气很好。", "🎉 party time 🎂",
         "A much longer sentence that goes on and on about embeddings, batching, padding and masks " * 3]


@pytest.fixture(scope="module")
def st_vectors():
    from sentence_transformers import SentenceTransformer

    from pagedserve.models.loader import embedded_embedding_path

    model = SentenceTransformer(embedded_embedding_path(), device="cpu")
    return model.encode(TEXTS, normalize_embeddings=True)


def vectors(resp) -> np.ndarray:
    return np.array([e.values for e in resp.embeddings], dtype=np.float64)


def test_embed_matches_sentence_transformers(client, st_vectors):
    ours = vectors(client.embed(TEXTS))
    cos = (ours * st_vectors).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(st_vectors, axis=1)
    assert cos.min() >= 0.9999


def test_same_vector_alone_and_in_mixed_batch(client):
    batch = vectors(client.embed(TEXTS))
    for i, text in enumerate(TEXTS):
        alone = vectors(client.embed([text]))[0]
        assert float(alone @ batch[i]) >= 0.9999


def test_empty_inputs_is_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as err:
        client.embed([])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs" in err.value.details()
