"""The engine at --tensor-parallel-size 2 over gloo on the CPU: greedy output equals `model.generate` (fp32)
token for token, for a Llama-3-shaped checkpoint (one KV head: replicated on both ranks), a Qwen3 one (two KV
heads: one per rank; tied embeddings), sync and async, a Qwen3-MoE one (experts split by intermediate size,
read from the release's per-expert tensors) and a GLM-4.5 one (grouped sigmoid routing with its correction
bias replicated, the shared expert split, layer 0 dense), with chunked prefill, preemption and the prefix cache; a killed
helper rank ends the run with a RankFailure. Each rank reads its shards from the checkpoint's sharded
safetensors files.

Each engine spawns one helper process (seconds on a loaded CPU): one engine per (checkpoint, mode), shared by
the module's tests.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from tests.fixtures.checkpoints import build_checkpoint
from worker.engine.api import Constraint, ConstraintKind, EngineRequest, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.engine_builder import build_engine
from worker.engine.models import ModelLoadError, load_model
from worker.engine.parallel.group import RankFailure
from worker.engine.ranks import build_sharded_engine

from .conftest import hf_generate, randomize_score_correction_bias

# Small steps and a small cache: prompts are computed in chunks, and sequences are preempted.
CONFIG = dict(max_num_batched_tokens=32, num_kv_blocks=16, max_num_seqs=8)
# Llama-3's layout with one KV head (at TP=2 both ranks hold it, and their own q heads of it) and biases on every
# linear (random, see `randomize_biases`: the row-parallel ones are added once, after the all-reduce).
SHAPES = {
    "llama3": dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    "qwen3": {},
    "qwen3_moe": {},
    "glm4_moe": {},
}
CASES = [
    ("llama3", "sync"),
    ("llama3", "async"),
    ("qwen3", "sync"),
    ("qwen3", "async"),
    ("qwen3_moe", "async"),
    ("glm4_moe", "async"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    built = {}
    for name, shape in SHAPES.items():
        path = tmp_path_factory.mktemp(name)
        checkpoint = build_checkpoint(path, name, shape=shape)
        model, tokenizer = load_model(str(path), torch.device("cpu"), torch.float32)
        # both run: zero biases (and GLM's zero correction bias) would hide one loaded on the wrong rank or not at all
        if randomize_biases(model) | bool(randomize_score_correction_bias(model)):
            model.save_pretrained(path, max_shard_size="60KB")
        requests = make_requests(checkpoint.token_ids.get(checkpoint.family.bos or ""))
        eos = sorted(tokenizer.eos_token_ids)
        reference = {r.request_id: hf_generate(model, r, eos, eos[0]) for r in requests}
        built[name] = (str(path), requests, reference)
    return built


def randomize_biases(model) -> bool:
    """transformers initialises biases to zero, which would hide a bias added on the wrong rank."""
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    with torch.no_grad():
        for bias in biases:
            bias.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(bias.numel()))
    return bool(biases)


def make_requests(bos: int | None, num: int = 10) -> list[EngineRequest]:
    """Prompts of 1 to 90 tokens, half of them behind one 40-token prefix (the prefix cache shares it)."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    requests = []
    for i in range(num):
        tail = [rng.randrange(3, 250) for _ in range(rng.randint(0, 50))]
        ids = ([bos] if bos is not None else []) + (shared + tail if i % 2 else tail or [5])
        params = SamplingParams(max_new_tokens=rng.randint(4, 12), temperature=0.0)
        requests.append(EngineRequest(f"r{i}", ids, params))
    return requests


_ENGINES: dict[tuple[str, str], Engine] = {}


@pytest.fixture(scope="module")
def sharded_engine(checkpoints):
    def get(name: str, mode: str) -> Engine:
        if (name, mode) not in _ENGINES:
            _ENGINES[name, mode] = build_engine(checkpoints[name][0], mode=mode, tensor_parallel_size=2, **CONFIG)
        return _ENGINES[name, mode]

    yield get
    for engine in _ENGINES.values():
        engine.close()
    _ENGINES.clear()


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_greedy_equals_generate_at_tp2(checkpoints, sharded_engine, name, mode):
    _, requests, reference = checkpoints[name]
    engine = sharded_engine(name, mode)
    assert engine.runner.replica is not None and engine.runner.replica.state.world_size == 2
    num_preemptions = engine.scheduler.num_preemptions
    results = engine.generate(requests)
    for request, result in zip(requests, results, strict=True):
        assert result.token_ids == reference[request.request_id], request.request_id
    assert engine.scheduler.num_preemptions > num_preemptions, "the small cache was meant to force preemption"
    assert engine.blocks.num_cache_hits > 0, "the shared prefix was meant to be reused"
    engine.blocks.check_integrity([])


def test_each_rank_holds_its_heads(checkpoints, sharded_engine):
    """Rank 0's shard: half the q heads, the MLP width and the vocabulary rows; the single KV head whole."""
    engine = sharded_engine("llama3", "sync")
    config = engine.model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (2, 1, 64)
    k_cache, _ = engine.runner.kv_caches[0]
    assert k_cache.shape[2] == 1, "each rank caches its own KV heads"
    embed = engine.model.get_input_embeddings().weight
    assert embed.shape[0] == config.vocab_size // 2


def test_moe_experts_are_split_by_intermediate_size(sharded_engine):
    engine = sharded_engine("qwen3_moe", "async")
    gate_up = engine.model.model.layers[0].mlp.experts.gate_up_proj
    assert tuple(gate_up.shape) == (16, 2 * 32 // 2, 64), "every expert, half of its columns"
    assert engine.runner.decoder.moe_layers[0] is not None


def test_glm4_moe_shards_its_experts_and_replicates_its_routing(checkpoints, sharded_engine):
    """GLM-4.5: every routed expert and the shared expert at half their columns, layer 0's dense MLP at half its
    width, the router and its correction bias (read from the checkpoint, not left at init's zeros) whole."""
    from safetensors import safe_open

    path = checkpoints["glm4_moe"][0]
    engine = sharded_engine("glm4_moe", "async")
    dense, sparse = engine.model.model.layers[0].mlp, engine.model.model.layers[1].mlp
    assert tuple(sparse.experts.gate_up_proj.shape) == (16, 32, 64)
    assert tuple(sparse.shared_experts.gate_proj.weight.shape) == (16, 64)
    assert tuple(dense.gate_proj.weight.shape) == (64, 64)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    with safe_open(str(Path(path) / index["weight_map"][name]), "pt") as f:
        stored = f.get_tensor(name)
    assert stored.abs().min() > 0 and torch.equal(sparse.gate.e_score_correction_bias, stored)
    assert engine.runner.decoder.moe_layers[1].score_correction_bias is sparse.gate.e_score_correction_bias


def test_sampling_logprobs_penalties_and_constraints_at_tp2_equal_tp1(checkpoints, sharded_engine):
    """Rank 0 samples from the gathered logits: seeded sampling, logprobs, penalties and a constraint (whose
    sampling waits for its mask while the helper waits for the samples) give what one process gives."""
    path, requests, _ = checkpoints["qwen3"]
    extras = [
        SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=11, logprobs=3),
        SamplingParams(max_new_tokens=8, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, constraint=Constraint(ConstraintKind.REGEX, "[ab]+c")),
    ]
    reqs = [EngineRequest(f"x{i}", r.prompt_ids, p) for i, (r, p) in enumerate(zip(requests[:9], extras * 3, strict=True))]
    one = build_sharded_engine(path, EngineConfig(mode="async", **CONFIG), world_size=1)
    expected = one.generate(reqs)
    one.close()
    got = sharded_engine("qwen3", "async").generate(reqs)
    for want, have in zip(expected, got, strict=True):
        assert have.finish_reason != "error", have.error
        assert have.token_ids == want.token_ids, have.request_id
        if have.request_id in ("x2", "x5", "x8"):  # the constrained ones
            assert re.fullmatch("[ab]+c", have.text), have.text
        if want.logprobs is not None:
            assert have.logprobs is not None
            for a, b in zip(want.logprobs, have.logprobs, strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_prompt_logprobs_at_tp2_equal_one_process(checkpoints, sharded_engine):
    """Scoring rows ride in every rank's step (StepDescription.prompt_rows): the vocab-parallel LM head gathers
    them on rank 0 like the sampled rows, so the prompt logprobs equal one process's (chunked prefill and the
    prefix cache included: half the prompts share a prefix)."""
    path, requests, _ = checkpoints["qwen3"]
    params = SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=2)
    reqs = [EngineRequest(f"p{i}", r.prompt_ids, params) for i, r in enumerate(requests[:6])]
    # and tokens from the top of the vocabulary, past a helper rank's half of the logits (a helper that scored
    # the prompt rows on its part indexed past it: a device-side assert on the H200, 2026-12-03)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    reqs.append(EngineRequest("top", [vocab - 1 - 7 * i for i in range(20)], params))
    one = Engine.from_model(path, mode="async", **CONFIG)
    expected = one.generate(reqs)
    got = sharded_engine("qwen3", "async").generate(reqs)
    for want, have in zip(expected, got, strict=True):
        assert have.finish_reason != "error", have.error
        assert want.prompt_logprobs is not None and have.prompt_logprobs is not None
        assert len(have.prompt_logprobs) == len(want.prompt_logprobs) == len(have.prompt_ids or [])
        for a, b in zip(want.prompt_logprobs[1:], have.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None
            assert a.token_id == b.token_id and a.rank == b.rank and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_fp8_kv_cache_at_tp2_equals_one_process(checkpoints):
    """--kv-cache-dtype fp8: each rank stores its own KV heads in e4m3 (the one KV head on both ranks here) with the
    same static per-layer scales as one process, so greedy tokens equal one process's fp8 run, which differ from
    the fp32 cache's (the check would not notice an fp32 cache otherwise); preemption and the prefix cache too."""
    path, requests, reference = checkpoints["llama3"]
    fp8 = dict(CONFIG, kv_cache_dtype="fp8")
    one = Engine.from_model(path, **fp8)
    expected = [r.token_ids for r in one.generate(requests)]
    assert expected != [reference[r.request_id] for r in requests], "e4m3 K/V were meant to change some tokens"
    engine = build_engine(path, mode="async", tensor_parallel_size=2, **fp8)
    try:
        assert engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        num_preemptions = engine.scheduler.num_preemptions
        assert [r.token_ids for r in engine.generate(requests)] == expected
        assert engine.scheduler.num_preemptions > num_preemptions and engine.blocks.num_cache_hits > 0
    finally:
        engine.close()


def test_tp1_through_the_sharded_path_equals_generate(checkpoints):
    """World size 1 runs the same sharded code in this process (no helper): what the GPU test runs on CUDA."""
    path, requests, reference = checkpoints["qwen3"]
    engine = build_sharded_engine(path, EngineConfig(mode="async", **CONFIG), world_size=1)
    assert engine.runner.decoder is not None and engine.runner.decoder.tp is not None
    results = engine.generate(requests)
    assert [r.token_ids for r in results] == [reference[r.request_id] for r in requests]
    engine.close()


@pytest.mark.parametrize(
    ("model", "overrides", "match"),
    [
        ("tiny-llama", {"decoder": "hf"}, "owned decoder"),
        # config only: no weights built (test_parallel_latent_attention.py runs it without --deterministic)
        ("deepseek-v2-lite", {"deterministic": True}, "multi-head latent attention runs no --deterministic yet"),
    ],
)
def test_what_is_not_sharded_yet_is_refused_before_any_rank_starts(model, overrides, match):
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match=f"tensor parallelism: .*{match}"):
        build_engine(model, **{"tensor_parallel_size": 2, **overrides})
    assert time.monotonic() - start < 5, "refused from the config, before spawning"


def test_killed_helper_ends_the_run_with_a_rank_failure():
    """While generating: the step raises it. While idle on the loop thread: the loop ends with it at once."""
    timeout_s = 20
    engine = build_sharded_engine("tiny-llama", EngineConfig(mode="async", num_kv_blocks=32, tensor_parallel_size=2), timeout_s=timeout_s)
    assert engine.runner.replica is not None and engine.runner.replica.group is not None
    (pid,) = engine.runner.replica.group.helper_pids
    request = EngineRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert len(engine.generate([request])[0].token_ids) == 4
    engine.start()  # idle on its thread, as a worker with an empty queue
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="engine loop has died") as died:
        while time.monotonic() - start < timeout_s:
            engine.get_results(timeout=0.5)
    assert isinstance(died.value.__cause__, RankFailure)
    assert f"rank 1 (pid {pid}) was killed by SIGKILL" in str(died.value.__cause__)
    assert time.monotonic() - start < timeout_s
    engine.shutdown()
    with pytest.raises(RankFailure, match="SIGKILL"):
        engine.generate([EngineRequest("b", [1, 2], SamplingParams(max_new_tokens=2))])
    engine.close()


def test_hung_helper_ends_the_step_within_the_collective_timeout():
    timeout_s = 3
    engine = build_sharded_engine(
        "tiny-llama", EngineConfig(mode="sync", num_kv_blocks=32, tensor_parallel_size=2), timeout_s=timeout_s
    )
    assert engine.runner.replica is not None and engine.runner.replica.group is not None
    (pid,) = engine.runner.replica.group.helper_pids
    os.kill(pid, signal.SIGSTOP)  # alive, but never answers
    start = time.monotonic()
    try:
        with pytest.raises(RankFailure, match="the tensor-parallel step failed on rank 0"):
            engine.generate([EngineRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=4))])
        assert timeout_s <= time.monotonic() - start < timeout_s + 15
    finally:
        engine.close()  # the failure killed the helper (SIGKILL ends a stopped process too)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
