"""`n` parallel samples and prefix-cache accounting from request lines to result lines (issue 12), through
`cbq run` on the tiny-llama preset (CPU): n samples per line, seeded samples reproducible alone or in a batch,
OpenAI output with one choice per sample, `cached_tokens` for a shared prefix and the hit rate in `cbq stats`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from openai.types import Completion
from openai.types.chat import ChatCompletion

from producer.cli import main
from worker.engine.engine import Engine

SHARED_PREFIX = "You are a careful assistant. Answer in one short sentence, then stop. " * 4  # ~280 byte tokens


def run(tmp_path: Path, lines: list[dict], *args: str, name: str = "in") -> list[dict]:
    src, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(
        main, ["run", str(src), "-o", str(out), "--device", "cpu", "--max-new-tokens", "6", *args]
    )
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_line_with_n_3_gives_3_samples_and_a_line_without_n_gives_none(tmp_path):
    lines = [{"prompt": "abc", "n": 3, "temperature": 1.0, "seed": 5}, {"prompt": "abc"}]
    many, one = run(tmp_path, lines, "--token-ids", "--ignore-eos")
    samples = many["samples"]
    assert [s["index"] for s in samples] == [0, 1, 2]
    assert (many["text"], many["finish_reason"], many["token_ids"]) == (
        samples[0]["text"],
        samples[0]["finish_reason"],
        samples[0]["token_ids"],
    )
    assert all(s["finish_reason"] == "length" and len(s["token_ids"]) == 6 for s in samples)
    assert len({tuple(s["token_ids"]) for s in samples}) > 1, "samples of a sampled request differ"
    assert many["usage"]["completion_tokens"] == 18  # all samples' tokens; the prompt counts once
    assert many["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert "samples" not in one and "cached_tokens" in one["usage"]


def test_seeded_samples_are_the_same_alone_and_in_a_batch(tmp_path):
    seeded = {"prompt": "the same prompt", "n": 2, "temperature": 1.0, "seed": 1234, "custom_id": "s"}
    others = [{"prompt": f"other {i}", "n": 2, "temperature": 0.8} for i in range(3)]
    [alone] = run(tmp_path, [seeded], "--ignore-eos", name="alone")
    single = {**seeded, "n": 1, "custom_id": "one"}
    batch = run(
        tmp_path, [*others[:2], seeded, others[2], single], "--ignore-eos", "--max-num-batched-tokens", "8", name="b"
    )
    in_batch, one = (next(line for line in batch if line.get("custom_id") == c) for c in ("s", "one"))
    assert [s["text"] for s in alone["samples"]] == [s["text"] for s in in_batch["samples"]]
    assert one["text"] == alone["samples"][0]["text"]  # sample 0 is the request's n = 1 output


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_openai_output_with_n_2_has_2_choices_and_parses_with_openai_types(tmp_path, url):
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in url else {"prompt": "hi"}
    body |= {"n": 2, "temperature": 1.0, "seed": 3, "max_tokens": 5}
    line = {"custom_id": "c", "method": "POST", "url": url, "body": body}
    [out] = run(tmp_path, [line], "--format", "openai", "--ignore-eos")
    parsed = (ChatCompletion if "chat" in url else Completion).model_validate(out["response"]["body"])
    assert [c.index for c in parsed.choices] == [0, 1]
    assert parsed.usage.completion_tokens == 10
    assert parsed.usage.prompt_tokens_details is not None and parsed.usage.prompt_tokens_details.cached_tokens == 0


def test_a_shared_prefix_is_reported_as_cached_tokens_and_as_the_hit_rate_in_stats(
    cbq, burst_worker, write_jsonl
):
    lines = [{"prompt": SHARED_PREFIX + tail, "max_new_tokens": 2} for tail in ("first?", "second?")]
    batch_id = json.loads(cbq("submit", write_jsonl(lines), "--json").stdout.splitlines()[-1])["batch_id"]
    burst_worker(Engine.from_model("tiny-llama", device="cpu", max_num_seqs=1))  # one at a time: the 2nd hits
    results = [json.loads(line) for line in cbq("results", batch_id, "-o", "-").stdout.splitlines()]
    first, second = (r["usage"] for r in results)
    assert first["cached_tokens"] == 0 and 0 < second["cached_tokens"] < second["prompt_tokens"]

    [worker] = json.loads(cbq("stats", "--json").stdout)["workers"]
    assert 0 < worker["prefix_cache_hit_rate"] < 1
    assert "cache hit" in cbq("stats").stdout


def test_n_out_of_range_fails_its_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "x", "n": 129}) + "\n")
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(tmp_path / "o"), "--fake-engine"])
    assert result.exit_code != 0
    assert "line 1: n: Input should be less than or equal to 128" in result.output
