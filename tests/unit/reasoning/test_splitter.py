"""The incremental reasoning splitter (:mod:`pagedserve.reasoning`): each format's split of whole texts (vLLM's
reasoning-parser semantics), and the same split whatever the pieces: every text cut at EVERY boundary into two
pieces, and fed one character at a time, gives the whole text's reasoning and content, with no piece of a tag ever
shown."""
from __future__ import annotations

import itertools

import pytest

from pagedserve.config import REASONING_PARSERS
from pagedserve.reasoning import PARSERS, get_parser, split_whole

DS, QW, GO = "deepseek_r1", "qwen3", "gpt_oss"
HARMONY = ("<|channel|>analysis<|message|>a<b and </t> c<|end|><|start|>assistant<|channel|>final<|message|>"
           "Answer: 4<|return|>")
CASES = [
    # parser, prompt tail, generated text, (reasoning, content)
    (DS, "<|Assistant|><think>\n", "Let me see.</think>The answer", ("Let me see.", "The answer")),
    (DS, "<|Assistant|>", "<think>Hmm <thin</think>\n\nOK", ("Hmm <thin", "\n\nOK")),
    (DS, "<|Assistant|><think>\n", "still thinking <", ("still thinking <", "")),   # cut before </think>
    (DS, "<think>\n\n</think>\n\n", "Direct </think> answer", (None, "Direct </think> answer")),
    (QW, "<|im_start|>assistant\n", "<think>\nstep 1</think>\n\nDone", ("\nstep 1", "\n\nDone")),
    (QW, "<|im_start|>assistant\n", "\n<think>x</think>y", ("x", "y")),
    (QW, "<|im_start|>assistant\n", "No thinking <think>here</think>", (None, "No thinking <think>here</think>")),
    (QW, "<|im_start|>assistant\n", "<thing>", (None, "<thing>")),
    (QW, "assistant\n<think>\n\n</think>\n\n", "Plain", (None, "Plain")),
    (QW, "assistant\n<think>\n", "inside</think>after", ("inside", "after")),
    (GO, "<|start|>assistant", HARMONY, ("a<b and </t> c", "Answer: 4")),
    (GO, "<|start|>assistant<|channel|>analysis<|message|>", "deep<|end|><|start|>assistant<|channel|>final"
     "<|message|>ok", ("deep", "ok")),
    (GO, "<|start|>assistant", "<|channel|>final <|constrain|>json<|message|>{\"a\": 1}", (None, '{"a": 1}')),
]


def test_parser_names_match_the_config_choices():
    assert tuple(PARSERS) == REASONING_PARSERS
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; one of deepseek_r1"):
        get_parser("nope")


@pytest.mark.parametrize("name,tail,text,expected", CASES)
def test_whole_text_split(name, tail, text, expected):
    assert split_whole(get_parser(name), text, tail) == expected


TAGS = ("<think>", "</think>", "<|channel|>", "<|message|>", "<|end|>")


def _streamed(name: str, tail: str, pieces, expected_content: str = "") -> tuple[str | None, str]:
    """The split of ``pieces`` fed one by one; no settled content piece may carry a piece of a tag that the
    expected content does not have."""
    splitter = get_parser(name).splitter(tail)
    reasoning, content, touched = [], [], False
    pieces = list(pieces)
    for i, piece in enumerate(pieces):
        out = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning.append(out.reasoning)
        content.append(out.content)
        touched |= out.touched_reasoning
        for tag in TAGS:
            assert tag not in "".join(content) or tag in expected_content, (piece, out)
    return ("".join(reasoning) if touched else None), "".join(content)


@pytest.mark.parametrize("name,tail,text,expected", CASES)
def test_every_cut_in_two_pieces_gives_the_same_split(name, tail, text, expected):
    data = text.encode()
    for cut in range(len(data) + 1):   # every byte boundary (all ASCII here, so each is a character boundary)
        pieces = (data[:cut].decode(), data[cut:].decode())
        assert _streamed(name, tail, pieces, expected[1]) == expected, cut


@pytest.mark.parametrize("name,tail,text,expected", CASES)
def test_one_character_at_a_time_and_three_piece_cuts(name, tail, text, expected):
    assert _streamed(name, tail, list(text) + [""], expected[1]) == expected
    for a, b in itertools.combinations(range(0, len(text) + 1, 3), 2):
        assert _streamed(name, tail, (text[:a], text[a:b], text[b:]), expected[1]) == expected, (a, b)


def test_held_tag_prefix_is_not_shown_until_settled():
    s = get_parser(DS).splitter("<think>")
    out = s.feed("thinking </th")
    assert (out.reasoning, out.content) == ("thinking ", "")
    out = s.feed("ink> answer")
    assert (out.reasoning, out.content) == ("", " answer")
    s = get_parser(DS).splitter("<think>")
    assert s.feed("a </thin").reasoning == "a "
    assert s.feed("g").reasoning == "</thing"   # not the tag after all: released as reasoning
    assert s.reasoning_ended is False


def test_multibyte_text_around_tags():
    text = "é思考🙂</think>答え🙂"
    for cut in range(len(text) + 1):
        assert _streamed(DS, "<think>", (text[:cut], text[cut:])) == ("é思考🙂", "答え🙂")


def test_the_flag_takes_the_parser_names_only():
    from pagedserve.config import EngineConfig

    assert EngineConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineConfig(reasoning_parser="r1")
