"""Shared fixtures for engine tests: tiny random-weight models in fp32 on CPU and their greedy references."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.hopper_compile import recorder as hopper
from worker.engine.api import EngineRequest, EngineResult, SamplingParams
from worker.engine.models import load_model

# One tiny preset per family, each checked token for token against `model.generate` by the exactness tests
# (test_engine_exact.py, test_engine_prefix_cache.py) through both decoders.
TINY_FAMILIES = [
    "tiny-llama",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-qwen2",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-granite",
    "tiny-olmo2",
    "tiny-phi3",
    "tiny-smollm3",
    "tiny-cohere2",
    "tiny-glm4",
    "tiny-ministral",
]
# (preset, decoder) pairs the exactness tests run: every family through transformers' forward and the owned decoder.
FAMILY_DECODERS = [(n, d) for n in TINY_FAMILIES for d in ("hf", "owned")]
# The mixtures of experts, checked the same way with fewer, shorter requests (test_engine_exact_moe.py):
# transformers' expert loop makes their references and "hf" runs several times slower than a dense model's.
TINY_MOE_FAMILIES = [
    "tiny-qwen3-moe",
    "tiny-qwen2-moe",
    "tiny-mixtral",
    "tiny-gpt-oss",
    "tiny-glm4-moe",
    "tiny-glm4-moe-air",
]


def randomize_score_correction_bias(model, seed: int = 0) -> int:
    """Give every router's `e_score_correction_bias` (GLM-4.5's, DeepSeek-V3's: a buffer that random init leaves
    at zero) random values on the scale of the sigmoid scores, so that it changes which experts are chosen.
    Returns how many routers it set."""
    gen = torch.Generator().manual_seed(seed)
    routers = [m for m in model.modules() if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)]
    for router in routers:
        bias = router.e_score_correction_bias
        bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
    return len(routers)


def load_tiny(name: str):
    """A tiny preset in fp32 on the CPU, its correction biases (if any) set (`randomize_score_correction_bias`)."""
    model, tok = load_model(name, torch.device("cpu"), torch.float32)
    randomize_score_correction_bias(model)
    return model, tok


@pytest.fixture(scope="session")
def tiny_models():
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_tiny(name)
        return cache[name]

    return get


def make_requests(tokenizer, num: int, seed: int = 0, max_prompt: int = 400, max_new: int = 40, **sampling):
    """Mixed prompt lengths (1 .. max_prompt tokens) and mixed max_new_tokens."""
    rng = random.Random(seed)
    lengths = [1, 2, max_prompt] + [rng.randint(1, max_prompt) for _ in range(num - 3)]
    reqs = []
    for i, n in enumerate(lengths[:num]):
        ids = [tokenizer.bos_token_id] + [rng.randrange(256) for _ in range(n - 1)]
        params = SamplingParams(max_new_tokens=rng.randint(1, max_new), **sampling)
        reqs.append(EngineRequest(f"r{i}", ids, params))
    return reqs


def hf_greedy(model, tokenizer, req: EngineRequest) -> list[int]:
    """`model.generate` greedy output for one request, alone (no padding)."""
    return hf_generate(model, req, tokenizer.eos_token_id, tokenizer.pad_token_id)


def hf_generate(model, req: EngineRequest, eos=None, pad: int = 0, processors=(), **kwargs) -> list[int]:
    """`model.generate` greedy output for one request, alone, with extra logits `processors` and arguments."""
    from transformers import LogitsProcessorList

    ids = torch.tensor([req.prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=req.sampling.max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=pad,
        logits_processor=LogitsProcessorList(list(processors)),
        **kwargs,
    )
    return out[0, ids.shape[1] :].tolist()


def generate_with_late_arrivals(engine, reqs: list[EngineRequest], num_first: int) -> list[EngineResult]:
    """Run `reqs` on the engine's loop thread; all but the first `num_first` are added once generation
    is under way (after the first result)."""
    engine.start()
    try:
        for req in reqs[:num_first]:
            engine.add_request(req)
        results = engine.get_results(timeout=60)
        assert results and engine.num_unfinished() > 0
        for req in reqs[num_first:]:
            engine.add_request(req)
        while engine.num_unfinished() > 0:
            results += engine.get_results(timeout=60)
    finally:
        engine.shutdown()
    return results


# -- every interpreted kernel variant compiles for Hopper --------------------------------------------------------
_CALL_PASSED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_CALL_PASSED] = report.passed


@pytest.fixture(autouse=True)
def compile_launches_for_hopper(request, monkeypatch, tmp_path_factory):
    """For the interpreter tests `hopper.RECORDED` names: record each Triton launch their interpreter subprocesses
    run (they inherit the environment set here), then compile those kernel variants for sm90 with Triton's compiler
    and ptxas (no GPU), and check the test launched the kernels it must. Code the interpreter accepts but the
    compiler refuses fails here, on the CPU, in the run the test makes anyway (no second run of it)."""
    test = f"{request.node.path.name}::{request.node.originalname}"
    if test not in hopper.RECORDED or not hopper.have_hopper_compiler():
        yield
        return
    launches = tmp_path_factory.mktemp("launches") / "launches.jsonl"
    for name, value in hopper.recording_env(launches).items():
        monkeypatch.setenv(name, value)
    yield
    if not request.node.stash.get(_CALL_PASSED, False):
        return  # failed or skipped: its own report says why
    assert launches.exists(), f"{test}: no Triton launch was recorded"
    report = hopper.compile_recorded(launches)
    assert not report["failures"], json.dumps(report["failures"][:3], indent=1)
    missing = hopper.RECORDED[test] - set(report["kernels"])
    assert not missing, f"{test} launched none of {sorted(missing)}: renamed, or no longer run by it?"
    print(f"{report['compiled']} kernel variants of {report['kernels']} compiled for sm90")
