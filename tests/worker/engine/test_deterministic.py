"""Deterministic mode through the whole engine (bf16): the same requests give the same tokens alone, in a full
batch, among other traffic arriving while they run, with another token budget (chunked prefill), with a cache
small enough to preempt, sync or async, prefix cache on or off. CPU here (row_linear and the row-by-row torch
attention, deterministic.py); `test_deterministic_gpu.py` runs `compare_scenarios` on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

from .conftest import generate_with_late_arrivals


def requests(
    vocab: int, seed: int, num: int, prefix: str, max_suffix: int = 33, max_new: int = 12
) -> list[EngineRequest]:
    """Prompts of 1 to 37 + max_suffix tokens, half of them behind one shared 37-token prefix (cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(37)]
    reqs = []
    for i in range(num):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, max_suffix))]
        if i % 2:
            ids = shared + ids
        params = SamplingParams(max_new_tokens=rng.randint(1, max_new))
        reqs.append(EngineRequest(f"{prefix}{i}", ids, params))
    return reqs


def scenarios(preempt_blocks: int) -> dict[str, tuple[dict, bool, bool]]:
    """name -> (EngineConfig fields, other traffic?, late arrivals?); `preempt_blocks`: a KV cache that preempts."""
    return {
        "full batch": ({}, False, False),
        "other traffic, budget 40": (dict(max_num_batched_tokens=40), True, False),
        "late arrivals, budget 23, cache off": (
            dict(max_num_batched_tokens=23, enable_prefix_caching=False),
            True,
            True,
        ),
        "preemption": (dict(num_kv_blocks=preempt_blocks, max_num_batched_tokens=64), True, False),
    }


SCENARIOS = scenarios(12)


def compare_scenarios(
    model, tok, mode: str, deterministic: bool, num: int = 8, max_suffix: int = 33, max_new: int = 12,
    preempt_blocks: int = 12, **config,
) -> tuple[dict[str, float], dict]:  # fmt: skip
    """Each scenario's agreement with `num` targets run alone, one at a time (fraction of requests whose tokens
    are identical), and the tokens alone; `config` adds EngineConfig fields to every engine (device, graphs)."""
    vocab = min(model.config.vocab_size, 256)
    targets = requests(vocab, 0, num, "t", max_suffix, max_new)
    others = requests(vocab, 1, num, "o", max_suffix, max_new)
    alone_engine = Engine(model, tok, EngineConfig(mode="sync", deterministic=deterministic, **config))
    alone = {r.request_id: alone_engine.generate([r])[0].token_ids for r in targets}
    del alone_engine
    agreement = {}
    for name, (fields, with_others, late) in scenarios(preempt_blocks).items():
        engine = Engine(model, tok, EngineConfig(mode=mode, deterministic=deterministic, **{**config, **fields}))
        reqs = targets + others if with_others else targets
        if with_others:
            random.Random(name).shuffle(reqs)
        results = generate_with_late_arrivals(engine, reqs, 4) if late else engine.generate(reqs)
        got = {r.request_id: r.token_ids for r in results if r.request_id in alone}
        agreement[name] = sum(got[k] == v for k, v in alone.items()) / len(alone)
        if name == "preemption":
            assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
        del engine
    return agreement, alone


@pytest.fixture(autouse=True)
def one_thread():
    """Deterministic mode's CPU ops run one row at a time: on a loaded machine torch's thread pool made each of
    them cost ~15 ms instead of ~50 us."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def bf16_llama():
    return load_model("tiny-llama", torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_deterministic_tokens_do_not_depend_on_the_batch(bf16_llama, mode):
    model, tok = bf16_llama
    agreement, _ = compare_scenarios(model, tok, mode, deterministic=True)
    assert agreement == dict.fromkeys(SCENARIOS, 1.0), agreement


def test_deterministic_mode_needs_the_owned_decoder(bf16_llama):
    model, tok = bf16_llama
    with pytest.raises(ValueError, match="owned decoder"):
        Engine(model, tok, EngineConfig(deterministic=True, decoder="hf"))
    engine = Engine(model, tok, EngineConfig(deterministic=True))
    assert engine.runner.decoder is not None and engine.runner.attn_backend.name == "torch-rows"
    default = Engine(model, tok, EngineConfig())
    assert default.runner.decoder is None and default.runner.attn_backend.name == "torch", (
        "default path unchanged"
    )


def test_what_deterministic_mode_refuses_on_cuda():
    """On CUDA: sliding-window layers and the torch attention backend (`--attention-backend torch`) have no batch-
    invariant kernel yet, so the engine refuses to start rather than promise what it cannot keep."""
    from worker.engine import deterministic
    from worker.engine.attention_backend import AttentionBackend, TritonAttentionBackend

    triton = TritonAttentionBackend.__new__(TritonAttentionBackend)  # no kernels needed to ask
    assert deterministic.unsupported_reason(True, (), triton) is None
    assert "sliding-window" in (deterministic.unsupported_reason(True, (0, 4096), triton) or "")
    assert "torch attention backend" in (deterministic.unsupported_reason(True, (), AttentionBackend()) or "")
    assert deterministic.unsupported_reason(False, (0, 4096), AttentionBackend()) is None, "CPU: row by row"
