"""longrope (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): each request's greedy output equals Phi-3's `generate` for
that request alone, in any batch (fp32, CPU): prompts below and above the original context, requests that cross it
while decoding, sync and async, chunked prefill, preemption, prefix cache on and off. Also: the scheduler's restart
at the crossing and the prefix cache's separate names for long blocks, the batch builder's rotary rows, the decoders'
choice, and (Triton interpreter; CUDA with `gpu`) the Triton path against the torch path on long rows.

The reference. transformers' rotary takes the long factors when a forward's largest position + 1 exceeds
original_max_position_embeddings (`dynamic_rope_update`; its attention_scaling is the same for both tables), and
Phi-3's `prepare_inputs_for_generation` drops the cache at the step that makes the sequence longer than that, so one
forward recomputes the whole sequence with the long factors. In transformers 5.24 that forward gets the whole
sequence; in 5.17 it gets only the newest token (an empty cache, the context lost). `longrope_greedy` runs the
forwards 5.24 runs on either version: `generate` up to the crossing, then `generate` again from the whole sequence,
whose prefill is the recomputing forward; `test_the_reference_is_generate` checks it equals one `generate` here."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import transformers
from packaging.version import Version

from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.batch import BatchBuilder
from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.decoder import OwnedDecoder, build_decoder, longrope_tables, rotary_tables
from worker.engine.describe import describe_step
from worker.engine.engine import Engine
from worker.engine.families.spec import longrope_original_len
from worker.engine.kernels import fused as fk
from worker.engine.models import ModelLoadError, load_model, preset_config
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence
from worker.engine.tokenizer import ByteTokenizer

from .conftest import generate_with_late_arrivals, hf_greedy

CPU = torch.device("cpu")
PRESET = "tiny-phi3-longrope"
ORIGINAL = 64  # the preset's original_max_position_embeddings
BLOCK = 16  # EngineConfig's default block size


@pytest.fixture(scope="module")
def phi3_longrope():
    return load_model(PRESET, CPU, torch.float32)


def crossing_step(req: EngineRequest, original: int) -> int | None:
    """How many tokens `generate` has produced when it runs the forward that crosses `original` (None: none does).
    After k tokens the next forward's sequence is len(prompt) + k long; the prompt's own forward (k = 0) picks its
    table once, so only a prompt at most `original` long can cross, at k = original + 1 - len(prompt)."""
    k = original + 1 - len(req.prompt_ids)
    return k if 1 <= k < req.sampling.max_new_tokens else None


def longrope_greedy(model, tok, req: EngineRequest) -> list[int]:
    """Phi-3's greedy `generate` for `req` alone, as transformers 5.24 computes it (see the module docstring)."""
    k = crossing_step(req, longrope_original_len(model.config))
    if k is None:
        return hf_greedy(model, tok, req)
    first = hf_greedy(model, tok, _replace(req, max_new_tokens=k))
    if len(first) < k or tok.eos_token_id in first:
        return first
    rest = _replace(req, req.sampling.max_new_tokens - k, prompt_ids=req.prompt_ids + first)
    return first + hf_greedy(model, tok, rest)


def _replace(req: EngineRequest, max_new_tokens: int, prompt_ids: list[int] | None = None) -> EngineRequest:
    return EngineRequest(req.request_id, prompt_ids or req.prompt_ids, SamplingParams(max_new_tokens=max_new_tokens))


def longrope_requests(tok, seed: int = 0) -> list[EngineRequest]:
    """Prompts on both sides of the original context (64), requests that cross it while decoding (one of them at its
    first decode, one deep into it), and prompts sharing a 48-token prefix (3 blocks) on both sides: without separate
    names a long prompt would read the short blocks of that prefix, and a crossing one may reuse the long ones."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    shared = [tok.bos_token_id] + tokens(47)
    specs = [
        (shared + tokens(5), 40),  # 53 tokens: short prefill, crosses at its 12th token
        (shared + tokens(30), 20),  # 78: long from its first chunk, the shared prefix's blocks long
        (shared + tokens(16), 3),  # 64 = the original context: short prefill, crosses at its first decode
        (shared + tokens(16), 1),  # 64, one token: never crosses
        (shared + tokens(17), 10),  # 65: long from the start
        ([tok.bos_token_id] + tokens(9), 8),  # short throughout
        ([tok.bos_token_id] + tokens(19), 70),  # crosses deep into its decode
        ([tok.bos_token_id] + tokens(62), 2),  # 63: crosses at its second decode
        ([tok.bos_token_id] + tokens(149), 16),  # long
        ([tok.bos_token_id] + tokens(99), 30),  # long
    ]
    specs.append(specs[0])  # the same crossing request twice: its recompute may hit the other's long blocks
    specs.append((specs[1][0][:70], 12))  # a long prompt under the long one's blocks
    return [EngineRequest(f"l{i}", ids, SamplingParams(max_new_tokens=n)) for i, (ids, n) in enumerate(specs)]


_REFERENCE: dict[str, tuple[list[EngineRequest], dict[str, list[int]]]] = {}


def references(model, tok):
    if "ref" not in _REFERENCE:
        reqs = longrope_requests(tok)
        _REFERENCE["ref"] = (reqs, {r.request_id: longrope_greedy(model, tok, r) for r in reqs})
    return _REFERENCE["ref"]


def test_the_preset_is_shaped_like_the_releases(phi3_longrope):
    model, _ = phi3_longrope
    config = model.config
    assert longrope_original_len(config) == ORIGINAL < config.max_position_embeddings
    params = config.rope_parameters
    rotary_dim = int(config.head_dim * params["partial_rotary_factor"])
    assert params["partial_rotary_factor"] == 0.75 and len(params["short_factor"]) == rotary_dim // 2
    assert len(params["long_factor"]) == rotary_dim // 2 and params["long_factor"] != params["short_factor"]


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason="transformers 5.17's Phi-3 generate feeds only the newest token at the longrope switch (context lost)",
)
def test_the_reference_is_generate(phi3_longrope):
    """One `generate` per crossing request equals `longrope_greedy`: the switch recomputes the whole sequence."""
    model, tok = phi3_longrope
    reqs, ref = references(model, tok)
    crossing = [r for r in reqs if crossing_step(r, ORIGINAL) is not None]
    assert len(crossing) >= 4
    for req in crossing:
        assert hf_greedy(model, tok, req) == ref[req.request_id], req.request_id
    # and the switch matters: the request computed with short K for its early tokens differs
    assert any(_without_recompute(model, tok, r) != ref[r.request_id] for r in crossing)


def _without_recompute(model, tok, req: EngineRequest) -> list[int]:
    """Greedy with the cache kept at the switch (early tokens' K short, later ones long): what cbq must not do."""
    ids = torch.tensor([req.prompt_ids])
    out: list[int] = []
    cache = None
    with torch.inference_mode():
        step_ids, position = ids, 0
        for _ in range(req.sampling.max_new_tokens):
            positions = torch.arange(position, position + step_ids.shape[1])[None]
            result = model.model(step_ids, position_ids=positions, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            token = int(model.lm_head(result.last_hidden_state[:, -1]).argmax())
            out.append(token)
            if token == tok.eos_token_id:
                break
            position += step_ids.shape[1]
            step_ids = torch.tensor([[token]])
    return out


SCENARIOS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=40),  # not a multiple of the block: chunks end inside blocks
    "preemption": dict(num_kv_blocks=24, max_num_batched_tokens=72),
}


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_equals_generate_alone(phi3_longrope, scenario, mode, caching):
    model, tok = phi3_longrope
    reqs, ref = references(model, tok)
    assert len({t for ids in ref.values() for t in ids}) >= 40, "random weights must give varied text"
    config = EngineConfig(mode=mode, decoder="auto", enable_prefix_caching=caching, **SCENARIOS[scenario])
    engine = Engine(model, tok, config)
    assert isinstance(engine.runner.decoder, OwnedDecoder), "auto: the owned decoder for longrope, on the CPU too"
    results = engine.generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert res.token_ids == ref[req.request_id], f"{req.request_id} (prompt {len(req.prompt_ids)} tokens)"
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
    if caching:
        assert engine.stats().prefix_cache_hits > 0
    engine.blocks.check_integrity([])
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parallel_samples_and_late_arrivals(phi3_longrope, mode):
    """n = 3 greedy samples of crossing and long prompts (the followers share their leader's prompt blocks, and may
    still wait while it crosses), half the requests added while the others run: every sample equals `generate`."""
    model, tok = phi3_longrope
    reqs, ref = references(model, tok)
    grouped = [dataclasses.replace(r, n=3) for r in reqs[:4]] + reqs[4:]
    config = EngineConfig(mode=mode, max_num_batched_tokens=40, num_kv_blocks=40, max_num_seqs=5)
    results = generate_with_late_arrivals(Engine(model, tok, config), grouped, 6)
    assert sorted(r.request_id for r in results) == sorted(r.request_id for r in reqs)
    for res in results:
        assert [s.token_ids for s in res.all_samples] == [ref[res.request_id]] * (3 if res.samples else 1)


def test_deterministic_mode(phi3_longrope):
    model, tok = phi3_longrope
    reqs, ref = references(model, tok)
    engine = Engine(model, tok, EngineConfig(mode="async", deterministic=True, max_num_batched_tokens=40))
    assert {r.request_id: r.token_ids for r in engine.generate(reqs)} == ref


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_prompt_logprobs_are_the_prompts_own_forward(phi3_longrope, mode):
    """A prompt's logprobs come from the table of its own forward (short up to 64 tokens, long past it), also for a
    request recomputed long once it crosses (its prompt's entries are recorded once, from the short forward)."""
    from .test_prompt_logprobs import check_prompt_logprobs, prompt

    model, tok = phi3_longrope
    reqs = [
        EngineRequest("crossing", prompt(1, 40, tok.bos_token_id), SamplingParams(40, prompt_logprobs=2)),
        EngineRequest("long", prompt(2, 90, tok.bos_token_id), SamplingParams(3, prompt_logprobs=2)),
    ]
    engine = Engine(model, tok, EngineConfig(mode=mode, max_num_batched_tokens=16))
    results = engine.generate(reqs)
    for req, result in zip(reqs, results, strict=True):
        check_prompt_logprobs(model, req, result)
        assert result.token_ids == longrope_greedy(model, tok, req), req.request_id


# -- the scheduler and the prefix cache -------------------------------------------------------------------------


def _seq(request_id: str, prompt: list[int], max_new: int = 32) -> Sequence:
    params = SamplingParams(max_new_tokens=max_new).with_defaults({}, rest_of_context=200)  # as the engine admits it
    return Sequence(request_id, list(prompt), params, seed=0)


def _step(sched: Scheduler, token: int = 7):
    """One synchronous step: schedule, commit what it wrote, land its tokens."""
    plan = sched.schedule()
    sched.on_step_processed(plan)
    for chunk in plan.sampling_chunks():
        sched.on_token(chunk.seq)
        chunk.seq.output_ids.append(token)
    return plan


def test_a_sequence_growing_past_the_original_context_is_recomputed_with_the_long_table():
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, 64, 8, 200, long_rope_after=9)
    seq = _seq("a", list(range(1, 9)))  # 8 tokens: short
    sched.add(seq)
    _step(sched)  # the prompt's forward (8 long) -> 9 tokens
    plan = _step(sched)  # the forward of a 9-token sequence (position 8), still short -> 10 tokens
    assert [(c.start, c.num_tokens) for c in plan.chunks] == [(8, 1)] and not seq.long_rope
    short_blocks = list(seq.block_table)
    plan = _step(sched)  # a 10-token forward: the whole sequence again, with the long table
    assert [(c.start, c.num_tokens, c.samples) for c in plan.chunks] == [(0, 10, True)]
    assert seq.long_rope and seq.num_preemptions == 1 and sched.num_preemptions == 0, "a restart, not a preemption"
    assert blocks.match_prefix(_seq("short twin", list(range(1, 9)))) == short_blocks[:1]  # still cached, short
    plan = _step(sched)  # then it decodes as usual
    assert [(c.start, c.num_tokens) for c in plan.chunks] == [(10, 1)]
    plan = sched.schedule()
    step, _ = describe_step(plan, {seq: 0}, long_rope=True)  # which sequences read the long rows
    assert step.long_rope is not None and step.long_rope.tolist() == [True]
    assert describe_step(plan, {seq: 0})[0].long_rope is None  # a model without longrope: no flags


def test_long_blocks_are_named_apart_from_short_ones():
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, 64, 8, 200, long_rope_after=10)
    prefix = list(range(1, 9))  # two blocks
    short = _seq("short", prefix + [50])
    sched.add(short)
    _step(sched)
    long = _seq("long", prefix + list(range(60, 66)))  # 14 tokens: long
    sched.add(long)
    plan = _step(sched)
    assert long.long_rope and [(c.seq.request_id, c.start) for c in plan.chunks][-1] == ("long", 0), (
        "a long prompt must not read the short blocks of its prefix"
    )
    twin = _seq("long twin", prefix + list(range(70, 76)))
    sched.add(twin)
    plan = _step(sched)
    assert [(c.seq.request_id, c.start) for c in plan.chunks][-1] == ("long twin", 8), "long blocks are shared"
    short_twin = _seq("short twin", prefix + [51])
    sched.add(short_twin)
    plan = _step(sched)
    assert [(c.seq.request_id, c.start) for c in plan.chunks][-1] == ("short twin", 8), "so are short ones"
    blocks.check_integrity(sched.running)


def test_followers_do_not_share_a_crossed_leaders_long_blocks():
    blocks = BlockManager(64, 4, enable_prefix_caching=False)  # only the leader's blocks to share
    sched = Scheduler(blocks, 64, 1, 200, long_rope_after=10)  # one running sequence: the follower waits
    leader, follower = _seq("leader", list(range(1, 10)), 8), _seq("follower", list(range(1, 10)), 8)
    sched.add_group([leader, follower])
    _step(sched)  # the leader's prompt: the follower is released, but waits for room
    assert sched.waiting[0] is follower and sched._reusable_prefix(follower) == leader.block_table[:2]
    _step(sched)
    _step(sched)  # the leader passes 10 tokens: recomputed long
    assert leader.long_rope and sched.waiting[0] is follower and not follower.long_rope
    assert sched._reusable_prefix(follower) == [], "the follower's prompt rotates short: the leader's blocks are long"


# -- the batch builder's rotary rows ---------------------------------------------------------------------------


def test_long_sequences_read_the_long_rows_and_write_their_true_slots():
    blocks = BlockManager(64, 4)
    sched = Scheduler(blocks, 64, 8, 200, long_rope_after=10)
    short, long = _seq("short", list(range(1, 6))), _seq("long", list(range(1, 14)))
    sched.add(short)
    sched.add(long)
    plan = sched.schedule()
    builder = BatchBuilder(64, 8, 16, 4, CPU, long_rope_row_offset=10)
    builder.build(describe_step(plan, {}, long_rope=True)[0], 0)
    h = builder.slots[0].host
    assert h["positions"][:18].tolist() == list(range(5)) + [10 + p for p in range(13)]
    tables = [short.block_table, long.block_table]
    want_slots = [tables[b][p // 4] * 4 + p % 4 for b, n in ((0, 5), (1, 13)) for p in range(n)]
    assert h["slot_mapping"][:18].tolist() == want_slots
    # a short sequence past the original context would read a long row: refused
    bad = describe_step(plan, {}, long_rope=True)[0]
    bad.long_rope[:] = False
    with pytest.raises(AssertionError, match="short table"):
        builder.build(bad, 1)


# -- the decoders ----------------------------------------------------------------------------------------------


def test_the_tables_are_transformers_own(phi3_longrope):
    """Short rows equal the rotary's forward at short positions, long rows its forward once a position passes the
    original context, bit for bit; the two differ (so a wrong row would show)."""
    model, _ = phi3_longrope
    rotary = model.model.rotary_emb
    cos, sin = longrope_tables(rotary, 200, model.lm_head.weight, ORIGINAL)
    x = torch.zeros(1, dtype=torch.float32)
    short_cos, short_sin = rotary(x, torch.arange(ORIGINAL)[None])
    long_cos, long_sin = rotary(x, torch.arange(200)[None])  # largest position 199 >= 64: the long factors
    assert torch.equal(cos[:ORIGINAL], short_cos[0]) and torch.equal(sin[:ORIGINAL], short_sin[0])
    assert torch.equal(cos[ORIGINAL:], long_cos[0]) and torch.equal(sin[ORIGINAL:], long_sin[0])
    assert not torch.equal(cos[1:ORIGINAL], cos[ORIGINAL + 1 : 2 * ORIGINAL])
    # the rotary's inv_freq now holds the long factors (the last forward's): the tables still read the short ones
    assert torch.equal(longrope_tables(rotary, 200, model.lm_head.weight, ORIGINAL)[0], cos)
    assert not torch.equal(rotary_tables(rotary, ORIGINAL, model.lm_head.weight)[0], cos[:ORIGINAL])


def test_decoder_hf_is_refused_and_auto_takes_the_owned_one(phi3_longrope):
    model, _ = phi3_longrope
    with pytest.raises(ValueError, match="decoder 'hf' cannot run longrope") as info:
        build_decoder(model, "hf", CPU, 256, False)
    assert "\n" not in str(info.value)
    assert isinstance(build_decoder(model, "auto", CPU, 256, False), OwnedDecoder)


@pytest.mark.parametrize(
    ("preset", "changes", "message"),
    [
        ("tiny-llama", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                             "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}),
         "rope_type='longrope'"),  # its generate keeps the short K at the switch: not run
    ],
)  # fmt: skip
def test_longrope_is_refused_where_cbq_cannot_match_generate(tmp_path, preset, changes, message):
    config = preset_config(preset)
    for key, value in changes.items():
        setattr(config, key, value)
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(str(tmp_path), CPU, torch.float32)
    assert "\n" not in str(info.value)


def full_rotary_longrope(dev: torch.device, seed: int = 1):
    """Phi-3.5-mini's longrope (full rotary) with head_dim 64, so the QKV GEMM's rotary epilogue runs too."""
    from transformers import Phi3ForCausalLM

    config = preset_config(PRESET)
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim = 128, 2, 1, 64
    config.rope_parameters = dict(
        config.rope_parameters,
        partial_rotary_factor=1.0,
        short_factor=[1.0 + 0.01 * i for i in range(32)],
        long_factor=[1.0 + 1.5 * i for i in range(32)],
    )
    torch.manual_seed(seed)
    return Phi3ForCausalLM(config).to(dev).eval()


def check_longrope_decoders(device: str) -> None:
    """The owned decoder on its Triton paths (element-wise kernels; small-step GEMMs with rotary in the QKV
    epilogue; Triton attention) equals its torch path on a step mixing long rows (the first prompt) and short ones
    (the second), for full rotary (the Triton rotary kernels) and partial (its torch stage); long rows change it."""
    from tests.worker.engine.test_fused_kernels import mixed_step_three_ways

    dev = torch.device(device)
    partial = load_model(PRESET, dev, torch.float32)[0]
    for name, model in (("full rotary", full_rotary_longrope(dev)), ("partial", partial)):
        long_rows = [ORIGINAL + p for p in range(4)] + [0, 1, 2]
        outs = mixed_step_three_ways(model, dev, triton_attention=True, positions=long_rows)
        for variant, out in zip(("triton element-wise", "small-step path"), outs[1:], strict=True):
            err = (outs[0] - out).abs().max().item()
            assert err < 1e-4 * max(1.0, outs[0].abs().max().item()), (name, variant, err)
        short = mixed_step_three_ways(model, dev, triton_attention=True)
        assert (short[0][0] - outs[0][0]).abs().max() > 1e-3, f"{name}: the long rows must change the first prompt"
        assert torch.allclose(short[0][1], outs[0][1], atol=1e-5), f"{name}: and only it"


DECODERS = r"""
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
from tests.worker.engine.test_longrope import check_longrope_decoders

_patch_triton_interpreter()
check_longrope_decoders("cpu")
print("longrope decoders match")
"""


@pytest.mark.skipif(not fk.HAVE_TRITON, reason="needs triton")
def test_triton_path_matches_torch_path_on_long_rows_in_the_interpreter():
    from .test_family_kernels import _interpret

    _interpret(DECODERS, "longrope decoders match")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fk.HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_longrope_decoders():
    check_longrope_decoders("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and fk.HAVE_TRITON), reason="needs CUDA, triton")
@pytest.mark.parametrize("shape", ["partial", "full rotary"])
def test_gpu_owned_fp32_equals_generate_alone(shape):
    """On CUDA (Triton kernels, Triton attention, graphs) the fp32 greedy output equals Phi-3's `generate` per request
    (`longrope_greedy`: right on 5.17 too), sync and async, with chunked prefill and preemption."""
    from .test_engine_gpu import token_agreement

    dev = torch.device("cuda")
    if shape == "partial":
        model, tok = load_model(PRESET, dev, torch.float32)
    else:
        model, tok = full_rotary_longrope(dev), ByteTokenizer()  # the presets' tokenizer
    model.set_attn_implementation("eager")
    reqs = longrope_requests(tok, seed=3)
    ref = [longrope_greedy(model, tok, r) for r in reqs]
    for mode in ("sync", "async"):
        for scenario in ("chunked_prefill", "preemption"):
            config = EngineConfig(device="cuda", mode=mode, dtype="float32", decoder="owned", **SCENARIOS[scenario])
            engine = Engine(model, tok, config)
            assert engine.runner.decoder.use_triton and engine.runner.attn_backend.name == "triton"
            out = [r.token_ids for r in engine.generate(reqs)]
            del engine
            torch.cuda.empty_cache()
            agreement = token_agreement(out, ref)  # as the family GPU tests: a near-tie may flip one token in fp32
            assert agreement >= 0.99, f"{shape} {mode} {scenario}: {agreement:.4f} of tokens agree"
