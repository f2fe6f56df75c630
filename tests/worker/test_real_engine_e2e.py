"""The real engine behind the queue: what comes out of Redis equals `engine.generate` on the same requests."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from producer.cli import main
from producer.store import validate_lines
from schemas import keys
from worker.admission import to_engine_request

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"


def requests_40() -> list[dict]:
    out = []
    for i in range(40):
        sampling = {"max_new_tokens": 1 + i % 8}
        if i % 3 == 1:
            sampling |= {"temperature": 0.8, "top_p": 0.9, "seed": i}
        elif i % 3 == 2:
            sampling |= {"temperature": 1.0, "top_k": 20}  # no seed: derived from the request id
        if i % 2 == 0:
            out.append(
                {"custom_id": f"p{i}", "prompt": f"request {i}: " + "lorem ipsum " * (i % 5), **sampling}
            )
        else:
            out.append(
                {"custom_id": f"c{i}", "messages": [{"role": "user", "content": f"chat {i}"}], **sampling}
            )
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_queue_outputs_equal_engine_generate(mode, cbq, burst_worker, write_jsonl):
    from worker.engine.engine import Engine

    objs = requests_40()
    submitted = cbq("submit", write_jsonl(objs), "--json", "--chunk-size", "8", "--token-ids")
    batch_id = json.loads(submitted.stdout.splitlines()[-1])["batch_id"]

    engine = Engine.from_model("tiny-llama", mode=mode, device="cpu")
    parsed = validate_lines([json.dumps(o) for o in objs]).requests
    # The same requests the worker builds (same ids, so unseeded sampling draws the same random stream).
    expected = engine.generate(
        [
            to_engine_request(p.resolve(i, return_token_ids=True), engine.tokenizer, batch_id, 0.0)
            for i, p in enumerate(parsed)
        ]
    )
    assert expected[0].request_id == keys.engine_request_id(batch_id, 0)

    burst_worker(engine)
    lines = [json.loads(line) for line in cbq("results", batch_id).stdout.splitlines()]
    assert [r["custom_id"] for r in lines] == [o["custom_id"] for o in objs]
    assert [r["token_ids"] for r in lines] == [e.token_ids for e in expected]
    assert [r["text"] for r in lines] == [e.text for e in expected]
    assert [r["finish_reason"] for r in lines] == [e.finish_reason.value for e in expected]
    assert all(r["usage"]["gpu_seconds"] > 0 and r["usage"]["prompt_tokens"] > 0 for r in lines)


def test_cbq_run_with_the_default_tiny_llama_preset(tmp_path):
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", str(EXAMPLES), "-o", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 20 and all(r["finish_reason"] in ("stop", "length") for r in lines)
