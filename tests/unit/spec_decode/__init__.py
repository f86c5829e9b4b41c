"""Tests of pagedserve.spec_decode: the n-gram proposer and speculative steps on a random-weight Llama."""
