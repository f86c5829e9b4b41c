"""Reasoning models (``--reasoning-parser``): the thinking a model writes between tags split from the answer, as
vLLM and SGLang do. :mod:`.splitter` is the incremental splitter, :mod:`.parsers` the formats, :mod:`.gate` the
engine's side (a structured-output grammar starts only once the reasoning has ended)."""
from .parsers import PARSERS, get_parser
from .splitter import Parser, ReasoningSplitter, Split, split_whole

__all__ = ["PARSERS", "Parser", "ReasoningSplitter", "Split", "get_parser", "split_whole"]
