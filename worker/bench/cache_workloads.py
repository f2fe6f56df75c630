"""Workloads for prefix caching and parallel samples in `cbq bench engine` (issue 12); common.py has W1/W2.

W3: many requests behind one long shared prefix (a system prompt or few-shot block).
W4: prompts asking for n parallel samples each. With prefix caching off, W4 is sent as n separate
requests per prompt, seeded so that each one draws exactly the stream of the sample it replaces: the
two runs generate the same tokens, one computes each prompt once, the other n times.
The "-tiny" variants are scaled down for CPU runs with the tiny presets.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SharedPrefix:
    num_requests: int
    prefix_len: int
    unique_len: tuple[int, int]  # each request's own tokens after the prefix: uniform in this range
    max_new_tokens: int


@dataclass(frozen=True)
class ParallelSamples:
    num_prompts: int
    prompt_len: int
    n: int
    max_new_tokens: int


CACHE_WORKLOADS: dict[str, SharedPrefix | ParallelSamples] = {
    "W3": SharedPrefix(1000, 2000, (50, 200), 128),
    "W4": ParallelSamples(256, 512, 8, 256),
    "W3-tiny": SharedPrefix(48, 256, (10, 40), 16),
    "W4-tiny": ParallelSamples(16, 64, 4, 32),
}


def make_cache_workload(
    name: str, vocab_limit: int, prefix_caching: bool, seed: int = 0, num_requests: int | None = None
):
    """The requests of workload `name`; `num_requests` overrides W3's request or W4's prompt count."""
    from worker.engine.api import EngineRequest, SamplingParams
    from worker.engine.sampler import sample_seed

    spec = CACHE_WORKLOADS[name]
    rng = random.Random(seed)
    if isinstance(spec, SharedPrefix):
        prefix = [rng.randrange(vocab_limit) for _ in range(spec.prefix_len)]
        params = SamplingParams(max_new_tokens=spec.max_new_tokens, ignore_eos=True)
        return [
            EngineRequest(
                f"{name}-{i}",
                prefix + [rng.randrange(vocab_limit) for _ in range(rng.randint(*spec.unique_len))],
                params,
            )
            for i in range(num_requests or spec.num_requests)
        ]
    reqs = []
    for p in range(num_requests or spec.num_prompts):
        prompt = [rng.randrange(vocab_limit) for _ in range(spec.prompt_len)]
        params = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=1.0, seed=p, ignore_eos=True)
        if prefix_caching:
            reqs.append(EngineRequest(f"{name}-{p}", prompt, params, n=spec.n))
        else:
            reqs += [
                EngineRequest(f"{name}-{p}-{i}", prompt, dataclasses.replace(params, seed=sample_seed(p, i)))
                for i in range(spec.n)
            ]
    return reqs
