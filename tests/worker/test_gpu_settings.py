"""GPU settings (vLLM's flag names) reach the engine, the KV budget arithmetic, the startup description, the
worker's log lines (per-chunk at DEBUG, a periodic summary at INFO), and the model-name check."""

from __future__ import annotations

import io
import logging
import re
import time

import click
import pytest
from click.testing import CliRunner

from producer.cli import main
from worker.cli import build_engine
from worker.cli_options import engine_tuning_options, gpu_memory_options
from worker.engine.kv_cache import ACTIVATION_RESERVE_BYTES, kv_budget_bytes
from worker.fake_engine import FakeEngine
from worker.model_names import UnknownModel, check_model_name
from worker.worker_log import RQ_LOGGER, PeriodicSummary, demote_per_chunk_lines, describe_engine

GIB = 1 << 30
PRESETS = ["tiny-llama", "tiny-qwen3", "small-llama"]


def gathered(decorator, args: list[str]) -> tuple[int, dict, str]:
    seen: dict = {}

    @click.command()
    @decorator
    def cmd(engine_config):
        seen.update(engine_config)

    result = CliRunner().invoke(cmd, args)
    return result.exit_code, seen, result.output


def test_gpu_flags_are_gathered_under_vllm_names():
    args = ["--gpu-memory-utilization", "0.5", "--max-model-len", "256", "--num-gpu-blocks-override", "40"]
    code, seen, output = gathered(gpu_memory_options, args)
    assert code == 0, output
    assert seen == {"gpu_memory_utilization": 0.5, "max_model_len": 256, "num_kv_blocks": 40}
    code, seen, _ = gathered(engine_tuning_options, ["--num-kv-blocks", "8", "--max-num-seqs", "2"])
    assert seen == {"num_kv_blocks": 8, "max_num_seqs": 2}
    assert gathered(gpu_memory_options, ["--gpu-memory-utilization", "1.5"])[0] == 2
    assert gathered(gpu_memory_options, ["--gpu-memory-utilization", "0"])[0] == 2
    for command in (["worker", "--help"], ["run", "--help"], ["bench", "engine", "--help"]):
        help_text = CliRunner().invoke(main, command).output
        for flag in ("--gpu-memory-utilization", "--max-model-len", "--num-kv-blocks"):
            assert flag in help_text, (command, flag)


def test_the_kv_budget_is_the_engines_share_of_the_device_less_what_is_in_use():
    # 100 GiB device, 20 GiB in use (weights + others): 90 GiB allowed, 70 left, less the activation reserve
    assert kv_budget_bytes(100 * GIB, 80 * GIB, 0.9) == 70 * GIB - ACTIVATION_RESERVE_BYTES
    assert kv_budget_bytes(100 * GIB, 80 * GIB, 0.5) == 30 * GIB - ACTIVATION_RESERVE_BYTES
    assert kv_budget_bytes(100 * GIB, 80 * GIB, 0.2) < 0  # already over its share


def test_build_engine_applies_gpu_settings_and_describes_the_engine():
    engine = build_engine("tiny-llama", "sync", "cpu", False, {"max_model_len": 64, "num_kv_blocks": 40})
    assert (engine.max_model_len, engine.runner.num_kv_blocks) == (64, 40)
    line = describe_engine(engine, "tiny-llama", "tiny-llama")
    usable_tokens = engine.blocks.num_usable_blocks * 16
    assert line.startswith(
        "engine: model tiny-llama, served as tiny-llama, cpu, float32, transformers decoder"
    )
    assert f"KV cache {engine.blocks.num_usable_blocks} blocks = {usable_tokens} tokens" in line
    assert f"context 64 tokens, {usable_tokens / 64:.1f} requests at full context" in line
    assert describe_engine(FakeEngine(), "x", "fake") == "engine: FakeEngine (no model), served as fake"


def test_a_kv_cache_that_does_not_fit_is_one_clear_error():
    with pytest.raises(
        click.ClickException, match="cannot start the engine: no room for the KV cache on cpu"
    ):
        build_engine("tiny-llama", "sync", "cpu", False, {"kv_cache_bytes_cpu": 1024})


def test_per_chunk_lines_go_to_debug_and_a_summary_goes_to_info():
    logger = logging.getLogger(RQ_LOGGER)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    demote_per_chunk_lines()
    try:
        logger.setLevel(logging.INFO)
        logger.info("Successfully completed cbq chunk b[0:64] job in 0:00:01s on worker w")
        logger.info("Worker w: queues empty")
        logger.setLevel(logging.DEBUG)
        logger.info("Successfully completed cbq chunk b[64:128] job in 0:00:01s on worker w")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert stream.getvalue().splitlines() == [
        "INFO Worker w: queues empty",
        "DEBUG Successfully completed cbq chunk b[64:128] job in 0:00:01s on worker w",
    ]

    class Worker:  # what the summary reads of a CbqWorker
        name, engine, num_requests_finished, num_jobs_finished = "w", FakeEngine(), 0, 0

    worker = Worker()
    summary = PeriodicSummary(worker, interval_seconds=60)
    worker.num_requests_finished, worker.num_jobs_finished = 130, 3
    time.sleep(0.01)
    line = summary.line()
    assert (
        line.startswith("Worker w: last 0 s: 130 requests in 3 chunks finished, ")
        and "0 running, 0 waiting" in line
    )
    assert "130 requests" not in summary.line()  # the next line counts from here


def test_model_names_that_cannot_name_a_model_fail_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "llama-8b").mkdir(parents=True)
    check_model_name("tiny-llama", PRESETS)
    check_model_name("models/llama-8b", PRESETS)
    check_model_name("meta-llama/Llama-3.1-8B-Instruct", PRESETS)  # a hub id: left to the hub
    with pytest.raises(UnknownModel, match="unknown model 'tiny-lama': .*; did you mean tiny-llama\\?"):
        check_model_name("tiny-lama", PRESETS)
    with pytest.raises(
        UnknownModel, match="no such checkpoint folder: models/llama-7b; did you mean models/llama-8b"
    ):
        check_model_name("models/llama-7b", PRESETS)
    with pytest.raises(UnknownModel, match="no such checkpoint folder: ./nope$"):
        check_model_name("./nope", PRESETS)

    started = time.monotonic()
    result = CliRunner().invoke(
        main, ["run", "-", "-o", str(tmp_path / "o.jsonl"), "--model", "tiny-lama"], input='{"prompt": "a"}\n'
    )
    assert result.exit_code == 1 and "did you mean tiny-llama?" in result.stderr
    assert list(tmp_path.glob("o.jsonl*")) == []  # no journal started for it
    assert time.monotonic() - started < 10  # no hub retries (they took 26 s)


@pytest.mark.redis_server
@pytest.mark.parametrize("log_level", ["INFO", "DEBUG"])
def test_a_worker_logs_its_engine_then_summaries_and_chunk_lines_only_at_debug(
    real_redis, private_redis_url, tmp_path, log_level
):
    """`cbq worker` as a process: the startup line, the periodic summary at INFO, rq's line per chunk at DEBUG."""
    import subprocess
    import sys
    from pathlib import Path

    from producer.client import Client

    Client(connection=real_redis).submit(
        [{"prompt": f"p{i}"} for i in range(24)], chunk_size=4, max_new_tokens=2
    )
    args = [
        "--burst",
        "--fake-engine",
        "--fake-latency",
        "0.1",
        "--max-num-seqs",
        "4",
        "--summary-interval",
        "0.2",
    ]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "producer.cli",
            "worker",
            *args,
            "--log-level",
            log_level,
            "--redis-url",
            private_redis_url,
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.startswith("engine: FakeEngine (no model), served as tiny-llama")  # the fake engine serves --model's name
    log = done.stdout + done.stderr
    summaries = re.findall(r"last \d+ s: (\d+) requests in (\d+) chunks finished", log)
    assert summaries and sum(int(n) for n, _ in summaries) <= 24
    assert ("Successfully completed" in log) == (log_level == "DEBUG")
