"""Engine tuning flags of `cbq worker` / `cbq run` reach the engine's config."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from worker.cli import build_engine
from worker.cli_options import engine_tuning_options


def test_tuning_flags_are_gathered_into_engine_config():
    seen = {}

    @click.command()
    @engine_tuning_options
    def cmd(engine_config):
        seen.update(engine_config)

    result = CliRunner().invoke(cmd, ["--max-num-seqs", "3", "--max-num-batched-tokens", "64"])
    assert result.exit_code == 0, result.output
    assert seen == {"max_num_seqs": 3, "max_num_batched_tokens": 64}
    assert CliRunner().invoke(cmd, ["--max-num-seqs", "0"]).exit_code != 0
    seen.clear()
    assert CliRunner().invoke(cmd, ["--no-prefix-caching"]).exit_code == 0
    assert seen == {"enable_prefix_caching": False}
    seen.clear()
    assert CliRunner().invoke(cmd, ["--deterministic"]).exit_code == 0
    assert seen == {"deterministic": True}


def test_build_engine_applies_the_overrides():
    engine = build_engine(
        "tiny-llama", "sync", "cpu", False, {"max_num_seqs": 3, "max_num_batched_tokens": 64}
    )
    assert (engine.config.mode, engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (
        "sync",
        3,
        64,
    )


def test_quantization_flags_reach_the_engine():
    seen = {}

    @click.command()
    @engine_tuning_options
    def cmd(engine_config):
        seen.update(engine_config)

    assert CliRunner().invoke(cmd, ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]).exit_code == 0
    assert seen == {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert CliRunner().invoke(cmd, ["--quantization", "awq"]).exit_code != 0  # click names the choices
    engine = build_engine(
        "tiny-llama", "sync", "cpu", False, {"quantization": "fp8", "kv_cache_dtype": "fp8", "num_kv_blocks": 64}
    )
    assert (engine.config.quantization, engine.config.kv_cache_dtype) == ("fp8", "fp8")
    assert str(engine.runner.kv_caches[0][0].dtype) == "torch.float8_e4m3fn"


def test_deterministic_reaches_the_engine_and_bench_engine_runs_both_modes():
    from worker.bench.engine import engine_bench

    engine = build_engine("tiny-llama", "sync", "cpu", False, {"deterministic": True})
    assert engine.config.deterministic and engine.runner.decoder is not None
    assert "--deterministic" in CliRunner().invoke(engine_bench, ["--help"]).output


def test_tensor_parallel_size_reaches_the_engine_config_and_what_it_cannot_run_is_one_line():
    seen = {}

    @click.command()
    @engine_tuning_options
    def cmd(engine_config):
        seen.update(engine_config)

    assert CliRunner().invoke(cmd, ["-tp", "2"]).exit_code == 0
    assert seen == {"tensor_parallel_size": 2}
    assert CliRunner().invoke(cmd, ["--tensor-parallel-size", "0"]).exit_code != 0
    # tensor parallelism runs the owned decoder only: transformers' forward under it is refused in one line
    with pytest.raises(click.ClickException, match="tensor parallelism: .*owned decoder") as info:
        build_engine("tiny-llama", "sync", "cpu", False, {"tensor_parallel_size": 2, "decoder": "hf"})
    assert "\n" not in info.value.message


def test_decoder_hf_with_a_longrope_model_is_one_line():
    refusal = "cannot start the engine: decoder 'hf' cannot run longrope"
    with pytest.raises(click.ClickException, match=refusal) as info:
        build_engine("tiny-phi3-longrope", "sync", "cpu", False, {"decoder": "hf"})
    assert "\n" not in info.value.message
