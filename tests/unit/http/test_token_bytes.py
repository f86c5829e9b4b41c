"""Each token's own bytes (chat logprobs ``bytes``) for byte-level BPE and SentencePiece byte-fallback vocabularies."""
from __future__ import annotations

from pagedserve.http.token_bytes import TokenBytes, unicode_to_byte


def test_byte_level_table_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert unicode_to_byte() == {c: b for b, c in bytes_to_unicode().items()}
    assert sorted(unicode_to_byte().values()) == list(range(256))


class _FakeTokenizer:
    """A vocabulary given as id -> token string, with a decoder description like tokenizers' repr."""

    def __init__(self, vocab: dict[int, str], decoder: str, added: tuple[str, ...] = ()):
        self.vocab, self.added = vocab, added
        self.backend_tokenizer = type("Backend", (), {"decoder": decoder})()

    def get_added_vocab(self) -> dict[str, int]:
        return {t: i for i, t in self.vocab.items() if t in self.added}

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.vocab.get(token_id)


def test_byte_level_pieces_of_a_character_join_into_it():
    char = "龘".encode()                      # 3 bytes, one token each
    table = {b: c for c, b in unicode_to_byte().items()}
    vocab = {i: table[b] for i, b in enumerate(char)} | {3: table[ord(" ")] + "hi", 4: "<|im_end|>"}
    tb = TokenBytes(_FakeTokenizer(vocab, "ByteLevel(add_prefix_space=True)", added=("<|im_end|>",)))
    assert [tb(i) for i in range(3)] == [bytes([b]) for b in char]
    assert b"".join(tb(i) for i in range(5)).decode() == "龘 hi<|im_end|>"


def test_sentencepiece_byte_fallback_and_spaces():
    vocab = {0: "<0xE9>", 1: "<0xBE>", 2: "<0x98>", 3: "\u2581hi", 4: "<s>"}
    tb = TokenBytes(_FakeTokenizer(vocab, "Sequence(decoders=[Replace, ByteFallback])", added=("<s>",)))
    assert b"".join(tb(i) for i in range(4)).decode() == "龘 hi" and tb(4) == b"<s>"
