"""Tests of pagedserve.embedding: the cross-call batcher and its micro-batch policy."""
