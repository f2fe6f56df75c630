"""Latent attention's prefill over expanded K/V (worker/engine/latent_prefill.py): on a mixed step (decodes, a chunk on
a cached prefix, a whole prompt) the expanded rows equal the absorbed ones to fp32 rounding, with a bf16-shaped and
an FP8 cache; the choice follows the multiply-adds (171 rows at DeepSeek's widths), the memory bound and
`CBQ_MLA_PREFILL`; and the engine with the expanded path forced equals `generate` on both DeepSeek fixtures, both
decoders, with chunked prefill, the prefix cache and preemption, on the torch path and (in Triton's interpreter) on the
kernels: the paged prefill kernel over the expanded heads, the latent decode kernel for a mixed step's decodes."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.deepseek_checkpoints import build_deepseek_checkpoint
from worker.engine import latent_attention, latent_prefill
from worker.engine.attention_backend import AttentionBackend, AttentionMetadata
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.latent_attention import attend_latent
from worker.engine.latent_prefill import MLA_PREFILL_ENV, LatentWidths, expands
from worker.engine.models import load_model
from worker.engine.quant.fp8 import FP8_DTYPE

from .conftest import hf_greedy, make_requests
from .test_fused_kernels import _interpret, needs_triton

BLOCK = 4
WIDTHS = LatentWidths(heads=3, nope=8, rope=4, v=6, kv_lora=16)
# (q_len, context_len) per sequence: two decodes, a 5-row chunk on a 7-token cached prefix, a 10-token prompt
SEQS = [(1, 9), (1, 17), (5, 12), (10, 10)]


def _mixed_step(cache_dtype: torch.dtype, cache_scale: float, seed: int = 0):
    """A latent cache holding every sequence's earlier tokens, the step's inputs and its metadata."""
    gen = torch.Generator().manual_seed(seed)
    w = WIDTHS
    tables, next_block = [], 1  # block 0 stays unused, as the engine's null block
    for _, context in SEQS:
        count = -(-context // BLOCK)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cache = torch.zeros(next_block, BLOCK, 1, w.kv_lora + w.rope)
    for (q_len, context), table in zip(SEQS, tables, strict=True):
        for pos in range(context - q_len):  # the cached prefix
            cache[table[pos // BLOCK], pos % BLOCK, 0] = torch.randn(w.kv_lora + w.rope, generator=gen)
    if cache_dtype == FP8_DTYPE:
        cache = (cache / cache_scale).to(FP8_DTYPE)
    slots = [table[pos // BLOCK] * BLOCK + pos % BLOCK for (q, c), table in zip(SEQS, tables, strict=True) for pos in range(c - q, c)]
    cu = torch.tensor([0] + [sum(q for q, _ in SEQS[: i + 1]) for i in range(len(SEQS))], dtype=torch.int32)
    num_decode = sum(1 for q, _ in SEQS[:2] if q == 1)
    meta = AttentionMetadata(
        kv_caches=[(cache, cache)],
        slot_mapping=torch.tensor(slots, dtype=torch.int32),
        block_tables=block_tables,
        cu_seqlens_q=cu,
        context_lens=torch.tensor([c for _, c in SEQS], dtype=torch.int32),
        max_query_len=max(q for q, _ in SEQS),
        max_context_len=max(c for _, c in SEQS),
        is_decode_only=False,
        backend=AttentionBackend(),
        num_decode_seqs=num_decode,
        kv_scales=((cache_scale, cache_scale),),
        prefill_lens=tuple(SEQS[num_decode:]),
    )
    tokens = int(cu[-1])
    inputs = dict(
        q_nope=torch.randn(tokens, w.heads, w.nope, generator=gen),
        q_rope=torch.randn(tokens, w.heads, w.rope, generator=gen),
        latent=torch.randn(tokens, w.kv_lora, generator=gen),
        k_rope=torch.randn(tokens, w.rope, generator=gen),
        kv_b=0.3 * torch.randn(w.heads, w.nope + w.v, w.kv_lora, generator=gen),
    )
    return meta, inputs


def _attend(meta: AttentionMetadata, inputs: dict) -> torch.Tensor:
    return attend_latent(
        inputs["q_nope"], inputs["q_rope"], inputs["latent"], inputs["k_rope"], meta, 0, inputs["kv_b"], WIDTHS.v,
        scale=0.25,
    )  # fmt: skip


@pytest.mark.parametrize(("cache_dtype", "cache_scale"), [(torch.float32, 1.0), (FP8_DTYPE, 0.05)])
def test_expanded_prefill_equals_absorbed_attention_on_a_mixed_step(monkeypatch, cache_dtype, cache_scale):
    calls = []
    expanded_prefill = latent_attention.expanded_prefill
    monkeypatch.setattr(latent_attention, "expanded_prefill", lambda *a, **k: calls.append(1) or expanded_prefill(*a, **k))
    results = {}
    for choice in ("absorbed", "expanded"):
        monkeypatch.setenv(MLA_PREFILL_ENV, choice)
        meta, inputs = _mixed_step(cache_dtype, cache_scale)
        results[choice] = _attend(meta, inputs)
        if choice == "expanded":  # the plan and the choice are made once a step and kept for its other layers
            assert set(meta.step_cache) == {"latent_prefill_plan", "latent_prefill_expands"}
    assert len(calls) == 1
    assert results["expanded"].shape == (sum(q for q, _ in SEQS), WIDTHS.heads, WIDTHS.v)
    torch.testing.assert_close(results["expanded"], results["absorbed"], rtol=1e-5, atol=1e-5)
    assert results["absorbed"][2:].abs().mean() > 0.1  # the prefill rows hold values, not zeros


def test_the_choice_follows_the_multiply_adds_the_memory_bound_and_the_variable(monkeypatch):
    deepseek = LatentWidths(heads=16, nope=128, rope=64, v=128, kv_lora=512)
    assert (deepseek.absorbed_macs(), deepseek.expanded_macs(), deepseek.expansion_macs()) == (1088, 320, 131072)

    def step(*lens):
        meta, _ = _mixed_step(torch.float32, 1.0)
        meta.prefill_lens = tuple(lens)
        return meta

    monkeypatch.delenv(MLA_PREFILL_ENV, raising=False)  # "auto"
    assert not expands(step((170, 170)), deepseek, 16)  # 170 x 768 < 131,072: the expansion costs more
    assert expands(step((171, 171)), deepseek, 16)
    assert expands(step((8, 400), (400, 400)), deepseek, 16)  # summed over the step's prefill sequences
    assert not expands(step(), deepseek, 16)  # a decode-only step (or no host lengths)
    too_long = latent_prefill.EXPANDED_ELEMENTS // (deepseek.heads * 2 * (deepseek.nope + deepseek.rope)) + 16
    assert not expands(step((4096, too_long)), deepseek, 16)  # past the memory bound: absorbed
    monkeypatch.setenv(MLA_PREFILL_ENV, "expanded")
    assert expands(step((2, 30)), deepseek, 16) and not expands(step((4096, too_long)), deepseek, 16)
    monkeypatch.setenv(MLA_PREFILL_ENV, "absorbed")
    assert not expands(step((4096, 4096)), deepseek, 16)
    monkeypatch.setenv(MLA_PREFILL_ENV, "fast")
    with pytest.raises(ValueError, match="CBQ_MLA_PREFILL='fast': expected one of auto, absorbed, expanded"):
        expands(step((171, 171)), deepseek, 16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: build_deepseek_checkpoint(tmp_path_factory.mktemp(name), name).path for name in ("v2-lite", "v3")}


@pytest.mark.parametrize(
    ("name", "decoder", "mode"), [("v2-lite", "auto", "sync"), ("v2-lite", "owned", "async"), ("v3", "owned", "sync")]
)
def test_the_engine_with_expanded_prefill_equals_generate(checkpoints, monkeypatch, name, decoder, mode):
    """Chunks of 24 tokens over prompts of up to 60 (so chunks on cached context), a shared prefix, and a cache small
    enough to preempt: every prefill row after the first step's attends over expanded K/V."""
    model, tok = load_model(str(checkpoints[name]), torch.device("cpu"), torch.float32)
    reqs = make_requests(tok, 8, seed=11, max_prompt=60, max_new=12)
    reqs[1].prompt_ids = reqs[0].prompt_ids[:30] + reqs[1].prompt_ids[:10]  # a prefix the cache shares
    ref = [hf_greedy(model, tok, r) for r in reqs]
    calls = []
    expanded_prefill = latent_attention.expanded_prefill
    monkeypatch.setattr(latent_attention, "expanded_prefill", lambda *a, **k: calls.append(1) or expanded_prefill(*a, **k))
    monkeypatch.setenv(MLA_PREFILL_ENV, "expanded")
    config = EngineConfig(
        mode=mode, decoder=decoder, max_num_batched_tokens=24, num_kv_blocks=40, block_size=4, enable_prefix_caching=True
    )  # fmt: skip
    engine = Engine(model, tok, config)
    assert [r.token_ids for r in engine.generate(reqs)] == ref
    assert len(calls) > model.config.num_hidden_layers  # more than one step's layers
    assert engine.stats().num_preemptions > 0 and engine.stats().prefix_cache_hits > 0


# The owned decoder on the Triton kernels (the paged prefill kernel over the expanded heads, 12 + 8 wide; the latent
# decode kernel for the decodes of mixed steps) in the interpreter; a subprocess, since TRITON_INTERPRET must be set
# before triton loads.
EXPANDED_TRITON_CHECK = """
import os, pathlib, tempfile
import torch
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
_patch_triton_interpreter()
from tests.fixtures.deepseek_checkpoints import build_deepseek_checkpoint
from tests.worker.engine.conftest import hf_greedy, make_requests
from worker.engine import latent_attention
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

os.environ["CBQ_MLA_PREFILL"] = "expanded"
calls = []
expanded_prefill = latent_attention.expanded_prefill
latent_attention.expanded_prefill = lambda *a, **k: calls.append(1) or expanded_prefill(*a, **k)
path = build_deepseek_checkpoint(pathlib.Path(tempfile.mkdtemp()), "v2-lite").path
model, tok = load_model(str(path), torch.device("cpu"), torch.float32)
reqs = make_requests(tok, 4, seed=5, max_prompt=40, max_new=10)
ref = [hf_greedy(model, tok, r) for r in reqs]
engine = Engine(model, tok, EngineConfig(decoder="owned", attention_backend="triton", max_num_batched_tokens=24))
assert [r.token_ids for r in engine.generate(reqs)] == ref
assert calls, "no step took the expanded path"
print("expanded latent prefill on the triton kernels equals generate")
"""


@needs_triton
def test_expanded_prefill_on_the_triton_kernels_equals_generate_in_the_interpreter():
    _interpret(EXPANDED_TRITON_CHECK, "expanded latent prefill on the triton kernels equals generate")


def test_a_bad_choice_fails_when_the_engine_starts(checkpoints, monkeypatch):
    """`CBQ_MLA_PREFILL` is read in every prefill step: a bad value is refused when a latent-attention engine starts,
    on either decoder, rather than failing each request."""
    model, tok = load_model(str(checkpoints["v2-lite"]), torch.device("cpu"), torch.float32)
    monkeypatch.setenv(MLA_PREFILL_ENV, "fast")
    for decoder in ("auto", "owned"):
        with pytest.raises(ValueError, match="CBQ_MLA_PREFILL='fast': expected one of auto, absorbed, expanded"):
            Engine(model, tok, EngineConfig(decoder=decoder, num_kv_blocks=8))
