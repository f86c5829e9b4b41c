"""The sampler's operations on logits, one concern a module: penalties, top-k / top-p / min-p, logprobs, grammar
masks."""
