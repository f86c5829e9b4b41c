"""The engine's side of structured output (vLLM's ``StructuredOutputManager``): compile a request's constraint off
the engine thread and hold the request outside the scheduler until its grammar is ready."""
from __future__ import annotations

from typing import Any

from ..sampling_params import StructuredOutput
from .grammar import CompiledGrammar, GrammarCompiler
from .waiting import GrammarWaitList


class StructuredOutputManager:
    """Owns the grammar compiler and the wait list (the engine thread only).

    Args:
        tokenizer: the model's transformers tokenizer.
        eos_token_ids: the model's EOS ids (a grammar may end on them).
    """

    def __init__(self, tokenizer, eos_token_ids):
        self.compiler = GrammarCompiler(tokenizer, eos_token_ids)
        self.waiting = GrammarWaitList()

    def __len__(self) -> int:
        """Requests waiting for their grammar."""
        return len(self.waiting)

    def admit(self, key: Any, constraint: StructuredOutput) -> CompiledGrammar | None:
        """Start compiling ``constraint`` for ``key`` (the engine's request group). Returns the compiled grammar
        when it is settled already (a cached constraint or a fast compile); otherwise None, and ``key`` comes back
        from :meth:`pop_settled` once it is.

        Raises:
            InvalidInputError: the constraint is already known to be bad (naming its field).
        """
        compiling = self.compiler.submit(constraint)
        if not compiling.done():
            self.waiting.add(key, compiling, constraint.field)
            return None
        if compiling.exception() is not None:
            raise compiling.exception()
        return compiling.result()

    def pop_settled(self) -> list[tuple[Any, CompiledGrammar | None, BaseException | None]]:
        """``(key, compiled, None)`` or ``(key, None, error)`` for each request whose compile ended (or timed out)."""
        return self.waiting.pop_settled()

    def wait(self, timeout_s: float) -> None:
        """Block until a compile finishes, a deadline passes, or ``timeout_s`` (nothing else to run)."""
        self.waiting.wait(timeout_s)

    def shutdown(self) -> None:
        self.compiler.shutdown()
