"""Tests of pagedserve.engine: the engine loop on random-weight models."""
