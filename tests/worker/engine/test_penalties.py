"""OpenAI's presence and frequency penalties: the engine's greedy output equals `model.generate` with a
logits processor applying the same penalties over the generated tokens, token for token (fp32, CPU), in
sync and async mode (where the newest token is still on the device when the next step is sampled), with
preemption, through both decoders; and a seeded sample is the same in every mode and batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.sampler import apply_penalties

from .conftest import make_requests


class OpenAIPenalties:
    """The reference: a transformers logits processor, written from OpenAI's definition."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[0, self.prompt_len :]
        counts = torch.bincount(generated, minlength=scores.shape[-1]).float()[: scores.shape[-1]]
        return scores - (self.frequency * counts + self.presence * (counts > 0).float())[None]


def hf_penalised(model, req: EngineRequest) -> list[int]:
    from transformers import LogitsProcessorList

    ids = torch.tensor([req.prompt_ids])
    p = req.sampling
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=p.max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        logits_processor=LogitsProcessorList(
            [OpenAIPenalties(ids.shape[1], p.presence_penalty or 0.0, p.frequency_penalty or 0.0)]
        ),
    )
    return out[0, ids.shape[1] :].tolist()


def penalised_requests(tok, num: int) -> list[EngineRequest]:
    """Every third request without penalties (they share steps with penalised ones), the rest with a mix of
    presence and frequency penalties, positive and negative."""
    reqs = make_requests(tok, num, seed=21, max_prompt=120, max_new=40, ignore_eos=True)
    # Large: the tiny model's logits are far apart. Negative ones make it repeat its newest token, so a count
    # that missed the token still in flight (async), or counted it twice (sync), changes the output.
    weights = [(2.0, 0.0), (0.0, 2.0), (1.2, 1.5), (-2.0, 0.0), (0.0, -2.0), (-1.0, 2.0)]
    out = []
    for i, r in enumerate(reqs):
        presence, frequency = weights[i % len(weights)] if i % 3 else (0.0, 0.0)
        sampling = dataclasses.replace(r.sampling, presence_penalty=presence, frequency_penalty=frequency)
        out.append(dataclasses.replace(r, sampling=sampling))
    return out


@pytest.fixture(scope="module")
def llama_refs(tiny_models):
    model, tok = tiny_models("tiny-llama")
    reqs = penalised_requests(tok, 18)
    refs = {r.request_id: hf_penalised(model, r) for r in reqs}
    plain = {r.request_id: hf_penalised(model, dataclasses.replace(r, sampling=SamplingParams(
        max_new_tokens=r.sampling.max_new_tokens, ignore_eos=True))) for r in reqs}
    # the penalties must change what greedy decoding picks, or equality would prove nothing
    changed = [rid for rid in refs if refs[rid] != plain[rid]]
    assert len(changed) >= 6, f"penalties changed only {len(changed)} of {len(refs)} outputs"
    return model, tok, reqs, refs


@pytest.mark.parametrize("decoder", ["hf", "owned"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scenario", [{}, {"num_kv_blocks": 24, "max_num_batched_tokens": 64}])
def test_penalised_greedy_equals_generate_with_the_same_penalties(llama_refs, decoder, mode, scenario):
    model, tok, reqs, refs = llama_refs
    engine = Engine(model, tok, EngineConfig(mode=mode, decoder=decoder, **scenario))
    got = {r.request_id: r.token_ids for r in engine.generate(reqs)}
    assert got == refs
    if scenario:
        assert engine.scheduler.num_preemptions > 0, "the tight cache was meant to force preemptions"


def test_seeded_penalised_samples_do_not_depend_on_mode_or_batch(tiny_models):
    model, tok = tiny_models("tiny-llama")
    reqs = [
        dataclasses.replace(
            r, sampling=dataclasses.replace(r.sampling, temperature=0.9, seed=i, presence_penalty=0.8, frequency_penalty=0.5)
        )
        for i, r in enumerate(penalised_requests(tok, 8))
    ]
    runs = [
        [r.token_ids for r in Engine(model, tok, EngineConfig(mode=m)).generate(reqs)] for m in ("sync", "async")
    ]
    alone = [Engine(model, tok, EngineConfig(mode="async")).generate([r])[0].token_ids for r in reqs[:3]]
    assert runs[0] == runs[1] and runs[0][:3] == alone


def test_apply_penalties_counts_generated_tokens_once_per_appearance():
    logits = torch.zeros(3, 6)
    history = torch.tensor([[2, 2, 5, -1], [-1, -1, -1, -1], [0, 1, 1, 1]])
    apply_penalties(logits, torch.tensor([0, 1, 2]), history, torch.tensor([0.5, 0.5, 0.0]), torch.tensor([1.0, 1.0, 0.25]))
    assert logits[0].tolist() == [0, 0, -2.5, 0, 0, -1.5]
    assert logits[1].tolist() == [0] * 6
    assert logits[2].tolist() == [-0.25, -0.75, 0, 0, 0, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_penalties_on_gpu_through_decode_graphs(mode):
    """fp32 on CUDA: decode steps replay graphs whose in-graph argmax must not be used for penalised rows."""
    from worker.engine.models import load_model

    model, tok = load_model("small-llama", torch.device("cuda"), torch.float32)
    reqs = penalised_requests(tok, 12)
    refs = {r.request_id: hf_penalised(model, r) for r in reqs}
    engine = Engine(model, tok, EngineConfig(device="cuda", mode=mode, dtype="float32"))
    got = {r.request_id: r.token_ids for r in engine.generate(reqs)}
    agree = sum(a == b for rid in refs for a, b in zip(got[rid], refs[rid], strict=True))
    assert agree / sum(len(v) for v in refs.values()) >= 0.99
    assert engine.runner.graphs


def test_penalties_with_a_grammar_the_same_in_sync_and_async(tiny_models):
    """A constrained row samples in a second launch, after its mask is computed: its penalties must still
    count the token in flight then. Greedy, so sync (nothing in flight) and async must agree exactly."""
    import re

    from worker.engine.api import Constraint, ConstraintKind

    model, tok = tiny_models("tiny-llama")
    pattern = "[a-z]{8,30}( [a-z]{2,12}){0,4}"
    reqs = []
    for i, (presence, frequency) in enumerate([(0.0, 0.0), (2.0, 0.0), (0.0, -2.0), (1.0, 2.0)] * 3):
        params = SamplingParams(
            max_new_tokens=40,
            constraint=Constraint(ConstraintKind.REGEX, pattern),
            presence_penalty=presence,
            frequency_penalty=frequency,
        )
        reqs.append(EngineRequest(f"c{i}", tok.encode(f"write {i // 4} words:"), params))
    outs = {
        mode: {r.request_id: r for r in Engine(model, tok, EngineConfig(mode=mode)).generate(reqs)}
        for mode in ("sync", "async")
    }
    assert {k: r.token_ids for k, r in outs["sync"].items()} == {k: r.token_ids for k, r in outs["async"].items()}
    for r in outs["async"].values():
        assert re.fullmatch(pattern, r.text) or r.finish_reason.value == "length", r.text
    # the same prompt with and without penalties: they changed something under the grammar
    changed = sum(outs["sync"][f"c{i}"].token_ids != outs["sync"][f"c{i - i % 4}"].token_ids for i in range(12))
    assert changed >= 4
