"""Tests of pagedserve.core: the scheduler and the KV-cache block accounting."""
