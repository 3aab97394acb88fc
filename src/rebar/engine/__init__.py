"""The engine: requests, paged KV cache, scheduler, runner, sampler, detokenizer, async bridge,
offline LLM."""
