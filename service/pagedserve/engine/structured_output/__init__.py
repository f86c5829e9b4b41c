"""Structured output: constraints (JSON schema, JSON object, regex, choice, grammar) as a token mask in the
sampler. :mod:`.params` is the request-side value (no grammar library); :mod:`.grammar` the llguidance
integration (compile off the engine thread, one matcher per completion, batched bitmasks); :mod:`.bitmask` applies
bitmasks to logits; :mod:`.waiting` holds requests whose grammar is still compiling."""
from .params import KINDS, StructuredOutput

__all__ = ["KINDS", "StructuredOutput"]
