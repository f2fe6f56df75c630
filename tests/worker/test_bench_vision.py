"""`cbq bench vision` (W6) at the tiny Qwen2.5-VL shape on the CPU: every request its own picture, cbq and
transformers' generate on the same module give the same tokens in fp32, and the JSON carries the rates and the
vision encoder's share of the run."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from worker.bench import bench
from worker.bench.vision import w6_picture, w6_prompts
from worker.media.load import content_hash


def test_w6_pictures_are_seeded_and_all_different():
    pictures = [w6_picture(seed, (256, 192)) for seed in range(8)]
    assert all(p.size == (256, 192) and p.mode == "RGB" for p in pictures)
    assert len({content_hash(p) for p in pictures}) == 8  # the encoder cache never joins two requests
    assert content_hash(w6_picture(3, (256, 192))) == content_hash(pictures[3])


def test_w6_prompts_hold_one_image_pad_and_about_the_text_length(tmp_path):
    from transformers import AutoTokenizer, Qwen2_5_VLConfig

    from worker.bench.qwen_vl_checkpoint import QWEN2_5_VL_SHAPES, QWEN_VL_FAMILY, write_qwen_vl_files

    shape = QWEN2_5_VL_SHAPES["tiny"]
    _, _, ids = write_qwen_vl_files(
        tmp_path, Qwen2_5_VLConfig, shape.text, shape.vision, QWEN_VL_FAMILY, shape.preprocessor
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    prompts = w6_prompts(tokenizer, 20, 100, seed=0)
    assert all(p.count(ids["<|image_pad|>"]) == 1 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 20
    assert 90 <= sum(len(p) - 1 for p in prompts) / 20 <= 110


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_bench_vision_runs_the_tiny_shape_on_the_cpu(tmp_path, mode):
    out = tmp_path / "vision.json"
    args = [
        "vision",
        "--shape",
        "tiny",
        "--num",
        "6",
        "--output-len",
        "12",
        "--hf-num-requests",
        "4",
        "--hf-batch-size",
        "2",
        "--warmup",
        "1",
        "--mode",
        mode,
        "--device",
        "cpu",
        "--json-out",
        str(out),
    ]
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "cbq / transformers requests/s" in result.output and "step profile: encoder" in result.output
    report = json.loads(out.read_text())
    # the command that reproduces the run, every option spelled out
    assert report["command"].startswith("cbq bench vision --workload W6 --shape tiny --num 6 --output-len 12")
    assert f"--mode {mode}" in report["command"] and report["date"]
    assert "commit" not in report  # the device's tree copy carries stale git metadata: READMEs name the commit
    (row,) = report["rows"]
    assert row["workload"] == "W6" and row["num_requests"] == 6 and row["dtype"] == "float32"
    assert row["image_size"] == [1024, 768] and 90 <= row["mean_text_tokens"] <= 110
    cbq, hf = row["cbq"], row["hf"]
    assert cbq["mode"] == mode and cbq["output_tokens"] == 6 * 12  # EOS ignored: every request at full length
    assert cbq["images_encoded"] == 6  # one picture a request, none shared
    # the tiny pixel bounds: a 1024x768 picture is resized to at most 64 merged patches; image tokens are prompt tokens
    assert 4 <= cbq["mean_image_tokens"] <= 64
    assert cbq["prompt_tokens"] == 6 * (cbq["mean_image_tokens"] + row["mean_text_tokens"])
    assert cbq["total_tok_s"] > cbq["output_tok_s"] > 0 and cbq["requests_per_s"] > 0
    # the step profile: the encoder's time is part of the steps' time, the decoder's the rest
    assert 0 < cbq["encoder_seconds"] < cbq["device_seconds"]
    assert cbq["encoder_seconds"] + cbq["decoder_seconds"] == pytest.approx(cbq["device_seconds"])
    assert 0 < cbq["encoder_share_of_run"] < 1 and 0 < cbq["encoder_share_of_device"] < 1
    assert hf["num_requests"] == 4 and hf["output_tokens"] == 4 * 12 and hf["batch_size"] == 2
    assert row["ratio"] == pytest.approx(cbq["requests_per_s"] / hf["requests_per_s"])
    assert row["hf_requests_equal"] == 4  # greedy in fp32: left-padded generate equals cbq token for token
    assert row["targets"] == {"ratio": 10.0, "encoder_share_of_run": 0.25}


def test_bench_vision_compares_decoders_in_one_process(tmp_path):
    """`--decoder hf --decoder owned`: an engine each over the same model, each row's decoder named, the first one
    compared with transformers."""
    out = tmp_path / "vision.json"
    args = ["vision", "--shape", "tiny", "--num", "3", "--output-len", "6", "--hf-num-requests", "2", "--warmup", "1"]
    args += ["--mode", "sync", "--device", "cpu", "--decoder", "hf", "--decoder", "owned", "--json-out", str(out)]
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "cbq hf" in result.output and "cbq owned" in result.output
    report = json.loads(out.read_text())
    assert "--decoder hf --decoder owned" in report["command"]
    (row,) = report["rows"]
    runs = row["cbq_by_decoder"]
    assert list(runs) == ["hf", "owned"] and [r["decoder"] for r in runs.values()] == ["hf", "owned"]
    assert row["cbq"] == runs["hf"] and all(r["output_tokens"] == 3 * 6 for r in runs.values())
    assert row["hf_requests_equal"] == 2


def test_eos_ignored_clears_a_vision_language_models_eos_and_restores_it(tmp_path):
    import torch

    from worker.bench.common import eos_ignored
    from worker.bench.qwen_vl_checkpoint import random_qwen2_5_vl

    model = random_qwen2_5_vl("tiny", tmp_path, torch.device("cpu"), torch.float32)
    text, generation = model.config.get_text_config(), model.generation_config
    before = text.eos_token_id, generation.eos_token_id
    assert before[0] is not None and before[1]
    with eos_ignored(model):  # generate falls back to both: both cleared
        assert text.eos_token_id is None and generation.eos_token_id is None
    assert (text.eos_token_id, generation.eos_token_id) == before


def test_bench_vision_encoder_times_both_attentions_on_the_cpu(tmp_path):
    """`bench vision-encoder` at the tiny shape: both implementations timed on the same pictures, their outputs
    equal in fp32, the command spelled out."""
    out = tmp_path / "encoder.json"
    args = [
        "vision-encoder",
        "--shape",
        "tiny",
        "--images",
        "3",
        "--batches",
        "2",
        "--image-size",
        "256",
        "192",
    ]
    args += ["--device", "cpu", "--json-out", str(out)]
    result = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "packed / sdpa speed-up" in result.output
    report = json.loads(out.read_text())
    assert report["command"].startswith("cbq bench vision-encoder --shape tiny --images 3 --batches 2")
    assert "--image-size 256 192" in report["command"]
    (row,) = report["rows"]
    assert row["dtype"] == "float32" and row["images_per_call"] == 3 and row["calls"] == 2
    assert row["patches_per_image"] > 64  # more than one window an image at the tiny shape's window size
    for name in ("sdpa", "packed"):
        assert row[name]["ms_per_image"] > 0
        assert row[name]["images_per_s"] == pytest.approx(6 / row[name]["seconds"])
    assert row["speedup"] == pytest.approx(row["sdpa"]["seconds"] / row["packed"]["seconds"])
    assert row["max_abs_diff"] < 1e-4 and row["relative_diff"] < 1e-5  # fp32: the same attention
    assert row["host_processing_ms_per_image"] > 0
