"""How long a request will take from admission to its last token, at the batch it will run in (the estimate the
deadline policy, :mod:`.deadlines`, admits by).

A step's time is modelled from the executor's recent steps (:class:`StepCost`): a step over ``rows`` requests takes
``decode_s(rows) = a + b * rows`` (least squares over the recent steps that computed one token per row), plus
``token_s`` for every further token (a prefill chunk's, a draft's), fitted on the recent steps that had some. The
mean step time is not that yardstick under load: it says what the last steps cost, and a prompt costs as much as
tens of decode steps (bench/deadlines.py, 2 CPU threads: 12 ms for a step of 8 decoding rows, 126 ms with one
64-token prompt in it), so a request's time depends on how many prompts will join its steps.

:class:`BatchLoad` is the running batch as one step sees it; :meth:`BatchLoad.service_s` is the estimate for a
request of ``steps`` steps: every seat busy during them (``decode_s(max_num_seqs)`` a step), plus the prefill of its
own prompt, of the running requests' unfinished prompts and of the requests that take the seats freed during its
steps (a seat's occupant ends after its remaining steps, from max_tokens; each follower is like the running ones on
average: mean prompt, mean steps). That is the load of an engine that keeps its seats full: the followers' prompts
are reserved when a request is admitted, so admitting them later does not break its estimate.
"""
from __future__ import annotations

import math
from collections import deque
from statistics import fmean

from ...request import Request

DECODE_WINDOW = 64    # decode steps (one token per row) decode_s is fitted on
PREFILL_WINDOW = 32   # steps with further tokens (prefill chunks, drafts) token_s is fitted on


def steps_needed(prompt_tokens: int, output_tokens: int, prefill_chunk: int) -> int:
    """Steps from admission to the last of ``output_tokens``: the prompt's prefill chunks of at most
    ``prefill_chunk`` tokens, then one step per further token."""
    return math.ceil(prompt_tokens / prefill_chunk) + max(0, output_tokens - 1)


def further_tokens(prompt_tokens: int, prefill_chunk: int) -> int:
    """Tokens of a prompt beyond one per prefill step (what :class:`StepCost` prices at ``token_s``)."""
    return prompt_tokens - math.ceil(prompt_tokens / prefill_chunk) if prompt_tokens > 0 else 0


def remaining_steps(request: Request, prefill_chunk: int) -> int:
    """:func:`steps_needed` for what ``request`` has left (its uncomputed tokens, its output tokens to come)."""
    return steps_needed(request.num_tokens - request.num_computed_tokens,
                        request.max_tokens - request.num_output_tokens, prefill_chunk)


class _Window:
    """Sums of a few values over the last ``size`` samples."""

    def __init__(self, size: int, width: int) -> None:
        self._samples: deque[tuple[float, ...]] = deque()
        self._size = size
        self.sums = [0.0] * width

    def __len__(self) -> int:
        return len(self._samples)

    def push(self, *values: float) -> None:
        if len(self._samples) == self._size:
            for i, v in enumerate(self._samples.popleft()):
                self.sums[i] -= v
        self._samples.append(values)
        for i, v in enumerate(values):
            self.sums[i] += v


class StepCost:
    """The step time model above, fitted on the executor's recent steps."""

    def __init__(self, decode_window: int = DECODE_WINDOW, prefill_window: int = PREFILL_WINDOW) -> None:
        self._decode = _Window(decode_window, 5)     # 1, rows, rows^2, seconds, rows * seconds
        self._prefill = _Window(prefill_window, 4)   # 1, rows, further tokens, seconds

    def observe(self, seconds: float, rows: int, tokens: int) -> None:
        """One step computed ``tokens`` tokens for ``rows`` requests in ``seconds``."""
        if rows <= 0:
            return
        if tokens <= rows:
            self._decode.push(1.0, rows, rows * rows, seconds, rows * seconds)
        else:
            self._prefill.push(1.0, rows, tokens - rows, seconds)

    @property
    def ready(self) -> bool:
        """Whether a step has been measured."""
        return bool(len(self._decode) or len(self._prefill))

    def _line(self) -> tuple[float, float]:
        """(a, b) of decode_s. Rows that did not vary give a line through the origin and the mean (an upper bound
        for more rows); before any decode step, each row costs what a token of the measured steps did."""
        if not len(self._decode):
            _, rows, further, seconds = self._prefill.sums
            return 0.0, seconds / (rows + further)
        n, rows, rows2, seconds, rows_seconds = self._decode.sums
        spread = n * rows2 - rows * rows            # n^2 x the variance of the rows (exact: whole numbers)
        if spread < 0.01 * n * n:
            return 0.0, seconds / rows
        b = (n * rows_seconds - rows * seconds) / spread
        a = (seconds - b * rows) / n
        if b < 0:
            return seconds / n, 0.0
        if a < 0:
            return 0.0, rows_seconds / rows2
        return a, b

    def decode_s(self, rows: int) -> float:
        """Seconds of a step over ``rows`` requests, one token each (requires :attr:`ready`)."""
        a, b = self._line()
        return a + b * rows

    @property
    def token_s(self) -> float:
        """Seconds each token beyond one per row adds to a step: the measured steps with such tokens, their time
        beyond decode_s of their rows over their further tokens (per row before any; requires :attr:`ready`)."""
        a, b = self._line()
        if not len(self._prefill):
            return b
        n, rows, further, seconds = self._prefill.sums
        return max(0.0, seconds - n * a - b * rows) / further


class BatchLoad:
    """The running batch as one step sees it, for :meth:`service_s` (``cost`` must be ready).

    Args:
        running: the running requests (not empty).
        max_num_seqs: the seats.
        prefill_chunk: tokens one prefill step takes at most.
        cost: the step time model.
    """

    def __init__(self, running: list[Request], max_num_seqs: int, prefill_chunk: int, cost: StepCost) -> None:
        self.cost, self.seats, self.prefill_chunk = cost, max_num_seqs, prefill_chunk
        self.remaining = sorted(remaining_steps(r, prefill_chunk) for r in running)   # each occupant's steps left
        # tokens beyond one per step of the running requests' unfinished prompts, and of a follower's on average
        self.empty_seats = max(0, max_num_seqs - len(running))
        self.prefill_left = sum(further_tokens(r.num_tokens - r.num_computed_tokens, prefill_chunk) for r in running)
        self.follower_prompt = fmean(further_tokens(r.num_prompt_tokens, prefill_chunk) for r in running)
        self.follower_steps = max(1.0, fmean(steps_needed(r.num_prompt_tokens, r.max_tokens, prefill_chunk)
                                             for r in running))

    def followers(self, steps: int, empty_seats: int) -> int:
        """Requests that take a seat during the next ``steps`` steps: each empty seat's now, each occupied seat's
        when its occupant ends, then every :attr:`follower_steps` steps."""
        count = 0
        for left in [0] * empty_seats + self.remaining:
            if left >= steps:
                break
            count += 1 + int((steps - 1 - left) // self.follower_steps)
        return count

    def service_s(self, steps: int, prompt_tokens: int, joins: bool) -> float:
        """Seconds a request needs for its next ``steps`` steps with ``prompt_tokens`` of its own prompt still to
        prefill; ``joins``: it is not running yet and takes one of the empty seats (else it is running, and its
        unfinished prompt is counted among the running ones')."""
        empty = max(0, self.empty_seats - joins)
        tokens = further_tokens(prompt_tokens, self.prefill_chunk) + self.prefill_left + \
            self.followers(steps, empty) * self.follower_prompt
        return steps * self.cost.decode_s(self.seats) + tokens * self.cost.token_s
