"""Stop conditions: EOS (unless ignore_eos), stop token ids, stop strings (text cut before the first),
max_new_tokens and the context length. First `check_stop` / `final_text` on hand-built sequences,
then end to end through `Engine.generate` with the byte tokenizer, in sync and async mode."""

from __future__ import annotations

import pytest
import torch

from worker.engine.api import EngineRequest, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model
from worker.engine.sequence import Sequence
from worker.engine.stop import check_stop, final_text
from worker.engine.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
EOS = TOK.eos_token_id
EOS_IDS = TOK.eos_token_ids
JUNK = 300  # a model id past the byte tokenizer's: decodes to nothing


@pytest.fixture(scope="module")
def llama():
    """This module's own tiny-llama (fp32, CPU): an Engine switches its model's attention to the paged
    kernel, so the shared `tiny_models` instances, which other tests run through HF generate, stay out."""
    return load_model("tiny-llama", torch.device("cpu"), torch.float32)


class MarkTokenizer:
    """Every id decodes to a visible mark, so the tests see exactly which ids reach the text."""

    def decode(self, ids: list[int], **options) -> str:
        return "".join(f"<{i}>" for i in ids)


def ids_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def seq_with(output_ids: list[int], num_prompt: int = 3, **sampling) -> Sequence:
    seq = Sequence(
        "r", [TOK.bos_token_id] * num_prompt, SamplingParams(**{"max_new_tokens": 100, **sampling}), 0
    )
    seq.output_ids = list(output_ids)
    return seq


def run_check(output_ids, max_model_len=1000, tokenizer=TOK, **sampling):
    """check_stop after each token, as the engine calls it; returns (reason, number of tokens at the stop)."""
    seq = seq_with([], **sampling)
    for token in output_ids:
        seq.output_ids.append(token)
        reason = check_stop(seq, EOS_IDS, max_model_len, tokenizer)
        if reason is not None:
            return reason, len(seq.output_ids)
    return None, len(seq.output_ids)


# -- check_stop / final_text ---------------------------------------------------------------------


def test_eos_stops_unless_ignored():
    assert run_check([65, 66, EOS, 67]) == (FinishReason.STOP, 3)
    assert run_check([65, 66, EOS, 67], ignore_eos=True) == (None, 4)
    mark = MarkTokenizer()
    assert final_text(seq_with([65, 66, EOS]), EOS_IDS, mark) == "<65><66>"
    assert final_text(seq_with([65, EOS, 66, EOS], ignore_eos=True), EOS_IDS, mark) == "<65><257><66><257>"


def test_stop_token_ids_stop_and_are_left_out_of_the_text():
    assert run_check([65, 66, 67, 68], stop_token_ids=(67, 99)) == (FinishReason.STOP, 3)
    # A stop token id stops even with ignore_eos (that flag is about EOS only).
    assert run_check([65, 66, 67], stop_token_ids=(66,), ignore_eos=True) == (FinishReason.STOP, 2)
    mark = MarkTokenizer()
    assert final_text(seq_with([65, 66, 67], stop_token_ids=(67,)), EOS_IDS, mark) == "<65><66>"
    # Only a final stop token is dropped (an earlier one could not be there: it would have stopped).
    assert final_text(seq_with([67, 65], stop_token_ids=(67,)), EOS_IDS, mark) == "<67><65>"


def test_stop_string_spanning_several_tokens():
    out = ids_of("Hello, world! Bye")
    reason, n = run_check(out, stop=("world",))
    assert reason == FinishReason.STOP and n == len(ids_of("Hello, world")), (
        "stops on the token completing it"
    )
    seq = seq_with(out[:n], stop=("world",))
    assert final_text(seq, EOS_IDS, TOK) == "Hello, "


def test_text_is_cut_before_the_first_of_several_stop_strings():
    out = ids_of("abc STOP def END")
    assert run_check(out, stop=("END", "STOP")) == (FinishReason.STOP, len(ids_of("abc STOP")))
    assert final_text(seq_with(out, stop=("END", "STOP")), EOS_IDS, TOK) == "abc "
    # final_text cuts at the first occurrence even when the sequence ran on past it.
    assert final_text(seq_with(ids_of("x; y; z"), stop=(";",)), EOS_IDS, TOK) == "x"
    assert final_text(seq_with(ids_of("no stop here"), stop=("zz",)), EOS_IDS, TOK) == "no stop here"


def test_stop_string_with_multibyte_characters():
    out = ids_of("prix: 10€ ou 12€")  # "€" is three byte tokens
    assert run_check(out, stop=("€",)) == (FinishReason.STOP, len(ids_of("prix: 10€")))
    assert final_text(seq_with(out, stop=("€",)), EOS_IDS, TOK) == "prix: 10"


def test_stop_string_split_by_ids_that_decode_to_nothing():
    # Ids that decode to nothing (unused model ids, special tokens) sit between the stop string's bytes:
    # a fixed window of tokens would slide past "a" before "b" arrives and never see "ab".
    out = ids_of("xyz a") + [JUNK] * 12 + ids_of("b tail")
    reason, n = run_check(out, stop=("ab",))
    assert (reason, n) == (FinishReason.STOP, len(ids_of("xyz a")) + 12 + 1)
    assert final_text(seq_with(out[:n], stop=("ab",)), EOS_IDS, TOK) == "xyz "


def test_max_new_tokens_and_context_length_give_length():
    assert run_check([65] * 10, max_new_tokens=4) == (FinishReason.LENGTH, 4)
    # 3 prompt tokens + 5 outputs = the context of 8.
    assert run_check([65] * 10, max_model_len=8) == (FinishReason.LENGTH, 5)
    # Async: a token still in flight is not part of the output yet, so it cannot fill the context.
    seq = seq_with([65] * 4)
    seq.num_inflight_samples = 1
    assert check_stop(seq, EOS_IDS, 8, TOK) is None
    seq.output_ids.append(65)
    assert check_stop(seq, EOS_IDS, 8, TOK) == FinishReason.LENGTH
    # On the same token, a stop beats the length limit.
    assert run_check([65, 66, 67, EOS], max_new_tokens=4) == (FinishReason.STOP, 4)
    assert run_check(ids_of("abcd"), max_new_tokens=4, stop=("cd",)) == (FinishReason.STOP, 4)


# -- end to end ----------------------------------------------------------------------------------

MAX_NEW = 32


@pytest.fixture(scope="module")
def base(llama):
    """Greedy outputs (EOS ignored) of a few prompts; stop tests rerun them with a stop condition."""
    model, tok = llama
    engine = Engine(model, tok, EngineConfig(mode="sync", num_kv_blocks=128))
    reqs = [
        EngineRequest(
            f"p{i}", tok.encode(f"prompt {i}: the quick brown fox"), SamplingParams(MAX_NEW, ignore_eos=True)
        )
        for i in range(24)
    ]
    results = engine.generate(reqs)
    assert all(len(r.token_ids) == MAX_NEW and r.finish_reason == FinishReason.LENGTH for r in results)
    return {req.request_id: (req.prompt_ids, res.token_ids) for req, res in zip(reqs, results, strict=True)}


def rerun(llama, mode: str, prompt_ids: list[int], max_model_len: int | None = None, **sampling):
    model, tok = llama
    engine = Engine(model, tok, EngineConfig(mode=mode, num_kv_blocks=128, max_model_len=max_model_len))
    sampling = {"max_new_tokens": MAX_NEW, **sampling}
    # A neighbour shares the batch. (In async mode the stopped request was already scheduled one step
    # further when its stop is seen: that extra token must not reach the result.)
    other = EngineRequest("other", prompt_ids[:5], SamplingParams(MAX_NEW, ignore_eos=True))
    result, _ = engine.generate([EngineRequest("r", prompt_ids, SamplingParams(**sampling)), other])
    engine.blocks.check_integrity([])
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    return result


MODES = ["sync", "async"]


@pytest.mark.parametrize("mode", MODES)
def test_engine_eos_stops_unless_ignored(llama, base, mode):
    found = [(p, out, out.index(EOS)) for p, out in base.values() if EOS in out[:-1]]
    assert found, "no greedy output reaches EOS: pick other prompts"
    prompt, out, k = found[0]
    res = rerun(llama, mode, prompt)
    assert res.finish_reason == FinishReason.STOP
    assert res.token_ids == out[: k + 1] and res.usage.completion_tokens == k + 1
    assert res.text == TOK.decode(out[:k])
    res = rerun(llama, mode, prompt, ignore_eos=True)
    assert res.finish_reason == FinishReason.LENGTH and res.token_ids == out


@pytest.mark.parametrize("mode", MODES)
def test_engine_stop_token_ids(llama, base, mode):
    prompt, out = base["p0"]
    k = next(i for i in range(4, MAX_NEW - 2) if out[i] not in out[:i] and out[i] != EOS)
    res = rerun(llama, mode, prompt, ignore_eos=True, stop_token_ids=(out[k],))
    assert res.finish_reason == FinishReason.STOP
    assert res.token_ids == out[: k + 1]
    assert res.text == TOK.decode(out[:k])


def printable_run(out: list[int]) -> tuple[int, int] | None:
    """A span of 3 printable ASCII tokens that ends before the output does."""
    for i in range(2, len(out) - 5):
        if all(32 < t < 127 for t in out[i : i + 3]):
            return i, i + 3
    return None


@pytest.mark.parametrize("mode", MODES)
def test_engine_stop_string_spanning_tokens(llama, base, mode):
    spans = [(p, out, printable_run(out)) for p, out in base.values()]
    spans = [(p, out, span) for p, out, span in spans if span]
    assert len(spans) >= 2, "too few printable runs in the greedy outputs: pick other prompts"
    for prompt, out, (i, j) in spans[:2]:
        stop = bytes(out[i:j]).decode("ascii")
        full_text = TOK.decode(out)
        # The run stops on the token that completes the first occurrence.
        m = next(n for n in range(1, len(out) + 1) if stop in TOK.decode(out[:n]))
        assert m < len(out)
        res = rerun(llama, mode, prompt, ignore_eos=True, stop=(stop,))
        assert res.finish_reason == FinishReason.STOP, stop
        assert res.text == full_text[: full_text.index(stop)]
        assert res.token_ids == out[:m]


@pytest.mark.parametrize("mode", MODES)
def test_engine_max_new_tokens_gives_length(llama, base, mode):
    prompt, out = base["p1"]
    res = rerun(llama, mode, prompt, ignore_eos=True, max_new_tokens=5)
    assert res.finish_reason == FinishReason.LENGTH and res.token_ids == out[:5]
    assert res.text == TOK.decode(out[:5])


@pytest.mark.parametrize("mode", MODES)
def test_engine_context_length_gives_length(llama, base, mode):
    prompt, out = base["p2"]
    max_model_len = len(prompt) + 6
    res = rerun(llama, mode, prompt, max_model_len=max_model_len, ignore_eos=True)
    assert res.finish_reason == FinishReason.LENGTH
    assert res.token_ids == out[:6], "prompt + output fill the context exactly"


def test_a_stop_string_spanning_part_of_a_special_tokens_text_stops_as_in_transformers():
    # "<pad>" is a special token: decoding leaves it out, so "end<pa" never shows in the text, but
    # transformers' StopStringCriteria matches the tokens' own strings, specials included.
    out = ids_of("the end") + [TOK.pad_token_id] + ids_of(" more")
    reason, n = run_check(out, stop=("end<pa",))
    assert (reason, n) == (FinishReason.STOP, len(ids_of("the end")) + 1)
    assert final_text(seq_with(out[:n], stop=("end<pa",)), EOS_IDS, TOK) == "the "
    assert final_text(seq_with(out[:n], stop=("end<pa",), include_stop_str_in_output=True), EOS_IDS, TOK) == (
        "the end<pa"
    )
    assert final_text(seq_with(out[:n], stop=("d<pad",)), EOS_IDS, TOK) == "the en"  # cut inside a token's text
    # A stop string inside the special token's text alone stops on that token.
    assert run_check(out, stop=("pad>",)) == (FinishReason.STOP, len(ids_of("the end")) + 1)
    assert final_text(seq_with(out[:n], stop=("pad>",)), EOS_IDS, TOK) == "the end"
    # With the special tokens kept in the text, that text is what is matched, as before.
    kept = seq_with(out[:n], stop=("end<pa",), skip_special_tokens=False)
    assert final_text(kept, EOS_IDS, TOK) == "the "
    assert run_check(ids_of("the end more"), stop=("end<pa",)) == (None, len(ids_of("the end more")))
