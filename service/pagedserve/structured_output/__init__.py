"""Structured output: constraints (JSON schema, JSON object, regex, choice, grammar) as a token mask in the
sampler. The request-side value is :class:`pagedserve.sampling_params.StructuredOutput` (no grammar library, a leaf
module the front ends use); :mod:`.grammar` is the llguidance
integration (compile off the engine thread, one matcher per completion, batched bitmasks); :mod:`.bitmask` applies
bitmasks to logits; :mod:`.waiting` holds requests whose grammar is still compiling; :mod:`.manager` is the
engine's side (compile, wait, admit)."""
from ..sampling_params import KINDS, StructuredOutput

__all__ = ["KINDS", "StructuredOutput"]
