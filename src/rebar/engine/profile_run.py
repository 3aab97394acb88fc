"""`rebar profile`: run a batch of random prompts through an engine core under the profiler."""

from __future__ import annotations

import torch

from rebar.engine.core import EngineCore
from rebar.engine.sampling_params import SamplingParams
from rebar.obs.profiling import ProfileResult, ProfileSession


def profile_engine(
    core: EngineCore,
    num_steps: int,
    batch: int,
    input_len: int,
    warmup_steps: int = 2,
    top: int = 20,
    seed: int = 0,
) -> ProfileResult:
    """Profile `num_steps` steps of `core` (an `EngineCore`) running `batch` requests of `input_len`
    random tokens.

    The first steps are prefill; with `max_num_batched_tokens` >= batch x input_len the rest are
    decode steps. `warmup_steps` run before the profiler starts (first-call allocations, lazy
    initialisation); every request is aborted at the end, leaving the engine as it was.
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = core.tokenizer.vocab_size
    params = SamplingParams(
        max_tokens=warmup_steps + num_steps + 1, temperature=0.0, ignore_eos=True
    )
    ids = [f"profile-{seed}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = torch.randint(0, vocab, (input_len,), generator=generator).tolist()
        core.add_request(request_id, prompt, params)
    try:
        for _ in range(warmup_steps):
            core.step()
        session = ProfileSession(core.runner.model, core.runner.device, top).start()
        try:
            for _ in range(num_steps):
                if not core.has_unfinished_requests():
                    break
                core.step()
                session.step_done()
        finally:
            result = session.finish()
    finally:
        for request_id in ids:
            core.abort_request(request_id)
    return result
