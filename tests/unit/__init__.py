"""Unit tests, one folder per pagedserve package (tests of the leaf modules and config sit here at the top); no server,
no embedded model (unit/conftest.py refuses to locate one)."""
