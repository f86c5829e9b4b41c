"""Rerank and Score end to end (issue 43): one server with --rerank-model (a tiny seeded random BERT cross-encoder
saved with save_pretrained), the embedded all-MiniLM-L6-v2 and no generation model, behind an API key. The oracle
is sentence-transformers' CrossEncoder.predict on the same directory; through gRPC, every HTTP shape, Cohere's
Python SDK and LangChain's CohereRerank compressor, unchanged. Without a cross-encoder, scores are the embedding
model's cosine (checked against SentenceTransformer.encode)."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import numpy as np
import pytest

import cross_encoder_cases as cases
from support import ServerThread, free_port

pytestmark = pytest.mark.e2e
st = pytest.importorskip("sentence_transformers")

KEY = "rerank-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUERY = "how does paged attention store the KV cache?"
DOCS = ["Paged attention keeps the KV cache in fixed-size blocks addressed through a block table.",
        "The quick brown fox jumps over the lazy dog.", "Bonjour, ça va? Très bien, merci.",
        "A reranker scores each document against the query.", "今天天气很好，我们去公园散步吧。", "a"]
LONG = "Cross-encoders read the query and the document together. " * 20   # over the 128-token limit


@pytest.fixture(scope="module")
def rerank_dir(tmp_path_factory):
    return cases.write_bert_cross_encoder(str(tmp_path_factory.mktemp("reranker")), initializer_range=0.2)


@pytest.fixture(scope="module")
def oracle(rerank_dir):
    """``oracle(pairs) -> scores``: CrossEncoder.predict on the same directory (it truncates to 128 tokens)."""
    model = st.CrossEncoder(rerank_dir, device="cpu")
    return lambda pairs: np.asarray(model.predict(pairs), dtype=np.float64)


@pytest.fixture(scope="module")
def server(rerank_dir):
    from pagedserve.config import EngineConfig, ServerConfig

    s = ServerThread(ServerConfig(host="127.0.0.1", port=0, http_port=free_port(), generation_model=False,
                                  rerank_model=rerank_dir, api_key=KEY), EngineConfig(device="cpu"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from pagedserve_client import PagedServeClient

    with PagedServeClient(server.target, api_key=KEY, timeout_s=60) as c:
        yield c


def post(server, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(server.http_url + path, json=body, headers=headers, timeout=60)


def best_first(scores) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def test_grpc_rerank_and_score_equal_sentence_transformers(client, oracle, rerank_dir, server):
    expected = oracle([(QUERY, d) for d in DOCS])
    resp = client.rerank(QUERY, DOCS, return_text=True)
    assert [r.index for r in resp.results] == best_first(expected)
    np.testing.assert_allclose([r.score for r in resp.results], expected[best_first(expected)], atol=1e-5, rtol=0)
    assert [r.text for r in resp.results] == [DOCS[i] for i in best_first(expected)]
    tokenizer = server.app.services.rerank.model.tokenizer
    assert resp.usage.prompt_tokens == sum(len(ids) for ids in tokenizer([QUERY] * len(DOCS), DOCS)["input_ids"])
    top = client.rerank(QUERY, DOCS, top_n=2)
    assert [r.index for r in top.results] == best_first(expected)[:2] and not top.results[0].HasField("text")
    np.testing.assert_allclose(client.score(QUERY, DOCS), expected, atol=1e-5, rtol=0)           # 1 -> N
    pairs = [(DOCS[0], DOCS[1]), (QUERY, DOCS[3]), (DOCS[2], "")]
    np.testing.assert_allclose(client.score([a for a, _ in pairs], [b for _, b in pairs]), oracle(pairs),
                               atol=1e-5, rtol=0)                                                   # N -> N
    truncated = client.rerank(QUERY, [LONG, DOCS[0]], truncate=True)
    np.testing.assert_allclose(sorted(r.score for r in truncated.results),
                               sorted(oracle([(QUERY, LONG), (QUERY, DOCS[0])])), atol=1e-5, rtol=0)
    info = client.model_info().rerank
    assert (info.name, info.kind, info.architecture, info.activation, info.max_input_tokens) == \
        (rerank_dir, "cross-encoder", "BertForSequenceClassification", "sigmoid", 128)


def test_concurrent_grpc_calls_score_as_alone(server, oracle):
    from pagedserve_client import AsyncPagedServeClient

    async def run():
        async with AsyncPagedServeClient(server.target, api_key=KEY, timeout_s=60) as c:
            return await asyncio.gather(*[c.score(QUERY, [d]) for d in DOCS * 3])

    scores = asyncio.run(run())
    np.testing.assert_allclose([s[0] for s in scores], np.tile(oracle([(QUERY, d) for d in DOCS]), 3),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("call, field", [
    (lambda c: c.rerank("", DOCS), "query"), (lambda c: c.rerank(QUERY, []), "texts"),
    (lambda c: c.rerank(QUERY, DOCS, top_n=0), "top_n"), (lambda c: c.rerank(QUERY, [DOCS[0], LONG]), "texts[1]"),
    (lambda c: c.score([QUERY, QUERY], DOCS), "text_1"), (lambda c: c.score(QUERY, []), "text_2"),
    (lambda c: c.score(QUERY, [DOCS[0], LONG]), "text_2[1]"), (lambda c: c.score([""], [DOCS[0]]), "text_1[0]"),
])
def test_grpc_errors_name_the_field(client, call, field):
    with pytest.raises(grpc.RpcError) as err:
        call(client)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: "), err.value.details()


def test_grpc_needs_the_api_key(server):
    from pagedserve_client import PagedServeClient

    with PagedServeClient(server.target, api_key="", timeout_s=30) as bare:
        for call in (lambda: bare.rerank(QUERY, DOCS), lambda: bare.score(QUERY, DOCS)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_http_tei_rerank(server, oracle):
    expected = oracle([(QUERY, d) for d in DOCS])
    body = post(server, "/rerank", {"query": QUERY, "texts": DOCS, "return_text": True}).json()
    assert [r["index"] for r in body] == best_first(expected)
    np.testing.assert_allclose([r["score"] for r in body], expected[best_first(expected)], atol=1e-5, rtol=0)
    assert [r["text"] for r in body] == [DOCS[i] for i in best_first(expected)]
    raw = post(server, "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True}).json()
    assert "text" not in raw[0] and [r["index"] for r in raw] == best_first(expected)
    np.testing.assert_allclose(1 / (1 + np.exp(-np.array([r["score"] for r in raw]))),
                               expected[best_first(expected)], atol=1e-5, rtol=0)   # logits before the sigmoid


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_http_cohere_and_jina_rerank(server, oracle, path):
    expected = oracle([(QUERY, d) for d in DOCS])
    documents = [d if i % 2 else {"text": d} for i, d in enumerate(DOCS)]   # strings or {text}
    r = post(server, path, {"model": server.app.services.rerank_name, "query": QUERY, "documents": documents,
                            "top_n": 3})
    body = r.json()
    assert r.status_code == 200 and body["id"].startswith("rerank-") and body["model"] == server.app.services.rerank_name
    assert [x["index"] for x in body["results"]] == best_first(expected)[:3]
    np.testing.assert_allclose([x["relevance_score"] for x in body["results"]], expected[best_first(expected)[:3]],
                               atol=1e-5, rtol=0)
    assert [x["document"]["text"] for x in body["results"]] == [DOCS[i] for i in best_first(expected)[:3]]
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0
    assert body["meta"]["api_version"]["version"] == path[2]
    bare = post(server, path, {"query": QUERY, "documents": DOCS, "return_documents": False}).json()
    assert len(bare["results"]) == len(DOCS) and "document" not in bare["results"][0]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_http_vllm_score(server, oracle, path):
    body = post(server, path, {"text_1": QUERY, "text_2": DOCS}).json()
    assert body["object"] == "list" and body["id"].startswith("score-") and isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS))) and body["data"][0]["object"] == "score"
    np.testing.assert_allclose([d["score"] for d in body["data"]], oracle([(QUERY, d) for d in DOCS]), atol=1e-5,
                               rtol=0)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    pairs = post(server, path, {"text_1": [DOCS[0], QUERY], "text_2": [DOCS[1], DOCS[3]]}).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], oracle([(DOCS[0], DOCS[1]), (QUERY, DOCS[3])]),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("path, body, status, param", [
    ("/rerank", {"query": "", "texts": DOCS}, 400, "query"),
    ("/rerank", {"query": QUERY, "texts": [DOCS[0], LONG]}, 400, "texts[1]"),
    ("/rerank", {"query": QUERY, "texts": DOCS, "truncation_direction": "Left"}, 400, "truncation_direction"),
    ("/rerank", {"texts": DOCS}, 400, "query"),
    ("/v2/rerank", {"query": QUERY, "documents": []}, 400, "documents"),
    ("/v2/rerank", {"query": QUERY, "documents": [DOCS[0], LONG]}, 400, "documents[1]"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, 400, "top_n"),
    ("/v2/rerank", {"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 64}, 400, "max_tokens_per_doc"),
    ("/v2/rerank", {"model": "rerank-english-v3.0", "query": QUERY, "documents": DOCS}, 404, "model"),
    ("/score", {"text_1": QUERY, "text_2": [DOCS[0], LONG]}, 400, "text_2[1]"),
    ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, 400, "text_1"),
    ("/v1/score", {"text_1": "", "text_2": DOCS}, 400, "text_1"),
    ("/score", {"text_1": QUERY, "text_2": LONG}, 400, "text_2"),
])
def test_http_errors_name_the_param(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank", "/score", "/v1/score"])
def test_http_needs_the_api_key(server, path):
    body = {"query": QUERY, "texts": DOCS, "documents": DOCS, "text_1": QUERY, "text_2": DOCS}
    for headers in (None, {"Authorization": "Bearer wrong"}):
        r = post(server, path, body, headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert post(server, path, body).status_code == 200
    models = httpx.get(server.http_url + "/v1/models", headers=AUTH).json()["data"]
    assert server.app.services.rerank_name in [m["id"] for m in models]


def test_cohere_sdk_and_langchain_compressor_unchanged(server, oracle):
    import cohere
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    expected = oracle([(QUERY, d) for d in DOCS])
    name = server.app.services.rerank_name
    co = cohere.ClientV2(base_url=server.http_url, api_key=KEY)
    resp = co.rerank(model=name, query=QUERY, documents=DOCS, top_n=3)
    assert [r.index for r in resp.results] == best_first(expected)[:3]
    np.testing.assert_allclose([r.relevance_score for r in resp.results], expected[best_first(expected)[:3]],
                               atol=1e-5, rtol=0)
    with pytest.raises(cohere.core.api_error.ApiError) as err:
        cohere.ClientV2(base_url=server.http_url, api_key="wrong").rerank(model=name, query=QUERY, documents=DOCS)
    assert err.value.status_code == 401
    compressor = CohereRerank(client=co, model=name, top_n=2)
    docs = [Document(page_content=d, metadata={"i": i}) for i, d in enumerate(DOCS)]
    kept = compressor.compress_documents(docs, QUERY)
    assert [d.metadata["i"] for d in kept] == best_first(expected)[:2]
    np.testing.assert_allclose([d.metadata["relevance_score"] for d in kept], expected[best_first(expected)[:2]],
                               atol=1e-5, rtol=0)


def test_without_a_cross_encoder_scores_are_the_embedding_cosine(server):
    """The factory's fallback (no --rerank-model): the embedding model's cosine, SentenceTransformer's vectors."""
    from pagedserve.config import EngineConfig, ServerConfig
    from pagedserve.errors import InvalidInputError
    from pagedserve.models.loader import embedded_embedding_path
    from pagedserve.serving.factory import ServiceFactory
    from pagedserve.serving.metrics import ServerMetrics
    from pagedserve.serving.rerank import rerank, score
    from pagedserve.serving.services import Services

    model = st.SentenceTransformer(embedded_embedding_path(), device="cpu")
    vectors = model.encode([QUERY] + DOCS, normalize_embeddings=True)
    expected = vectors[1:] @ vectors[0]

    async def run():
        services = Services()
        await ServiceFactory(ServerConfig(generation_model=False, http_port=0), EngineConfig()).load(
            services, ServerMetrics())
        try:
            info = services.rerank.info
            ranked = await rerank(services.rerank, QUERY, DOCS, top_n=4)
            scores = await score(services.rerank, [QUERY], DOCS)
            with pytest.raises(InvalidInputError) as err:
                await rerank(services.rerank, QUERY, [DOCS[0], LONG * 3])
            return info, services.rerank_name, ranked, scores, err.value
        finally:
            await services.aclose()

    info, name, ranked, scores, error = asyncio.run(run())
    assert (info.kind, info.activation, name) == ("embedding-cosine", "cosine", "all-MiniLM-L6-v2")
    np.testing.assert_allclose(scores.scores, expected, atol=1e-5, rtol=0)
    assert [r.index for r in ranked.results] == best_first(expected)[:4]
    assert error.field == "texts[1]"
