"""Per-request sampling parameters: one frozen, self-checking dataclass mirroring the proto's ``SamplingParams``,
with the two values it nests, :class:`BeamSearchParams` (proto ``BeamSearch``) and :class:`StructuredOutput`
(proto ``StructuredOutput``). A leaf module: it imports only the errors, so every layer may use it.

Field names, defaults and ranges follow ``protos/pagedserve/v1/inference.proto`` and API.md (vLLM / OpenAI
semantics). Every violation raises :class:`pagedserve.errors.InvalidInputError` with ``field="sampling.<name>"``.
Checks that need the model (vocabulary size, the server's logprobs cap) live in :meth:`validate_for_model`.

Resource limits: a request's cost must stay bounded whatever it asks for, so the fields that multiply work per
step have documented caps (below), each rejected past its cap with ``InvalidInputError`` naming the field
(INVALID_ARGUMENT). The other bounds live where the quantity is known: ``max_tokens`` and the prompt length by
``max_model_len`` (``LLMEngine.add_request``), ``logprobs`` / ``prompt_logprobs`` k by the server's
``EngineConfig.max_logprobs`` (:meth:`SamplingParams.validate_for_model`), the whole request's size by the server's
``max_receive_message_bytes`` (gRPC answers RESOURCE_EXHAUSTED before any handler runs).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import NoReturn

from pagedserve.errors import InvalidInputError

# Temperatures below this are sampled greedily: dividing fp32 logits by them overflows (vLLM uses the same 1e-5).
GREEDY_TEMPERATURE_EPS = 1e-5
_MAX_SEED = 2**64 - 1  # proto uint64
_PENALTY_RANGE = (-2.0, 2.0)
MAX_N = 64
"""Most completions one request may ask for (``n``): each holds its own decode slot and output tokens."""
MAX_STOP_STRINGS = 16
"""Most stop strings per request (``stop``): every new token is matched against each of them."""
MAX_STOP_STRING_CHARS = 256
"""Longest stop string, in characters: up to this many characters of output can be held back while a match is
still possible, and matching costs grow with it."""
MAX_STOP_TOKEN_IDS = 1024
"""Most ``stop_token_ids`` per request (also masked for ``min_tokens`` steps)."""
MAX_ABS_LOGIT_BIAS = 100.0
"""``logit_bias`` values lie in [-100, 100] (OpenAI's bound: -100 bans a token, 100 forces it)."""
MAX_LOGIT_BIAS_ENTRIES = 1024
"""Most ``logit_bias`` entries per request (each is one scattered add per step)."""
_SHAPES = {"shapes_distribution": True}  # field metadata: reshapes or reports the distribution (not with beams)


def _fail(name: str, message: str) -> NoReturn:
    raise InvalidInputError(message, field=f"sampling.{name}")


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, f"must be an integer, got {value!r}")
    if lo is not None and value < lo:
        _fail(name, f"must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        _fail(name, f"must be <= {hi}, got {value}")


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        _fail(name, f"must be finite, got {value}")
    return float(value)


MAX_BEAM_WIDTH = 16
"""Most beams per request (``beam_search.beam_width``): each holds a decode slot and its own KV blocks."""


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """A request's beam search settings (proto ``BeamSearch``; HF's ``num_beams``, ``length_penalty``,
    ``early_stopping``).

    Raises:
        InvalidInputError: ``beam_width`` outside [2, MAX_BEAM_WIDTH], ``length_penalty`` not finite,
            ``early_stopping`` not a bool; the field is ``beam_search.<name>``.
    """

    beam_width: int                 # beams kept each step, in [2, MAX_BEAM_WIDTH]
    length_penalty: float = 1.0     # exponent of the generated length dividing a finished hypothesis' logprob
    early_stopping: bool = False    # stop once beam_width hypotheses are finished

    def __post_init__(self) -> None:
        w = self.beam_width
        if isinstance(w, bool) or not isinstance(w, int) or not 2 <= w <= MAX_BEAM_WIDTH:
            raise InvalidInputError(f"must be an integer in [2, {MAX_BEAM_WIDTH}], got {w!r}",
                                    "beam_search.beam_width")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise InvalidInputError(f"must be a finite number, got {lp!r}", "beam_search.length_penalty")
        object.__setattr__(self, "length_penalty", float(lp))
        if not isinstance(self.early_stopping, bool):
            raise InvalidInputError(f"must be a bool, got {self.early_stopping!r}", "beam_search.early_stopping")



# ---- structured output (the request-side value; the grammar library lives in pagedserve.structured_output) ----
STRUCTURED_OUTPUT_FIELD = "sampling.structured_output"
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 65536
"""Longest schema / regex / grammar text, and most characters over all choices: compiling costs grow with it."""
MAX_CHOICES = 1024
"""Most strings in ``choice``."""


def _fail_so(name: str | None, message: str) -> NoReturn:
    raise InvalidInputError(message, f"{STRUCTURED_OUTPUT_FIELD}.{name}" if name else STRUCTURED_OUTPUT_FIELD)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Exactly one constraint; build it with keywords or :meth:`from_value` (a mapping or an instance).

    Raises:
        InvalidInputError: none or several kinds set, a wrong type, a schema that is not a JSON object (or bool),
            a text past ``MAX_CONSTRAINT_CHARS``, an empty ``choice`` or one past ``MAX_CHOICES``.
    """

    json_schema: str | None = None        # a JSON Schema document, as JSON text (a dict is dumped)
    json_object: bool = False             # True: any JSON object
    regex: str | None = None              # the whole text matches it (Rust regex syntax)
    choice: tuple[str, ...] | None = None  # the text is one of these
    grammar: str | None = None            # Lark-style grammar (llguidance's dialect, or GBNF), start rule `start`

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, (Mapping, bool)):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))  # key order kept: it is the
            # order the properties are generated in
        if self.choice is not None:
            if isinstance(self.choice, str) or not hasattr(self.choice, "__iter__"):
                _fail_so("choice", f"must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            _fail_so("json_object", f"must be a bool, got {self.json_object!r}")
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            _fail_so(None, f"set exactly one of {', '.join(KINDS)} (got {', '.join(set_kinds) or 'none'})")
        kind = set_kinds[0]
        if kind == "choice":
            self._check_choice()
        elif kind != "json_object":
            text = getattr(self, kind)
            if not isinstance(text, str):
                _fail_so(kind, f"must be a string, got {type(text).__name__}")
            if len(text) > MAX_CONSTRAINT_CHARS:
                _fail_so(kind, f"at most {MAX_CONSTRAINT_CHARS} characters are allowed, got {len(text)}")
            if kind == "json_schema":
                try:
                    doc = json.loads(text)
                except ValueError as exc:
                    _fail_so(kind, f"is not valid JSON: {exc}")
                if not isinstance(doc, (dict, bool)):
                    _fail_so(kind, f"must be a JSON object (a JSON Schema), got {type(doc).__name__}")
            elif kind == "grammar" and not text.strip():
                _fail_so(kind, "must not be empty")

    def _check_choice(self) -> None:
        if not self.choice:
            _fail_so("choice", "needs at least one string")
        if len(self.choice) > MAX_CHOICES:
            _fail_so("choice", f"at most {MAX_CHOICES} strings are allowed, got {len(self.choice)}")
        for c in self.choice:
            if not isinstance(c, str):
                _fail_so("choice", f"must be strings, got {c!r}")
        if sum(len(c) for c in self.choice) > MAX_CONSTRAINT_CHARS:
            _fail_so("choice", f"at most {MAX_CONSTRAINT_CHARS} characters in all are allowed")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of :data:`KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field(self) -> str:
        """The request field errors about this constraint name, e.g. ``sampling.structured_output.regex``."""
        return f"{STRUCTURED_OUTPUT_FIELD}.{self.kind}"

    @classmethod
    def from_value(cls, value: object) -> "StructuredOutput":
        """An instance from an instance or a mapping of its field names (``{"regex": "[0-9]+"}``).

        Raises:
            InvalidInputError: not a mapping, an unknown key, or what the constructor raises.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            _fail_so(None, f"must be a mapping with one of {', '.join(KINDS)}, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            _fail_so(None, f"unknown field(s) {unknown}; known: {', '.join(KINDS)}")
        return cls(**value)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's completions. Defaults are API.md's (an unset proto field takes them).

    Construct with plain values; lists and dicts are accepted for the sequence fields and normalized to tuples
    (``logit_bias`` becomes ``((token_id, bias), ...)`` sorted by token id), so instances are hashable.

    Raises:
        InvalidInputError: a value out of range, NaN or infinite, or past a resource limit (``MAX_N``,
            ``MAX_STOP_STRINGS``, ...); ``field`` is ``"sampling.<name>"``.
    """

    max_tokens: int | None = None        # new tokens per completion, >= 1; None: the room left in max_model_len
    min_tokens: int = 0                  # EOS and stop_token_ids are masked until this many new tokens exist
    temperature: float = 1.0             # >= 0; 0 (below 1e-5) is greedy
    top_p: float = field(default=1.0, metadata=_SHAPES)                 # nucleus mass, in (0, 1]; 1 is off
    top_k: int = field(default=0, metadata=_SHAPES)                     # keep the k most likely tokens; 0 is off
    # drop tokens with prob < min_p * max prob; in [0, 1]; 0 is off
    min_p: float = field(default=0.0, metadata=_SHAPES)
    seed: int | None = None              # this request's own generator seed, in [0, 2**64); None: shared generator
    # OpenAI: subtracted once from each token already in the output; [-2, 2]
    presence_penalty: float = field(default=0.0, metadata=_SHAPES)
    # OpenAI: subtracted per occurrence in the output; [-2, 2]
    frequency_penalty: float = field(default=0.0, metadata=_SHAPES)
    # CTRL / HF, over prompt + output tokens; > 0; 1 is off
    repetition_penalty: float = field(default=1.0, metadata=_SHAPES)
    stop: tuple[str, ...] = ()           # <= MAX_STOP_STRINGS non-empty strings of <= MAX_STOP_STRING_CHARS
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the completion; <= MAX_STOP_TOKEN_IDS
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    ignore_eos: bool = False             # EOS is an ordinary token: it neither ends the completion nor is masked
    n: int = 1                           # completions for this prompt, in [1, MAX_N]
    # k >= 0: each new token's logprob, rank and the top-k alternatives
    logprobs: int | None = field(default=None, metadata=_SHAPES)
    # k >= 0: the same for each prompt token after the first
    prompt_logprobs: int | None = field(default=None, metadata=_SHAPES)
    skip_special_tokens: bool = True     # leave special tokens out of the text
    # (token id, bias added to its logit), sorted by id; <= 1024
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), metadata=_SHAPES)
    truncate_prompt_tokens: int | None = None  # >= 1: keep only the last k prompt tokens
    # a constraint on the text (a mapping is converted)
    structured_output: StructuredOutput | None = field(default=None, metadata=_SHAPES)
    beam_search: BeamSearchParams | None = None  # beam search instead of sampling (a mapping is converted); then
                                         # temperature must be 0, n <= beam_width, and the fields that reshape or
                                         # report the distribution (top_p/k, min_p, penalties, logit_bias, logprobs,
                                         # structured_output) keep their defaults

    def _check_beam_search(self) -> None:
        """With ``beam_search``: only greedy-compatible fields (HF ``do_sample=False`` beam search)."""
        if isinstance(self.beam_search, Mapping):
            object.__setattr__(self, "beam_search", BeamSearchParams(**self.beam_search))
        beam = self.beam_search
        if beam is None:
            return
        if not isinstance(beam, BeamSearchParams):
            raise InvalidInputError(f"must be a BeamSearch message, got {beam!r}", "beam_search")
        if not self.greedy:
            _fail("temperature", f"must be 0 with beam_search, got {self.temperature}")
        if self.n > beam.beam_width:
            _fail("n", f"must be <= beam_search.beam_width ({beam.beam_width}), got {self.n}")
        for f in fields(self):
            if f.metadata.get("shapes_distribution") and getattr(self, f.name) != f.default:
                _fail(f.name, f"is not supported with beam_search (got {getattr(self, f.name)!r})")

    def __post_init__(self) -> None:
        self._normalize_sequences()
        _check_int("max_tokens", self.max_tokens, lo=1, optional=True)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in FLOAT_FIELDS:
            object.__setattr__(self, name, _check_float(name, getattr(self, name)))
        if self.temperature < 0:
            _fail("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, lo=0)
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        _check_int("seed", self.seed, lo=0, hi=_MAX_SEED, optional=True)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _PENALTY_RANGE[0] <= value <= _PENALTY_RANGE[1]:
                _fail(name, f"must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, f"must be a bool, got {getattr(self, name)!r}")
        _check_int("n", self.n, lo=1, hi=MAX_N)
        _check_int("logprobs", self.logprobs, lo=0, optional=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, optional=True)
        _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, lo=1, optional=True)
        self._check_beam_search()

    def _normalize_sequences(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS:
            _fail("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str):
                _fail("stop", f"must be strings, got {s!r}")
            if not s:
                _fail("stop", "stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                _fail("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}")
        stop_token_ids = tuple(self.stop_token_ids)
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, "
                  f"got {len(stop_token_ids)}")
        for t in stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        if self.structured_output is not None:
            object.__setattr__(self, "structured_output", StructuredOutput.from_value(self.structured_output))

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax: temperature 0 (or below 1e-5, where fp32 division would overflow)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def validate_for_model(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Checks that need the served model.

        Args:
            vocab_size: number of rows of the model's logits (token ids must be below it).
            max_logprobs: the server's cap on ``logprobs`` and ``prompt_logprobs``.

        Raises:
            InvalidInputError: a token id in ``stop_token_ids`` / ``logit_bias`` >= vocab_size, or a logprobs count
                above ``max_logprobs``.
        """
        for t in self.stop_token_ids:
            if t >= vocab_size:
                _fail("stop_token_ids", f"token id {t} is outside the vocabulary (size {vocab_size})")
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                _fail("logit_bias", f"token id {t} is outside the vocabulary (size {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k > max_logprobs:
                _fail(name, f"must be <= {max_logprobs}, got {k}")


FLOAT_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.type == "float")
"""The fields that take a real number (ints are accepted and converted), from the annotations."""


def _normalize_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A mapping or pairs -> ``((token_id, bias), ...)`` sorted by token id; ids >= 0, biases finite, no repeats."""
    items: Iterable = value.items() if isinstance(value, Mapping) else value  # type: ignore[assignment]
    out: dict[int, float] = {}
    try:
        pairs = [tuple(p) for p in items]
    except TypeError:
        _fail("logit_bias", f"must map token ids to biases, got {value!r}")
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        _fail("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed, got {len(pairs)}")
    for pair in pairs:
        if len(pair) != 2:
            _fail("logit_bias", f"entries must be (token_id, bias), got {pair!r}")
        token_id, bias = pair
        _check_int("logit_bias", token_id, lo=0)
        if token_id in out:
            _fail("logit_bias", f"token id {token_id} given twice")
        out[token_id] = _check_float("logit_bias", bias)
        if abs(out[token_id]) > MAX_ABS_LOGIT_BIAS:
            _fail("logit_bias", f"bias for token {token_id} must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                  f"{MAX_ABS_LOGIT_BIAS:g}], got {bias}")
    return tuple(sorted(out.items()))
