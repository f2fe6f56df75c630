"""vLLM's SamplingParams in the engine, each against a reference: the engine's greedy output equals
`model.generate` with transformers' own logits processor for the parameter (fp32, CPU), in sync and async
mode; min_p against `MinPLogitsWarper`; the detokenization options against the tokenizer; and
generation_config's repetition_penalty and min_p as defaults."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import generation_defaults, load_model
from worker.engine.sampler import apply_min_p, apply_penalties
from worker.engine.tokenizer import ByteTokenizer

from .conftest import hf_generate as conftest_generate
from .conftest import make_requests

MAX_NEW = 16


def hf_generate(model, req: EngineRequest, processors=(), eos=None, **kwargs) -> list[int]:
    return conftest_generate(model, req, eos, 0, processors, **kwargs)


class OnOutput:
    """A transformers processor that sees only the generated ids (vLLM's bad words look at the output only);
    a -1 stands before them so that processors never see an empty sequence."""

    def __init__(self, processor, prompt_len: int):
        self.processor, self.prompt_len = processor, prompt_len

    def __call__(self, input_ids, scores):
        generated = input_ids[:, self.prompt_len :]
        return self.processor(torch.cat([torch.full_like(input_ids[:, :1], -1), generated], dim=1), scores)


def _ascii_windows(ids: list[int], length: int) -> list[list[int]]:
    return [
        ids[i : i + length]
        for i in range(len(ids) - length + 1)
        if all(33 <= t < 127 for t in ids[i : i + length])
    ]


def with_sampling(req: EngineRequest, **fields) -> EngineRequest:
    return dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, **fields))


@pytest.fixture(scope="module")
def cases(tiny_models):
    """(request, reference output) pairs: one vLLM parameter each, chosen from the plain greedy output so that
    the parameter changes it (checked)."""
    from transformers import (
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    model, tok = tiny_models("tiny-llama")
    engine_eos = sorted(tok.eos_token_ids | {model.config.eos_token_id} - {None})
    base = make_requests(tok, 24, seed=7, max_prompt=60, max_new=MAX_NEW, ignore_eos=True)
    base = [with_sampling(r, max_new_tokens=MAX_NEW) for r in base]
    out = []
    for i, req in enumerate(base):
        plain = hf_generate(model, req)
        prompt_len = len(req.prompt_ids)
        kind = i % 6
        if kind == 0:
            r = with_sampling(req, repetition_penalty=1.8 if i % 12 else 0.6)
            ref = hf_generate(model, r, [RepetitionPenaltyLogitsProcessor(r.sampling.repetition_penalty)])
        elif kind == 1:
            bias = {plain[1]: -30.0, plain[4]: -5.0, 65: 7.5}
            r = with_sampling(req, logit_bias=bias)
            ref = hf_generate(model, r, [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})])
        elif kind == 2:
            stop = plain[0]  # the first greedy token: without min_tokens the output stops at once
            r = with_sampling(req, stop_token_ids=(stop,), min_tokens=6, ignore_eos=False)
            eos = [stop, *engine_eos]
            ref = hf_generate(model, r, [MinNewTokensLengthLogitsProcessor(prompt_len, 6, eos)], eos=eos)
        elif kind == 3:
            words = _ascii_windows(plain, 3)[:1] + _ascii_windows(plain, 2)[-1:] + _ascii_windows(plain, 1)[-1:]
            r = with_sampling(req, bad_words=tuple(bytes(w).decode() for w in words))
            ban = NoBadWordsLogitsProcessor(words, eos_token_id=None)
            ref = hf_generate(model, r, [OnOutput(ban, prompt_len)])
        elif kind == 4:
            allowed = sorted({*range(97, 110), plain[3], plain[5]})
            r = with_sampling(req, allowed_token_ids=tuple(allowed))
            ref = hf_generate(model, r, prefix_allowed_tokens_fn=lambda batch, ids, allowed=allowed: allowed)
        else:  # everything at once, composed in vLLM's order: bias, then repetition, then OpenAI's penalties
            bias = {plain[2]: -9.0, 70: 4.0}
            r = with_sampling(req, logit_bias=bias, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.7)
            ref = hf_generate(
                model,
                r,
                [
                    SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
                    RepetitionPenaltyLogitsProcessor(1.4),
                    _OpenAIPenalties(prompt_len, 0.5, 0.7),
                ],
            )
        out.append((r, ref, ref != plain))
    assert sum(changed for _, _, changed in out) >= 16, "the parameters must change the greedy output"
    return model, tok, out


class _OpenAIPenalties:
    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1]).float()
        return scores - (self.frequency * counts + self.presence * (counts > 0).float())[None]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_greedy_with_vllm_parameters_equals_generate_with_transformers_processors(cases, mode):
    model, tok, out = cases
    reqs = [r for r, _, _ in out]
    engine = Engine(model, tok, EngineConfig(mode=mode, max_num_batched_tokens=96, num_kv_blocks=48))
    got = engine.generate(reqs)
    for (req, ref, _), result in zip(out, got, strict=True):
        assert result.token_ids == ref, (req.request_id, req.sampling)


def test_min_p_masks_as_transformers_min_p_warper():
    from transformers import MinPLogitsWarper

    torch.manual_seed(0)
    scores = torch.randn(6, 50) * 3
    for min_p in (0.0, 0.05, 0.3, 1.0):
        ref = MinPLogitsWarper(min_p)(torch.zeros(6, 1, dtype=torch.long), scores.clone()) if min_p else scores
        got = apply_min_p(scores.clone(), torch.full((6,), min_p))
        assert torch.equal(torch.isinf(got), torch.isinf(ref)), min_p
    rows = apply_min_p(scores.clone(), torch.tensor([0.0, 0.2, 0.5, 0.9, 1.0, 0.1]))
    for i, min_p in enumerate([0.0, 0.2, 0.5, 0.9, 1.0, 0.1]):
        ref = MinPLogitsWarper(min_p)(None, scores[i : i + 1].clone()) if min_p else scores[i : i + 1]
        assert torch.equal(torch.isinf(rows[i : i + 1]), torch.isinf(ref))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_min_p_reaches_the_sampler(tiny_models, mode):
    """min_p 1 keeps only the most likely token: sampling at temperature 1 is then greedy; a lower min_p is
    seeded alike in both modes and differs from min_p 0 somewhere."""
    model, tok = tiny_models("tiny-llama")
    reqs = make_requests(tok, 6, seed=3, max_prompt=40, max_new=12, ignore_eos=True)
    greedy = [r.token_ids for r in Engine(model, tok, EngineConfig(mode=mode)).generate(reqs)]
    hot = [with_sampling(r, temperature=1.0, seed=i, min_p=1.0) for i, r in enumerate(reqs)]
    assert [r.token_ids for r in Engine(model, tok, EngineConfig(mode=mode)).generate(hot)] == greedy
    some = [with_sampling(r, min_p=0.2) for r in hot]
    none = [with_sampling(r, min_p=0.0) for r in hot]
    runs = {m: [r.token_ids for r in Engine(model, tok, EngineConfig(mode=m)).generate(some)] for m in ("sync", "async")}
    assert runs["sync"] == runs["async"]
    assert runs[mode] != [r.token_ids for r in Engine(model, tok, EngineConfig(mode=mode)).generate(none)]


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_models):
    model, tok = tiny_models("tiny-llama")
    (req,) = make_requests(tok, 1, seed=4, max_prompt=50, max_new=8, ignore_eos=True)
    req = dataclasses.replace(req, prompt_ids=req.prompt_ids + list(range(60, 90)))
    engine = Engine(model, tok, EngineConfig(mode="async"))
    cut, short = engine.generate([
        with_sampling(req, truncate_prompt_tokens=12),
        dataclasses.replace(req, request_id="short", prompt_ids=req.prompt_ids[-12:]),
    ])  # fmt: skip
    assert cut.token_ids == short.token_ids and cut.usage.prompt_tokens == 12


def test_stop_string_kept_with_include_stop_str_in_output_and_special_tokens_shown(tiny_models):
    model, tok = tiny_models("tiny-llama")
    reqs = make_requests(tok, 8, seed=9, max_prompt=30, max_new=24, ignore_eos=True)
    engine = Engine(model, tok, EngineConfig(mode="async"))
    plain = engine.generate([with_sampling(r, max_new_tokens=24) for r in reqs])
    found = [(r, p) for r, p in zip(reqs, plain, strict=True) if _ascii_windows(p.token_ids[4:], 2)]
    assert found
    req, p = found[0]
    stop = bytes(_ascii_windows(p.token_ids[4:], 2)[0]).decode()
    cut, kept = engine.generate([
        with_sampling(req, max_new_tokens=24, stop=(stop,)),
        dataclasses.replace(with_sampling(req, max_new_tokens=24, stop=(stop,), include_stop_str_in_output=True),
                            request_id="kept"),
    ])  # fmt: skip
    assert kept.text == cut.text + stop and kept.token_ids == cut.token_ids
    bt = ByteTokenizer()
    ids = [bt.bos_token_id, 104, 105, bt.eos_token_id]
    assert bt.decode(ids) == "hi" and bt.decode(ids, skip_special_tokens=False) == "<s>hi</s>"


def test_min_tokens_also_delays_stop_strings(tiny_models):
    model, tok = tiny_models("tiny-llama")
    reqs = make_requests(tok, 8, seed=9, max_prompt=30, max_new=24, ignore_eos=True)
    engine = Engine(model, tok, EngineConfig(mode="sync"))
    plain = engine.generate([with_sampling(r, max_new_tokens=24) for r in reqs])
    for req, p in zip(reqs, plain, strict=True):
        early = [t for t in p.token_ids[:3] if 33 <= t < 127]
        if not early:
            continue
        stop = bytes(early[:1]).decode()
        stopped, held = engine.generate([
            with_sampling(req, max_new_tokens=24, stop=(stop,)),
            dataclasses.replace(with_sampling(req, max_new_tokens=24, stop=(stop,), min_tokens=12), request_id="h"),
        ])  # fmt: skip
        assert len(stopped.token_ids) <= 3, "without min_tokens the early stop string ends the output"
        assert len(held.token_ids) >= 12 and held.token_ids[:12] == p.token_ids[:12]
        return
    pytest.skip("no printable token early in any output")


def test_repetition_penalty_counts_prompt_and_output_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 4.0]])
    history = torch.tensor([[1, -1]])
    prompts = torch.tensor([[0, 4, -1]])
    apply_penalties(logits, torch.tensor([0]), history, torch.zeros(1), torch.zeros(1), torch.tensor([2.0]), prompts)
    assert logits[0].tolist() == [1.0, -4.0, 1.0, -1.0, 2.0]


def test_generation_config_repetition_penalty_and_min_p_are_defaults(tmp_path):
    """A Qwen2 checkpoint whose generation_config.json sets repetition_penalty 1.3: requests that leave it out
    get it, and equal `generate()` (which reads the same file)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model, _ = load_model("tiny-qwen2", torch.device("cpu"), torch.float32)
    model.generation_config = GenerationConfig(repetition_penalty=1.3, bos_token_id=256, eos_token_id=257)
    model.save_pretrained(tmp_path)
    engine = Engine.from_model(str(tmp_path), device="cpu", dtype="float32", mode="async")
    assert engine.sampling_defaults == {"repetition_penalty": 1.3}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reqs = make_requests(engine.tokenizer, 8, seed=5, max_prompt=40, max_new=MAX_NEW, ignore_eos=True)
    got = engine.generate(reqs)
    refs = [hf_generate(reference, r, eos=None) for r in reqs]
    plain = Engine.from_model(str(tmp_path), device="cpu", dtype="float32", generation_config_defaults=False)
    assert [r.token_ids for r in got] == refs
    assert [r.token_ids for r in plain.generate(reqs)] != refs, "the penalty must change something"
    # do_sample false: greedy as generate() decodes it (temperature 0, said explicitly so that an OpenAI body's
    # own default of 1 does not apply), which still applies the repetition penalty
    model.generation_config = GenerationConfig(do_sample=False, repetition_penalty=1.1, min_p=0.2, temperature=0.7)
    assert generation_defaults(model) == {"repetition_penalty": 1.1, "temperature": 0.0}
    model.generation_config = GenerationConfig(do_sample=True, min_p=0.2, temperature=0.7)
    assert generation_defaults(model) == {"min_p": 0.2, "temperature": 0.7}
    defaults = SamplingParams().with_defaults(generation_defaults(model), 100)
    assert (defaults.min_p, defaults.repetition_penalty) == (0.2, 1.0)


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 0.0},
        {"min_p": 1.5},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_new_tokens": 4},
        {"logit_bias": {"x": 1.0}},
        {"logit_bias": {3: 100.5}},
        {"allowed_token_ids": ()},
        {"truncate_prompt_tokens": 0},
    ],
)
def test_out_of_range_vllm_fields_raise(fields):
    with pytest.raises(ValueError):
        SamplingParams(**fields)


def test_token_ids_outside_the_vocabulary_are_refused(tiny_models):
    model, tok = tiny_models("tiny-llama")
    engine = Engine(model, tok, EngineConfig(num_kv_blocks=16))
    vocab = model.config.vocab_size
    reqs = [
        EngineRequest("a", [1, 2], SamplingParams(max_new_tokens=2, allowed_token_ids=(3, vocab))),
        EngineRequest("b", [1, 2], SamplingParams(max_new_tokens=2, logit_bias={vocab: 1.0})),
        EngineRequest("c", [1, 2], SamplingParams(max_new_tokens=2, logit_bias={"7": 1.0})),
    ]
    a, b, c = engine.generate(reqs)
    assert "allowed_token_ids" in (a.error or "") and "logit_bias" in (b.error or "")
    assert c.error is None and len(c.token_ids) == 2


def test_bans_apply_only_where_the_input_token_matches_and_allowed_keeps_only_its_ids():
    from worker.engine.sampler import apply_bans, apply_logit_bias, keep_only

    logits = torch.zeros(3, 5)
    rows, tokens = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([1, 1, 2, 3, 4])
    required = torch.tensor([-1, 7, 9, 8, -1])  # row 1's ban needs input 9, row 2's first needs 8
    apply_bans(logits, rows, tokens, required, inputs=torch.tensor([7, 7, 5, 8, 8]))
    inf = float("-inf")
    assert logits.tolist() == [[0, inf, 0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, inf, inf]]
    apply_logit_bias(logits, torch.tensor([1, 1]), torch.tensor([0, 4]), torch.tensor([2.5, -1.0]))
    assert logits[1].tolist() == [2.5, 0, 0, 0, -1.0]
    keep_only(logits, torch.tensor([1]), torch.tensor([1, 1]), torch.tensor([0, 3]))
    assert logits[1].tolist() == [2.5, inf, inf, 0, inf] and logits[0, 0] == 0
