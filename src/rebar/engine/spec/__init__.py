"""Speculative decoding: drafters guess a sequence's next tokens, the model checks them all in one
pass, and the sampler keeps the ones it would have produced itself (docs/speculative.md)."""
