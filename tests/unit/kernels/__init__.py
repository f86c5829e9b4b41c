"""Unit tests of pagedserve.kernels that need neither a GPU nor a compiled library."""
