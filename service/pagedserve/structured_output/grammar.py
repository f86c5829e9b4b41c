"""The integration with llguidance (the grammar library): compile constraints off the engine thread, one matcher
per completion, batched token bitmasks.

- :class:`GrammarCompiler`: ``submit(constraint) -> Future[CompiledGrammar]`` on a small thread pool, with an LRU
  cache keyed by the constraint (a failure is cached too: the same bad schema fails fast). The library's tokenizer
  (about 1 s to build for a 50k vocabulary) is built once, lazily, by the first compile.
- :class:`CompiledGrammar`: the compiled constraint in its start state; ``new_matcher()`` copies it for one
  completion.
- :class:`GrammarMatcher`: one completion's parser state; advances on each accepted token.
- :func:`fill_bitmasks`: the next-token bitmasks of many matchers in one call (the library fills them in parallel
  with the GIL released).
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import torch

from ..errors import InvalidInputError
from .bitmask import bitmask_words
from ..sampling_params import StructuredOutput

# JSON is compiled with fixed separators (", " and ": ") and no free whitespace: a small model left free to emit
# whitespace can spend its whole token budget on it.
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


def grammar_text(constraint: StructuredOutput) -> str:
    """The llguidance grammar for ``constraint``. Raises ValueError where the library refuses the text outright."""
    kind = constraint.kind
    if kind in ("json_schema", "json_object"):
        schema = constraint.json_schema if kind == "json_schema" else _ANY_OBJECT_SCHEMA
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.grammar_from("regex", constraint.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(constraint.choice))
    return llguidance.grammar_from("grammar", constraint.grammar)   # Lark, or GBNF converted to Lark


class GrammarMatcher:
    """One completion's position in its grammar. Not thread-safe (the engine thread owns it)."""

    __slots__ = ("_m", "num_words", "num_tokens")

    def __init__(self, matcher: "llguidance.LLMatcher", num_words: int):
        self._m = matcher
        self.num_words = num_words  # int32 words of its bitmask row
        self.num_tokens = 0         # tokens accepted so far (the completion's output tokens)

    @property
    def llmatcher(self) -> "llguidance.LLMatcher":
        return self._m

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the next-token bitmask into ``row`` (``[num_words]`` int32, contiguous, CPU)."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), self.num_words * 4)

    def accept(self, token_id: int) -> None:
        """Advance on a sampled token. Raises RuntimeError if the grammar does not allow it (a bug: the mask
        should have prevented it)."""
        if not self._m.consume_token(token_id):
            raise RuntimeError(f"the grammar rejected token {token_id}: {self._m.get_error()}")
        self.num_tokens += 1

    def is_terminated(self) -> bool:
        """True when no token but EOS can follow: the completion is done."""
        return self._m.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens. Raises RuntimeError when the library cannot."""
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._m.get_error()}")
        self.num_tokens -= num_tokens


class CompiledGrammar:
    """A compiled constraint in its start state.

    Args:
        template: an llguidance matcher that has consumed nothing (copied, never advanced).
        num_words: int32 words of one bitmask row (``ceil(tokenizer vocab / 32)``).
    """

    def __init__(self, template: "llguidance.LLMatcher", num_words: int):
        self._template = template
        self.num_words = num_words

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher for one completion (a copy of the start state: cheap, microseconds)."""
        return GrammarMatcher(self._template.deep_copy(), self.num_words)


_executor_lock = threading.Lock()
_executor: "llguidance.LLExecutor | None" = None


def fill_bitmasks(matchers: list) -> torch.Tensor:
    """The next-token bitmask of each matcher (:class:`GrammarMatcher`, or anything with ``num_words`` and
    ``fill_bitmask(row)``, such as a test's fake).

    Returns:
        ``[len(matchers), W]`` int32 on CPU (W: the widest ``num_words``, zero-filled past a narrower row's);
        bit ``t % 32`` of word ``t // 32`` is set when token ``t`` may come next (EOS only where the grammar can
        end).
    """
    global _executor
    num_words = max(m.num_words for m in matchers)
    bitmask = torch.zeros(len(matchers), num_words, dtype=torch.int32)
    par = [(m.llmatcher, i) for i, m in enumerate(matchers)
           if isinstance(m, GrammarMatcher) and m.num_words == num_words]
    if len(par) > 1:  # the library fills the rows on its own threads, without the GIL
        if _executor is None:
            with _executor_lock:
                _executor = _executor or llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr(par, bitmask.data_ptr(), num_words * 4, len(matchers))
    done = {i for _, i in par} if len(par) > 1 else set()
    for i, m in enumerate(matchers):
        if i not in done:
            m.fill_bitmask(bitmask[i, :m.num_words])
    return bitmask


class GrammarCompiler:
    """Compiles constraints on a thread pool (never the engine thread), caching the results.

    Args:
        tokenizer: the model's (fast) transformers tokenizer.
        eos_token_ids: the ids that end a completion; the grammar allows them only where the text is complete.
        max_workers: compile threads.
        cache_size: compiled constraints kept (least recently used dropped first).
        limits: llguidance ``LLParserLimits`` bounding the work of one compile and one mask (None: its defaults).
    """

    def __init__(self, tokenizer, eos_token_ids, max_workers: int = 2, cache_size: int = 256, limits=None):
        self._hf_tokenizer = tokenizer
        self._eos = sorted(int(t) for t in eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pagedserve-grammar")
        self._cache: collections.OrderedDict[StructuredOutput, Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self._limits = limits
        self._lock = threading.Lock()             # guards the cache (held for microseconds)
        self._tokenizer_lock = threading.Lock()   # held while the library's tokenizer is built
        self._lltokenizer: "llguidance.LLTokenizer | None" = None

    def submit(self, constraint: StructuredOutput) -> Future:
        """A future of the :class:`CompiledGrammar` (already done on a cache hit). Its exception, for a
        constraint the library rejects, is InvalidInputError naming ``constraint.field`` with the library's
        message."""
        with self._lock:
            fut = self._cache.get(constraint)
            if fut is not None:
                self._cache.move_to_end(constraint)
                return fut
            fut = self._pool.submit(self._compile, constraint)
            self._cache[constraint] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        """Compile on the calling thread, bypassing the pool and cache (benchmarks). Raises InvalidInputError."""
        return self._compile(constraint)

    def tokenizer(self) -> "llguidance.LLTokenizer":
        """The library's view of the tokenizer (built on first use, about 1 s)."""
        with self._tokenizer_lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, eos_token=self._eos)
            return self._lltokenizer

    def _compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        tokenizer = self.tokenizer()
        try:
            grammar = grammar_text(constraint)
        except (ValueError, TypeError) as exc:
            raise InvalidInputError(str(exc), constraint.field) from None
        kwargs = {"limits": self._limits} if self._limits is not None else {}
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, **kwargs)
        if matcher.is_error():
            raise InvalidInputError(matcher.get_error().strip(), constraint.field)
        return CompiledGrammar(matcher, bitmask_words(tokenizer.vocab_size))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
