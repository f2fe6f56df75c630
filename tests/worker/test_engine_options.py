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


def test_vllm_spellings_of_engine_flags():
    """vLLM's flags where cbq means the same: listed in --help, mapped onto the same config fields."""
    seen = {}

    @click.command()
    @engine_tuning_options
    def cmd(engine_config):
        seen.clear()
        seen.update(engine_config)

    def config(*args):
        result = CliRunner().invoke(cmd, list(args))
        assert result.exit_code == 0, result.output
        return dict(seen)

    assert config("--dtype", "half") == {"dtype": "float16"}
    assert config("--dtype", "float") == {"dtype": "float32"}
    assert config("--dtype", "bfloat16") == {"dtype": "bfloat16"}
    assert config("--enforce-eager") == {"use_cuda_graphs": False}
    assert config("--no-enable-prefix-caching") == {"enable_prefix_caching": False}
    assert config("--enable-prefix-caching") == {"enable_prefix_caching": True}
    assert config("--no-prefix-caching") == {"enable_prefix_caching": False}
    assert config() == {}
    help_text = CliRunner().invoke(cmd, ["--help"]).output
    assert "--enforce-eager" in help_text and "--enable-prefix-caching / --no-enable-prefix-caching" in help_text


def engine_flags_of(*args):
    """(exit code, stderr, engine_config, served name, chat template) of `engine_options` given `args`."""
    from worker.cli_options import engine_options

    seen = {}

    @click.command()
    @engine_options
    def cmd(model, mode, device, fake_engine, engine_config, served_model_name_):
        seen.update(engine_config=engine_config, served=served_model_name_)

    result = CliRunner().invoke(cmd, list(args))
    return result.exit_code, result.stderr, seen


def test_inline_chat_template_file_tokenizer_revision_and_remote_code(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    code, _, seen = engine_flags_of("--chat-template", template)
    assert code == 0 and seen["engine_config"]["chat_template"] == template
    path = tmp_path / "t.jinja"
    path.write_text(template)
    code, _, seen = engine_flags_of("--chat-template", str(path))
    assert code == 0 and seen["engine_config"]["chat_template"] == template
    code, stderr, _ = engine_flags_of("--chat-template", str(tmp_path / "missing.jinja"))
    assert code == 2 and "neither a file nor a Jinja template" in stderr

    assert engine_flags_of("--tokenizer", "tiny-llama", "--model", "tiny-llama")[0] == 0
    assert engine_flags_of("--tokenizer", "tiny-llama")[0] == 0  # the default model
    code, stderr, _ = engine_flags_of("--tokenizer", "org/other", "--model", "tiny-llama")
    assert code == 1 and stderr.count("\n") == 1 and "cbq loads the tokenizer of --model (tiny-llama)" in stderr
    assert engine_flags_of("--revision", "main")[0] == 0
    code, stderr, _ = engine_flags_of("--revision", "v2.0")
    assert code == 1 and stderr.count("\n") == 1 and "--local-dir DIR) and pass --model DIR" in stderr
    code, stderr, _ = engine_flags_of("--trust-remote-code")
    assert code == 1 and stderr.count("\n") == 1 and "never runs a checkpoint's own code" in stderr  # one line
    assert "llama" in stderr and "qwen3" in stderr


def test_served_model_name_once_or_refused():
    assert engine_flags_of("--served-model-name", "a")[2]["served"] == "a"
    assert engine_flags_of("--served-model-name", "a", "--served-model-name", "a")[2]["served"] == "a"
    assert engine_flags_of()[2]["served"] is None
    code, stderr, _ = engine_flags_of("--served-model-name", "a", "--served-model-name", "b")
    assert code == 2 and "given 2 names (a, b): a worker serves one model name" in stderr
