"""`cbq bench embed` (W7) at a tiny size on the CPU: both sides run the same inputs, the table and JSON come out."""

from __future__ import annotations

import json

from click.testing import CliRunner

from worker.bench import bench
from worker.bench.embed import w7_inputs


def test_w7_inputs_tokenize_to_50_to_500_tokens():
    texts = w7_inputs(50, vocab_size=2048, num_specials=2, seed=3)
    assert texts == w7_inputs(50, vocab_size=2048, num_specials=2, seed=3)  # seeded
    assert all(48 <= len(t.split()) <= 498 for t in texts)


def test_bench_embed_runs_tiny_shapes_on_the_cpu(tmp_path):
    out = tmp_path / "embed.json"
    args = ["embed", "--num", "20", "--shape", "tiny-bert", "--shape", "tiny-qwen3", "--device", "cpu",
            "--json-out", str(out)]
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "cbq in/s" in result.output and "tiny-qwen3" in result.output
    report = json.loads(out.read_text())
    assert report["command"].startswith("cbq bench embed") and report["date"]  # the run says how to repeat it
    assert [row["shape"] for row in report["rows"]] == ["tiny-bert", "tiny-qwen3"]
    for row in report["rows"]:
        assert row["num_inputs"] == 20 and row["dtype"] == "float32"
        assert row["cbq"]["inputs_per_s"] > 0 and row["sentence_transformers"]["inputs_per_s"] > 0
        assert row["ratio"] > 0
        assert row["min_cosine_first_inputs"] >= 0.99999  # the same embeddings on both sides
    # both shapes run packed, and transformers' padded forward on the same inputs for the before/after
    for row in report["rows"]:
        assert row["cbq"]["forward"] == "packed" and row["cbq_hf_forward"]["forward"] == "transformers"
        assert row["cbq_hf_forward"]["num_inputs"] == 20 and row["packed_over_hf"] > 0
        assert row["min_cosine_packed_vs_hf"] >= 0.99999
    assert "packed/hf" in result.output
