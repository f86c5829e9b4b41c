"""Beam search (HF semantics): the search on plain values (:mod:`.search`) and its live beams as engine requests
sharing KV blocks (:mod:`.searcher`)."""
