"""`cbq run --tensor-parallel-size 2` on the CPU (gloo): the whole pipeline (queue, worker, results) with the model
split over two processes writes the same outputs as one process, and leaves no helper behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from producer.cli import main

pytestmark = pytest.mark.usefixtures("restore_signal_handlers")  # rq installs its own


def run_outputs(input_file: Path, out: Path, *flags: str) -> list[dict]:
    result = CliRunner().invoke(
        main, ["run", str(input_file), "-o", str(out), "--model", "tiny-llama", "--device", "cpu", *flags]
    )
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_cbq_run_at_tp2_writes_what_one_process_writes(tmp_path):
    lines = [{"custom_id": f"r{i}", "prompt": f"prompt {i} " * (i + 1), "max_new_tokens": 6} for i in range(6)]
    input_file = tmp_path / "in.jsonl"
    input_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    one = run_outputs(input_file, tmp_path / "one.jsonl", "--mode", "async")
    two = run_outputs(input_file, tmp_path / "two.jsonl", "--mode", "async", "--tensor-parallel-size", "2")
    assert "error" not in [r["finish_reason"] for r in two]
    assert [(r["custom_id"], r["text"], r["finish_reason"]) for r in two] == [
        (r["custom_id"], r["text"], r["finish_reason"]) for r in one
    ]
