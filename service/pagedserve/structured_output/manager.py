"""The engine's side of structured output (vLLM's ``StructuredOutputManager``): compile a request's constraint off
the engine thread and hold the request outside the scheduler until its grammar is ready."""
from __future__ import annotations

from typing import Any

import torch

from ..sampling_params import StructuredOutput
from ..scheduler_output import SchedulerOutput
from .grammar import CompiledGrammar, GrammarCompiler, fill_bitmasks
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

    @staticmethod
    def grammar_bitmask(sched: SchedulerOutput, requests: dict) -> None:
        """Set ``sched.grammar_bitmask`` and ``structured_output_request_ids``: for each scheduled request with a
        grammar that samples this step (``requests``: the scheduler's live requests by id), the next-token mask at
        each position it samples: its matcher's now, or with drafts the masks computed when they were proposed
        (``spec_bitmask``, one row per draft position)."""
        parts: list[torch.Tensor | None] = []
        matchers, owners = [], []
        for req_id, n in sched.num_scheduled_tokens.items():
            req = requests[req_id]
            if req.grammar is None or req.params.beam_search is not None:
                continue
            drafts = sched.scheduled_spec_decode_tokens.get(req_id, ())
            if req.num_computed_tokens + n - len(drafts) != req.num_tokens:
                continue   # a prefill chunk: nothing sampled
            sched.structured_output_request_ids[req_id] = sum(1 if p is None else p.shape[0] for p in parts)
            if drafts:
                parts.append(req.spec_bitmask[:1 + len(drafts)])
            else:
                parts.append(None)
                matchers.append(req.grammar)
                owners.append(len(parts) - 1)
        if not parts:
            return
        rows = fill_bitmasks(matchers) if matchers else None
        for k, i in enumerate(owners):
            parts[i] = rows[k:k + 1]
        width = max(p.shape[1] for p in parts)
        sched.grammar_bitmask = torch.cat([p if p.shape[1] == width else
                                           torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

    def shutdown(self) -> None:
        self.compiler.shutdown()
