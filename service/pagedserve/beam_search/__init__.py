"""Beam search (HF semantics) on plain values: ranking a step's candidates and keeping the finished hypotheses
(:mod:`.ranking`). The live beams as engine requests sharing KV blocks are a scheduler policy:
:mod:`pagedserve.core.sched.beam_groups`."""
