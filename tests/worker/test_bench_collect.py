"""benchmarks/collect_results.py on run files shaped like `bench engine`'s: an MoE run with Llama-3-8B first in the
same process (run_gpu.sh w1moe/w2moe: the MoE entry keeps its own numbers, the Llama run goes beside them), and the
TP=1 before/after runs (run_gpu.sh tp1w1), a run whose JSON the device did not bring back read from tp1.log, and
DeepSeek-V2-Lite's W1 on two decoders in one process (run_gpu.sh w1mlaowned)."""

from __future__ import annotations

import json

from .test_bench_fp8 import _collect_results


def _run(model: str, tok_s: float, floor_ratio: float) -> dict:
    return {"mode": f"async-{model}", "output_tok_s": tok_s, "floor_ratio": floor_ratio, "extra": {"model": model}}


def _file(models: list[str], results: dict) -> dict:
    return {"device": "NVIDIA H200", "torch": "2.11", "date": "2026-12-03", "copy_bandwidth_bytes_s": 4.2e12,
            "config": {}, "model": models if len(models) > 1 else models[0], "models": models, "results": results}  # fmt: skip


def test_an_moe_run_keeps_its_numbers_and_puts_llama_of_the_same_call_beside_them(tmp_path):
    w1 = _file(["llama3-8b"], {"async": _run("llama3-8b", 5800.0, 0.8)})
    (tmp_path / "w1.json").write_text(json.dumps(w1))
    both = {"async-llama3-8b": _run("llama3-8b", 12300.0, 0.66), "async-qwen3-30b-a3b": _run("qwen3-30b-a3b", 12100.0, 0.64)}
    (tmp_path / "w2_moe.json").write_text(json.dumps(_file(["llama3-8b", "qwen3-30b-a3b"], both)))
    (tmp_path / "w1_moe.json").write_text(json.dumps(_file(["qwen3-30b-a3b"], {"async": _run("qwen3-30b-a3b", 1849.0, 0.75)})))
    collected = _collect_results().main([tmp_path])
    w2 = collected["W2_moe"]
    assert w2["model"] == "qwen3-30b-a3b" and set(w2) >= {"async", "llama3_8b_same_call"}
    assert w2["async"]["floor_ratio"] == 0.64 and w2["llama3_8b_same_call"]["floor_ratio"] == 0.66
    assert collected["W1_moe"]["async"]["output_tok_s"] == 1849.0 and "llama3_8b_same_call" not in collected["W1_moe"]


def test_tp1_runs_are_read_from_their_json_or_from_the_table_row_above_their_wrote_line(tmp_path):
    (tmp_path / "w1.json").write_text(json.dumps(_file(["llama3-8b"], {"async": _run("llama3-8b", 5800.0, 0.8)})))
    for name, tok_s in (("tp1_w2_after_2", 12500.0), ("tp1_w2_after_4", 12600.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps(_file(["llama3-8b"], {"async": _run("llama3-8b", tok_s, 0.67)})))
    header = "       mode |   out tok/s | total tok/s |       steps |     step ms |      gpu ms |     prep ms |     mask ms |        busy | floor tok/s | floor ratio"
    row = "      async |      {} |      25,284 |        1087 |       40.78 |       40.44 |       3.315 |       0.000 |       99.2% |      18,560 |        0.68"
    log = [header, row.format("12,400"), "wrote /root/out/tp1_w2_before_1.json", header, row.format("12,500"),
           "wrote /root/out/tp1_w2_after_2.json", header, row.format("12,300"), "wrote /root/out/tp1_w2_before_3.json"]  # fmt: skip
    (tmp_path / "tp1.log").write_text("\n".join(log) + "\n")
    entry = _collect_results().main([tmp_path])["TP1_W2"]
    assert [r["source"] for r in entry["runs"].values()] == [
        "tp1.log", "tp1_w2_after_2.json", "tp1.log", "tp1_w2_after_4.json"
    ]  # fmt: skip
    assert entry["runs"]["tp1_w2_before_1"]["output_tok_s"] == 12400.0
    assert entry["after_over_before"] == (12500.0 + 12600.0) / (12400.0 + 12300.0)


def test_the_latent_shape_on_two_decoders_gives_both_and_their_ratio(tmp_path):
    both = {"async-auto": _run("deepseek-v2-lite", 1700.0, 0.53), "async-owned": _run("deepseek-v2-lite", 2550.0, 0.8)}
    (tmp_path / "w1_mla_owned.json").write_text(json.dumps(_file(["deepseek-v2-lite"], both)))
    entry = _collect_results().main([tmp_path])["W1_mla_owned"]
    assert entry["auto"]["floor_ratio"] == 0.53 and entry["owned"]["floor_ratio"] == 0.8
    assert entry["owned_over_auto"] == 2550.0 / 1700.0
