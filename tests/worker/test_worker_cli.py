import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from producer.cli import main
from worker.bench.queue import queue_bench

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "prompts.jsonl"


pytestmark = pytest.mark.usefixtures("restore_signal_handlers")  # rq installs its own


def test_run_the_examples_with_the_fake_engine(tmp_path):
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", str(EXAMPLES), "-o", str(out), "--fake-engine"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    inputs = [json.loads(line) for line in EXAMPLES.read_text().splitlines()]
    assert len(lines) == len(inputs) == 20
    assert [r.get("custom_id") for r in lines] == [i.get("custom_id") for i in inputs]
    assert {r["finish_reason"] for r in lines} <= {"stop", "length"}
    assert "completed 20" in result.stderr


@pytest.mark.parametrize("example", sorted(EXAMPLES.parent.glob("*.jsonl")), ids=lambda p: p.name)
def test_every_example_file_runs(example, tmp_path):
    """The README names these files: each one is valid and runs."""
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", str(example), "-o", str(out), "--fake-engine", "--format", "openai"])
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == len(example.read_text().splitlines())


def test_run_writes_openai_output_and_rejects_invalid_files(tmp_path):
    out = tmp_path / "out.jsonl"
    ok = CliRunner().invoke(
        main, ["run", str(EXAMPLES), "-o", str(out), "--fake-engine", "--format", "openai"]
    )
    assert ok.exit_code == 0
    assert all(json.loads(line)["response"]["status_code"] == 200 for line in out.read_text().splitlines())

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": "b", "top_p": 0}\n')
    result = CliRunner().invoke(main, ["run", str(bad), "-o", str(out), "--fake-engine", "--strict"])
    assert result.exit_code == 1
    assert "line 2: top_p: Input should be greater than 0" in result.stderr
    assert "1 invalid line(s); nothing was run" in result.stderr
    not_json = tmp_path / "not_json.jsonl"  # a format error refuses the file without --strict
    not_json.write_text('{"prompt": "a"}\n{"prompt": \n')
    result = CliRunner().invoke(main, ["run", str(not_json), "-o", str(out), "--fake-engine"])
    assert result.exit_code == 1 and "1 invalid line(s); nothing was run" in result.stderr


def test_worker_command_drains_the_queue(cbq, write_jsonl):
    batch_id = json.loads(
        cbq("submit", write_jsonl([{"prompt": "a"}] * 5), "--json").stdout.splitlines()[-1]
    )["batch_id"]
    result = cbq("worker", "--burst", "--fake-engine", "--log-level", "WARNING")
    assert result.exit_code == 0, result.output
    status = json.loads(cbq("status", batch_id, "--json").stdout)
    assert status["num_completed"] == 5


def test_worker_help_and_bench_queue_command(tmp_path):
    help_text = CliRunner().invoke(main, ["worker", "--help"]).output
    for option in ("--model", "--redis-url", "--burst", "--mode", "--queue", "--fake-engine"):
        assert option in help_text

    json_out = tmp_path / "bench.json"
    args = [
        "--fake",
        "--num-requests",
        "300",
        "--chunk-size",
        "1",
        "--chunk-size",
        "64",
        "--json-out",
        str(json_out),
    ]
    result = CliRunner().invoke(queue_bench, args)
    assert result.exit_code == 0, result.output
    record = json.loads(json_out.read_text())
    assert [row["chunk_size"] for row in record["rows"]] == [1, 64]
    assert all(row["worker_requests_per_second"] > 0 for row in record["rows"])
    assert "worker_requests_per_second" in result.output



def test_bench_engine_variants():
    """`--variant`: parsed before the model loads; the JSON variant keeps every request running to its length."""
    from worker.bench.common import make_workload, with_variant
    from worker.bench.engine import engine_bench, parse_variant, variant_name
    from worker.engine.engine import Engine

    assert [parse_variant(v) for v in ("plain", "json", "logprobs5", "json+logprobs0")] == [
        (False, None),
        (True, None),
        (False, 5),
        (True, 0),
    ]
    assert variant_name(True, 5) == "json+logprobs5" and variant_name(False, None) == "plain"
    bad = CliRunner().invoke(engine_bench, ["--variant", "xml"])  # before loading the default llama3-8b
    assert bad.exit_code == 2 and "expected plain, json, logprobsK or json+logprobsK" in bad.output

    reqs = with_variant(make_workload("tiny", 256, num_requests=2), constrain_json=True, top_logprobs=2)
    engine = Engine.from_model("tiny-llama", device="cpu", mode="sync")
    results = engine.generate(reqs)
    assert [len(r.token_ids) for r in results] == [r.sampling.max_new_tokens for r in reqs]
    assert all(r.text.startswith('{"id":') and len(r.logprobs[0].top) == 2 for r in results)
    assert engine.stats().mask_seconds > 0
