"""Tests of pagedserve.sample: the sampler and its ops against HF's logits processors."""
