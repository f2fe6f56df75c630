"""The benchmark workloads: request counts and length distributions, as engine requests or as JSONL prompt lines.

W1/W2 draw lengths uniformly from their ranges (WORKLOADS); W5 is MLPerf-shaped (OFFLINE_WORKLOADS: normal prompt
lengths, its own seed and warm-up). Prefix caching and n > 1 (W3, W4) are in cache_workloads.py.
"""

from __future__ import annotations

import contextlib
import json
import random
import statistics
from dataclasses import dataclass
from typing import Any

import click

WORKLOADS = {
    # name: (num_requests, prompt_len range, output_len range)
    "W1": (32, (256, 256), (1024, 1024)),
    "W2": (1000, (100, 1024), (100, 1024)),
    "tiny": (16, (8, 64), (16, 32)),
}




@dataclass(frozen=True)
class OfflineWorkload:
    """An MLPerf-shaped offline workload: prompt lengths normal (rounded, clipped to a range), outputs uniform,
    EOS ignored, random token ids from its own seed, measured after a warm-up of `num_warmup` requests."""

    num_requests: int
    prompt_len_mean: float
    prompt_len_std: float
    prompt_len_range: tuple[int, int]
    output_len_range: tuple[int, int]
    seed: int
    num_warmup: int

    def describe(self) -> str:
        (p_lo, p_hi), (o_lo, o_hi) = self.prompt_len_range, self.output_len_range
        return (
            f"prompts N({self.prompt_len_mean:g}, {self.prompt_len_std:g}) clipped to {p_lo:,}-{p_hi:,}, outputs "
            f"{o_lo}-{o_hi}, {self.num_requests:,} requests, a {self.num_warmup}-request warm-up"
        )


OFFLINE_WORKLOADS = {
    # MLPerf Inference's Llama-3.1-8B offline test (CNN/DailyMail summarization: prompts of about 780 tokens,
    # outputs of at most 128) at issue 49's size: 2,000 requests, prefill-bound
    "W5": OfflineWorkload(2000, 780.0, 350.0, (100, 2000), (30, 128), seed=7, num_warmup=64),
    "W5-tiny": OfflineWorkload(8, 48.0, 20.0, (8, 96), (4, 12), seed=7, num_warmup=4),  # for CPU runs, tiny presets
}


def make_workload(name: str, vocab_limit: int, seed: int = 0, num_requests: int | None = None):
    """Engine requests with random token ids below `vocab_limit`; every one runs to its length. An offline
    workload (W5) draws from its own seed."""
    from worker.engine.api import EngineRequest, SamplingParams

    if name in OFFLINE_WORKLOADS:
        return make_offline_workload(name, vocab_limit, num_requests)
    n, (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    n = num_requests or n
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(vocab_limit) for _ in range(rng.randint(p_lo, p_hi))]
        params = SamplingParams(max_new_tokens=rng.randint(o_lo, o_hi), ignore_eos=True)
        reqs.append(EngineRequest(f"{name}-{i}", prompt, params))
    return reqs


def make_offline_workload(name: str, vocab_limit: int, num_requests: int | None = None):
    """The requests of an OFFLINE_WORKLOADS entry: each prompt's length drawn from N(mean, std), rounded and
    clipped to the range, then its output length uniform in its range (from Random(seed)); its token ids from
    Random(seed + 1), so that the lengths do not depend on the vocabulary. A shorter run is a prefix of a longer."""
    from worker.engine.api import EngineRequest, SamplingParams

    spec = OFFLINE_WORKLOADS[name]
    lengths, ids = random.Random(spec.seed), random.Random(spec.seed + 1)
    (p_lo, p_hi), (o_lo, o_hi) = spec.prompt_len_range, spec.output_len_range
    reqs = []
    for i in range(num_requests or spec.num_requests):
        prompt_len = min(p_hi, max(p_lo, round(lengths.gauss(spec.prompt_len_mean, spec.prompt_len_std))))
        params = SamplingParams(max_new_tokens=lengths.randint(o_lo, o_hi), ignore_eos=True)
        reqs.append(EngineRequest(f"{name}-{i}", [ids.randrange(vocab_limit) for _ in range(prompt_len)], params))
    return reqs


def workload_stats(reqs) -> dict:
    """The lengths a run's requests have: what its report records next to the numbers."""
    prompt_lens = [len(r.prompt_ids) for r in reqs]
    output_lens = [r.sampling.max_new_tokens or 0 for r in reqs]
    out: dict[str, float] = {"num_requests": len(reqs)}
    for name, lens in (("prompt_len", prompt_lens), ("output_len", output_lens)):
        out.update({
            f"{name}_mean": statistics.fmean(lens),
            f"{name}_std": statistics.pstdev(lens),
            f"{name}_min": min(lens),
            f"{name}_max": max(lens),
        })  # fmt: skip
    return out


def warmup_requests(reqs, vocab_limit: int, full_length: bool = False):
    """A warm-up shaped like `reqs`: the same prompt lengths (and samples per prompt) with every token id
    shifted, so nothing it caches is a prefix of the measured run, and outputs capped at 4-32 tokens, spread
    so the running batch shrinks through every size. Running it first compiles every kernel variant the
    measured run launches (Triton specialises on batch-dependent constants), so the first run measured in a
    process pays no JIT time (seen on the H200: W2 at 47.8 ms per step when first, 43.2 after a warm run).
    `full_length`: outputs as long as the measured run's (the whole workload, on other token ids)."""
    import dataclasses

    out = []
    for i, r in enumerate(reqs):
        cap = 4 + i % 29
        sampling = r.sampling
        if not full_length:
            sampling = dataclasses.replace(r.sampling, max_new_tokens=min(r.sampling.max_new_tokens or cap, cap))
        prompt = [(t + 1) % vocab_limit for t in r.prompt_ids]
        out.append(
            dataclasses.replace(r, request_id=f"warmup-{r.request_id}", prompt_ids=prompt, sampling=sampling)
        )
    return out


def bench_json_schema(max_output_len: int) -> dict:
    """The small schema of `cbq bench engine --constrain-json`: a few typed fields, then a string long enough
    that every request still runs to its max_new_tokens, so constrained and plain runs make the same tokens
    (a token holds at most a few characters of it)."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999999},
            "label": {"enum": ["positive", "negative", "neutral"]},
            "done": {"type": "boolean"},
            "text": {"type": "string", "minLength": 8 * max_output_len},
        },
        "required": ["id", "label", "done", "text"],
        "additionalProperties": False,
    }


def with_variant(reqs, constrain_json: bool, top_logprobs: int | None):
    """The same requests, each constrained to `bench_json_schema` and/or asking for top logprobs."""
    import dataclasses

    from worker.engine.api import Constraint, ConstraintKind

    if not constrain_json and top_logprobs is None:
        return reqs
    longest = max(r.sampling.max_new_tokens or 1024 for r in reqs)
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(bench_json_schema(longest)))
    return [
        dataclasses.replace(
            r,
            sampling=dataclasses.replace(
                r.sampling, constraint=constraint if constrain_json else None, logprobs=top_logprobs
            ),
        )
        for r in reqs
    ]


def workload_lines(name: str, num_requests: int | None, seed: int = 0) -> list[str]:
    """JSONL prompt lines whose byte-tokenized lengths follow the workload (BOS + one token per byte)."""
    n, (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    rng = random.Random(seed)
    lines = []
    for i in range(num_requests or n):
        text = "".join(chr(rng.randrange(32, 127)) for _ in range(rng.randint(p_lo, p_hi) - 1))
        line = {
            "custom_id": f"{name}-{i}",
            "prompt": text,
            "max_new_tokens": rng.randint(o_lo, o_hi),
            "ignore_eos": True,
        }
        lines.append(json.dumps(line))
    return lines


@contextlib.contextmanager
def triton_compiles():
    """Names of the Triton kernels compiled while the block runs (a list, filled as they happen).

    A compile inside a measured run stalls its step for up to seconds, and the step's device events count the
    stall (the H200's "first run is slow" effect, benchmarks/archive/HISTORY.md): the bench reports them so a number
    that includes one says so. Uses Triton's `jit_cache_hook` (called before each compile of a variant this
    process has not built yet); without Triton, or with a Triton that lacks the hook, the list stays empty."""
    names: list[str] = []
    try:
        from triton import knobs
    except ImportError:  # CPU-only installs, or a Triton without knobs
        yield names
        return
    previous = knobs.runtime.jit_cache_hook

    def record(*args, **kwargs):
        names.append(str(kwargs.get("repr", "?")).split("[", 1)[0])
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_cache_hook = record
    try:
        yield names
    finally:
        knobs.runtime.jit_cache_hook = previous


@contextlib.contextmanager
def eos_ignored(model):
    """transformers' `generate` on `model` with no end-of-sequence token while the block runs: random weights end
    requests at random, and the workloads fix every request's length (cbq's `ignore_eos`). generate falls back
    to the (text) config's and the generation_config's eos for one the call leaves unset, so both are cleared,
    then restored."""
    config = model.config.get_text_config()  # a vision-language model's language model names its eos
    saved = config.eos_token_id, model.generation_config.eos_token_id
    config.eos_token_id = model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        config.eos_token_id, model.generation_config.eos_token_id = saved


def compared_choice(flag: str, dest: str, choices: tuple[str, ...], help: str):
    """A setting the run may repeat to compare its values in one process (default "auto"): the values come back as a
    tuple, each run labelled with its own."""
    return click.option(
        flag, dest, type=click.Choice(choices), multiple=True, default=("auto",), show_default=True, help=help
    )


def command_line(ctx: click.Context) -> str:
    """The command that reproduces this run: every option with the value it ran with, defaults included."""
    words = ["cbq bench", ctx.command.name or "?"]
    for param in ctx.command.params:
        value = ctx.params[param.name]
        if value is None:
            continue
        # a repeatable option once per value (--decoder hf --decoder owned); a tuple-valued one with its values
        for one in value if getattr(param, "multiple", False) else [value]:
            words += [param.opts[0], *(map(str, one) if isinstance(one, tuple | list) else [str(one)])]
    return " ".join(words)


def run_header() -> dict[str, Any]:
    """What every benchmark's JSON opens with: the command that ran it, the host, GPU, torch and date. (No commit:
    the device's copy of the tree carries the git metadata of an earlier checkout, so benchmarks/ READMEs name the
    commit each run measured.)"""
    import platform
    import time

    import torch

    return {
        "command": command_line(click.get_current_context()),
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
