"""Incremental detokenization: token ids in, text deltas out, with stop strings.

Contract (API.md): the deltas of one completion, joined, equal ``tokenizer.decode(output_ids,
skip_special_tokens=params.skip_special_tokens)`` exactly, cut before the first stop string match (which is never
sent, not even in part, unless ``include_stop_str_in_output``). No delta carries a U+FFFD produced by a character
split across tokens.

Three stages, each O(1) amortized per token:

1. Window decode (the prefix / read offset technique of HF TGI and vLLM): only the ids from ``prefix_offset`` on
   are decoded; the text of ``ids[prefix_offset:read_offset]`` was already sent, so the new text is the rest.
   Decoding from a token boundary where a character ends gives the same characters as decoding everything, and
   decoding a one-token context keeps the leading-space rules of SentencePiece-style decoders right. A trailing
   U+FFFD (a multi-byte character not complete yet) is held back until a later token completes it or the
   completion ends (then it really is in the full decode too). Windows are decoded with
   ``clean_up_tokenization_spaces=False``.
2. Clean-up: when this tokenizer's ``decode`` applies ``clean_up_tokenization`` (it deletes spaces before
   punctuation and contractions), it is applied here to chunks cut where no replacement can span the cut.
3. Stop strings: the match that completes first (earliest end; then the longest) ends the completion; the longest
   tail of the text that is a prefix of some stop string is held back until it is ruled out.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedserve.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
_MAX_WINDOW_TOKENS = 16  # a window still held back after this many tokens looks for a safe split point
_CLEANUP_PROBE = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're k"


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """The result of one :meth:`IncrementalDetokenizer.add_tokens` call."""

    text: str              # new text to send now (may be empty)
    stop_str: str | None   # the stop string that matched: the completion must end now; None otherwise


class IncrementalDetokenizer:
    """Turns one completion's token ids into text deltas and detects its stop strings.

    Args:
        tokenizer: a transformers ``PreTrainedTokenizer`` / ``PreTrainedTokenizerFast`` (anything with ``decode``).
        params: the request's sampling parameters (``stop``, ``include_stop_str_in_output``,
            ``skip_special_tokens``).
        prompt_token_ids: the request's prompt. Kept as :attr:`prompt_token_ids`; the output text is defined on the
            output ids alone (API.md), so the prompt is not used as decoding context.
    """

    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.token_ids: list[int] = []    # all output ids so far
        self.matched_stop: str | None = None  # the stop string that ended the completion, if one did
        self._prefix_offset = 0           # the window starts here (a token boundary where a character ends)
        self._read_offset = 0             # the text of ids[:read_offset] is complete and passed on
        self._window_sent = 0             # characters of decode(ids[prefix_offset:]) passed on
        self._cleanup = _CleanupStream(tokenizer.clean_up_tokenization) if _applies_cleanup(tokenizer) else None
        self._stop = _StopMatcher(params.stop, params.include_stop_str_in_output)
        self._sent: list[str] = []
        self._finished = False

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Appends new output tokens; returns the text that may be sent now and whether a stop string matched.

        Raises:
            RuntimeError: the completion already ended (a stop string matched, or :meth:`flush` was called).
        """
        if self._finished:
            raise RuntimeError("add_tokens() after the completion ended")
        self.token_ids.extend(int(t) for t in token_ids)
        text = self._decode_new()
        if self._cleanup is not None:
            text = self._cleanup.push(text)
        text, stop = self._stop.push(text)
        return DetokenizerUpdate(text=self._record(text, stop), stop_str=stop)

    def flush(self) -> str:
        """Ends the completion (for a reason other than a stop string) and returns the text still held back.

        A held-back tail that completes a stop string is cut there too (then :attr:`matched_stop` is set)."""
        if self._finished:
            return ""
        text = self._decode_pending()
        if self._cleanup is not None:
            text = self._cleanup.push(text) + self._cleanup.flush()
        text, stop = self._stop.push(text)
        if stop is None:
            text += self._stop.flush()
        self._finished = True
        return self._record(text, stop)

    @property
    def finished(self) -> bool:
        """True once a stop string matched or :meth:`flush` was called."""
        return self._finished

    def _record(self, text: str, stop: str | None) -> str:
        if stop is not None:
            self.matched_stop = stop
            self._finished = True
        if text:
            self._sent.append(text)
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _decode_pending(self) -> str:
        return self._decode(self.token_ids[self._prefix_offset:])[self._window_sent:]

    def _decode_new(self) -> str:
        """Stage 1: the new complete characters of the token window; slides the window when it is all sent."""
        window = self._decode(self.token_ids[self._prefix_offset:])
        end = len(window)
        while end > self._window_sent and window[end - 1] == _REPLACEMENT:
            end -= 1
        delta = window[self._window_sent:end]
        self._window_sent = max(self._window_sent, end)
        if end == len(window):  # ends on a complete character: the next window starts at the last boundary
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            self._window_sent = len(self._decode(self.token_ids[self._prefix_offset:self._read_offset]))
        elif len(self.token_ids) - self._prefix_offset > _MAX_WINDOW_TOKENS:
            delta += self._split_long_window(window)
        return delta

    def _split_long_window(self, window: str) -> str:
        """Moves the window start to a later token ``k`` whose split is final: decoding ``ids[p:k]`` and
        ``ids[k:]`` apart gives the window's text, and at least 3 characters (so bytes) and 4 tokens follow ``k``,
        more than any incomplete UTF-8 character needs. Returns held text this releases (U+FFFD of invalid bytes).
        Only long runs of invalid bytes get here."""
        ids, p = self.token_ids, self._prefix_offset
        for k in range(len(ids) - 4, max(p, len(ids) - 12), -1):
            left, right = self._decode(ids[p:k]), self._decode(ids[k:])
            if len(right) >= 3 and left + right == window:
                released = left[self._window_sent:]
                self._window_sent = max(0, self._window_sent - len(left))
                self._prefix_offset, self._read_offset = k, max(self._read_offset, k)
                return released
        return ""


class _StopMatcher:
    """Stage 3: finds the first stop string in the text stream; holds back a tail that could begin one."""

    def __init__(self, stops: Sequence[str], include_stop: bool):
        self._stops = tuple(stops)
        self._include_stop = include_stop
        self._prefixes = {s[:i] for s in self._stops for i in range(1, len(s))}
        self._max_prefix = max((len(s) - 1 for s in self._stops), default=0)
        self.held = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Returns ``(text to send, matched stop string or None)``."""
        if not self._stops:
            return text, None
        buf = self.held + text
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0 and (best is None or (start + len(stop), -len(stop)) < best[:2]):
                best = (start + len(stop), -len(stop), stop)
        if best is not None:
            self.held = ""
            end, stop = best[0], best[2]
            return buf[:end if self._include_stop else end - len(stop)], stop
        keep = next((n for n in range(min(len(buf), self._max_prefix), 0, -1) if buf[-n:] in self._prefixes), 0)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class _CleanupStream:
    """Stage 2: ``clean_up_tokenization`` on a stream. Every replacement it makes starts with a space and spans at
    most 4 characters, and only deletes spaces, so it never spans a cut whose 3 preceding characters hold no space:
    cleaning the chunks between such cuts equals cleaning the whole text."""

    def __init__(self, clean: Callable[[str], str]):
        self._clean = clean
        self._pending = ""

    def push(self, text: str) -> str:
        self._pending += text
        cut = len(self._pending)
        while cut > 0 and " " in self._pending[max(0, cut - 3):cut]:
            cut -= 1
        ready, self._pending = self._pending[:cut], self._pending[cut:]
        return self._clean(ready) if ready else ""

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return self._clean(pending)

def _applies_cleanup(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` changes its output with ``clean_up_tokenization_spaces`` (transformers 5 skips it
    for BPE models, for example): decode a probe text both ways."""
    if not hasattr(tokenizer, "clean_up_tokenization"):
        return False
    ids = tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=True) != tokenizer.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
