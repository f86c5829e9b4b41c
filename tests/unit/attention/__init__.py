"""Tests of pagedserve.attention: the torch reference backend."""
