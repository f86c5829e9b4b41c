"""Cross-encoders (embedding/cross_encoder.py on models/cross_encoder.py and models/modernbert.py) against
sentence-transformers' ``CrossEncoder.predict`` on tiny seeded random checkpoints saved with ``save_pretrained``:
BERT, XLM-R and ModernBERT, one label and several."""
from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest
import torch

import cross_encoder_cases as cases
from pagedserve.embedding.batcher import EmbedBatcher
from pagedserve.embedding.cross_encoder import CrossEncoder
from pagedserve.embedding.scoring import CrossEncoderScorer
from pagedserve.errors import InvalidInputError

st = pytest.importorskip("sentence_transformers")

QUERY = "how does paged attention store the KV cache?"
DOCS = ["Paged attention keeps the KV cache in fixed-size blocks addressed through a block table.",
        "The quick brown fox jumps over the lazy dog.",
        "Bonjour, ça va? Très bien, merci.",
        "今天天气很好，我们去公园散步吧。",
        "a",
        "Cross-encoders read the query and the document together, " * 12,   # cut at max_length (128)
        "numbers 0 1 2 3 4 5 6 7 8 9 and symbols !?.,;:()[]{}",
        "A reranker scores each document against the query."]
PAIRS = [(QUERY, d) for d in DOCS] + [("short", "pair"), (DOCS[5], DOCS[0])]
# label -> (writer, num_labels, config overrides)
CASES = {
    "bert-1": (cases.write_bert_cross_encoder, 1, {}),
    "bert-3": (cases.write_bert_cross_encoder, 3, {}),
    "xlmr-1": (cases.write_xlmr_cross_encoder, 1, {}),
    "xlmr-2": (cases.write_xlmr_cross_encoder, 2, {}),
    "modernbert-1": (cases.write_modernbert_cross_encoder, 1, {}),
    "modernbert-3-mean-biases": (cases.write_modernbert_cross_encoder, 3, dict(
        classifier_pooling="mean", attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    writer, num_labels, overrides = CASES[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    writer(path, num_labels=num_labels, initializer_range=0.2, **overrides)
    return path, num_labels


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return cases.write_bert_cross_encoder(str(tmp_path_factory.mktemp("bert")), initializer_range=0.2)


def test_scores_equal_sentence_transformers(checkpoint):
    path, num_labels = checkpoint
    expected = np.asarray(st.CrossEncoder(path, device="cpu").predict(PAIRS)).reshape(len(PAIRS), num_labels)
    ours = CrossEncoder.from_pretrained(path)
    assert ours.num_labels == num_labels and ours.activation == ("sigmoid" if num_labels == 1 else "identity")
    got = ours.predict(PAIRS).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    for label in range(num_labels):   # the same ranking of the pairs by every label
        assert np.argsort(-got[:, label], kind="stable").tolist() == \
            np.argsort(-expected[:, label], kind="stable").tolist()
    alone = torch.cat([ours.predict([pair]) for pair in PAIRS]).numpy()
    np.testing.assert_allclose(alone, got, atol=1e-6, rtol=0)   # the batch never changes a pair's score


def test_the_saved_activation_is_the_one_applied(bert_dir, tmp_path):
    """A CrossEncoder saved by sentence-transformers with Identity keeps it (config_sentence_transformers.json);
    an activation we do not run is refused at load, naming it."""
    saved = str(tmp_path / "saved")
    st.CrossEncoder(bert_dir, device="cpu", activation_fn=torch.nn.Identity()).save_pretrained(saved)
    expected = st.CrossEncoder(saved, device="cpu").predict(PAIRS)
    ours = CrossEncoder.from_pretrained(saved)
    assert ours.activation == "identity"
    np.testing.assert_allclose(ours.predict(PAIRS).numpy()[:, 0], expected, atol=1e-5, rtol=0)
    assert (expected < 0).any()   # logits, not sigmoids
    config_path = os.path.join(saved, "config_sentence_transformers.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "activation_fn": "torch.nn.modules.activation.Softsign"}, f)
    with pytest.raises(ValueError, match="activation_fn"):
        CrossEncoder.from_pretrained(saved)


def test_pair_checks_name_the_field(bert_dir):
    ours = CrossEncoder.from_pretrained(bert_dir)
    long_doc = DOCS[5] * 3
    cases_ = [(([QUERY], [DOCS[0], long_doc]), "text_2[1]"), (([QUERY, QUERY], [DOCS[0]] * 3), "text_1"),
              (([""], [DOCS[0]]), "text_1[0]"), (([QUERY], []), "text_2"), (([QUERY], [DOCS[0], 7]), "text_2[1]")]
    for (text_1, text_2), field in cases_:
        with pytest.raises(InvalidInputError) as err:
            ours.tokenize_pairs(text_1, text_2)
        assert err.value.field == field, (text_1, text_2)
    pairs = ours.tokenize_pairs([QUERY], [DOCS[0], long_doc], truncate=True)
    assert len(pairs[1]) == ours.max_input_tokens == 128 and len(pairs[0]) < 128
    assert pairs[0].type_ids is not None and pairs[0].type_ids[-1] == 1   # BERT's second segment


def test_unsupported_checkpoints_are_refused(tmp_path):
    from pagedserve.models.loader import embedded_embedding_path

    with pytest.raises(ValueError, match="not a supported cross-encoder"):
        CrossEncoder.from_pretrained(embedded_embedding_path())   # BertModel: an embedder, no classifier
    path = cases.write_modernbert_cross_encoder(str(tmp_path / "mb"), classifier_pooling="cls")
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["classifier_activation"] = "silu"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="classifier_activation"):
        CrossEncoder.from_pretrained(path)


def test_the_scorer_batches_concurrent_calls_and_needs_one_label(bert_dir, tmp_path):
    model = CrossEncoder.from_pretrained(bert_dir)
    expected = model.predict(PAIRS, truncate=True)[:, 0].tolist()
    batcher = EmbedBatcher(model, max_batch_tokens=1024)
    scorer = CrossEncoderScorer(batcher)

    async def run():
        calls = [scorer.score([a], [b], truncate=True) for a, b in PAIRS]
        return await asyncio.gather(*calls), await scorer.score([QUERY], DOCS, truncate=True, raw=True)

    try:
        results, raw = asyncio.run(run())
    finally:
        batcher.close()
    np.testing.assert_allclose([r.scores[0] for r in results], expected, atol=1e-6, rtol=0)
    np.testing.assert_allclose(torch.sigmoid(torch.tensor(raw.scores)).numpy(), expected[:len(DOCS)], atol=1e-6)
    assert sum(r.prompt_tokens for r in results) == sum(len(p) for p in model.tokenize_pairs(
        [a for a, _ in PAIRS], [b for _, b in PAIRS], truncate=True))
    three = cases.write_bert_cross_encoder(str(tmp_path / "three"), num_labels=3)
    batcher = EmbedBatcher(CrossEncoder.from_pretrained(three))
    try:
        with pytest.raises(ValueError, match="num_labels 1"):
            CrossEncoderScorer(batcher)
    finally:
        batcher.close()
