"""Sampling: the batched sampler (:mod:`.sampler`), speculative decoding's rejection sampler
(:mod:`.rejection_sampler`) and the logits operations they share (:mod:`.ops`)."""
