"""The engine: requests, paged KV cache, scheduler, runner, sampler, detokenizer, the async bridge
and the engine process, and the one builder that loads a model to run."""
