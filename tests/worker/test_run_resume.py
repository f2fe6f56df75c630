"""`cbq run` on long jobs: results journaled beside the output as they finish, a run killed with SIGKILL resumed
by the same command (every request exactly once, in input order), a changed input or changed settings refused
unless --fresh, and the progress line."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from producer.cli import main
from schemas.result import ResultLine, Usage
from worker.run_journal import JOURNAL_SUFFIX, Journal, JournalMismatch
from worker.run_progress import RunProgress

REPO = Path(__file__).resolve().parents[2]
NUM_REQUESTS = 120
# The fake engine holds 4 requests at a time for 0.1 s each: 120 requests take about 3 s, long enough to kill
# the run in the middle and short enough for a test.
SLOW = ["--fake-engine", "--fake-latency", "0.1", "--max-num-seqs", "4", "--chunk-size", "8"]
FAST = ["--fake-engine", "--chunk-size", "8"]


pytestmark = pytest.mark.usefixtures("restore_signal_handlers")  # rq installs its own


@pytest.fixture
def input_file(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    lines = [
        {"custom_id": f"r{i}", "prompt": f"prompt {i}", "max_new_tokens": 4} for i in range(NUM_REQUESTS)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run_cbq(*args):
    return CliRunner().invoke(main, ["run", *map(str, args)])


def journal_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_a_run_killed_with_sigkill_resumes_and_writes_every_request_once(input_file, tmp_path):
    out = tmp_path / "out.jsonl"
    journal = Path(str(out) + JOURNAL_SUFFIX)
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "run", str(input_file), "-o", str(out), *SLOW],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while journal_lines(journal) < 1 + 30 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, (
            f"the run ended before it was killed: {proc.stderr.read().decode()[-2000:]}"
        )
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()  # -o is only written at the end
    num_journaled = journal_lines(journal) - 1  # the header
    assert 30 <= num_journaled < NUM_REQUESTS

    result = run_cbq(input_file, "-o", out, *FAST)
    assert result.exit_code == 0, result.output
    assert f"{num_journaled} done by the interrupted run" in result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"r{i}" for i in range(NUM_REQUESTS)]
    assert [line["index"] for line in lines] == list(range(NUM_REQUESTS))
    assert all(line["text"] == f"prompt {i}"[:4] for i, line in enumerate(lines))
    assert f"completed {NUM_REQUESTS} " in result.stderr
    assert not journal.exists()  # removed after success


def test_ctrl_c_exits_130_leaves_no_output_and_resumes(input_file, tmp_path):
    out = tmp_path / "out.jsonl"
    journal = Path(str(out) + JOURNAL_SUFFIX)
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "run", str(input_file), "-o", str(out), *SLOW],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while journal_lines(journal) < 1 + 20 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before Ctrl-C: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGINT)
        stderr = proc.communicate(timeout=60)[1].decode()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted by SIGINT before the batch finished" in stderr
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))  # no partial output at the final path
    num_journaled = journal_lines(journal) - 1
    assert 20 <= num_journaled < NUM_REQUESTS and f"{num_journaled} of {NUM_REQUESTS} results are kept" in stderr

    result = run_cbq(input_file, "-o", out, *FAST)
    assert result.exit_code == 0, result.output
    assert f"{num_journaled} done by the interrupted run" in result.stderr
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == list(range(NUM_REQUESTS))


def interrupted_journal(input_file: Path, out: Path, num_kept: int, monkeypatch) -> Path:
    """The journal a run leaves when killed after `num_kept` results: a finished run's (kept, not removed),
    cut after its first `num_kept` results."""
    journal = Path(str(out) + JOURNAL_SUFFIX)
    with monkeypatch.context() as patch:
        patch.setattr(Journal, "remove", Journal.close)
        result = run_cbq(input_file, "-o", out, *FAST)
    assert result.exit_code == 0, result.output
    out.unlink()
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(lines[: 1 + num_kept]))
    return journal


def test_a_torn_last_line_is_redone(input_file, tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    journal = interrupted_journal(input_file, out, 10, monkeypatch)
    with journal.open("a") as f:
        f.write('{"custom_id": "r10", "index": 10, "te')  # the kill hit in the middle of a write
    result = run_cbq(input_file, "-o", out, *FAST)
    assert result.exit_code == 0, result.output
    assert "10 done by the interrupted run" in result.stderr
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == list(range(NUM_REQUESTS))


def test_a_changed_input_or_other_settings_are_refused_unless_fresh(input_file, tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    journal = interrupted_journal(input_file, out, 10, monkeypatch)
    before = journal.read_bytes()

    other_settings = run_cbq(input_file, "-o", out, *FAST, "--max-new-tokens", "2")
    assert other_settings.exit_code == 1
    assert (
        "was written by a run with sampling={}" in other_settings.stderr
        and "--fresh" in other_settings.stderr
    )

    input_file.write_text(input_file.read_text().replace("prompt 7", "prompt seven"))
    changed = run_cbq(input_file, "-o", out, *FAST)
    assert changed.exit_code == 1
    assert "the input changed since the interrupted run" in changed.stderr and "--fresh" in changed.stderr
    assert journal.read_bytes() == before and not out.exists()

    fresh = run_cbq(input_file, "-o", out, *FAST, "--fresh")
    assert fresh.exit_code == 0, fresh.output
    assert "done by the interrupted run" not in fresh.stderr
    assert json.loads(out.read_text().splitlines()[7])["text"] == "prom"
    assert not journal.exists()


def test_a_journal_of_something_else_is_refused(tmp_path):
    path = tmp_path / "x.cbq-journal"
    path.write_text("not a journal\n")
    with pytest.raises(JournalMismatch, match="not a cbq run journal"):
        Journal.open(str(path), "abc", {}, fresh=False)


def test_progress_lines_plain_and_on_a_terminal():
    result = ResultLine(index=0, finish_reason="stop", usage=Usage(completion_tokens=10))
    plain = io.StringIO()
    progress = RunProgress(4, num_done=1, stream=plain, is_tty=False, interval_seconds=0.0)
    progress.update([result])
    progress.update([result])
    progress.finish()
    lines = plain.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in plain.getvalue()
    assert lines[0].startswith("2/4 requests (1 from the earlier run)") and "output tok/s  ETA" in lines[0]
    assert lines[-1].startswith("3/4 requests")

    tty = io.StringIO()
    progress = RunProgress(2, stream=tty, is_tty=True)
    progress.update([result, result])
    progress.finish()
    assert tty.getvalue().startswith("\r\x1b[2K") and tty.getvalue().endswith("ETA 0 s\n")
    assert tty.getvalue().count("\n") == 1


def test_after_a_resume_the_rates_count_only_this_runs_work(input_file, tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    interrupted_journal(input_file, out, 110, monkeypatch)
    # 10 requests left, 4 at a time for 0.2 s each: at least 0.6 s, so at most 10 / 0.6 = 17 req/s here; the
    # 120 results over this run's time would read 120 / 0.6 = 200 req/s or so.
    slow = ["--fake-engine", "--fake-latency", "0.2", "--max-num-seqs", "4", "--chunk-size", "8"]
    result = run_cbq(input_file, "-o", out, *slow)
    assert result.exit_code == 0, result.output
    rate_line = next(line for line in result.stderr.splitlines() if line.startswith("  rate "))
    requests_per_second = float(rate_line.split()[1])
    completion_tok_per_second = float(rate_line.split()[3])
    assert 0 < requests_per_second <= 17, rate_line
    assert 0 < completion_tok_per_second <= 4 * 17, rate_line  # 4 tokens a request
    assert " wall " in rate_line and "device 0." in result.stderr  # the fake engine: no device name


def test_the_eta_waits_for_a_rate_worth_extrapolating():
    now = [100.0]
    result = ResultLine(index=0, finish_reason="stop", usage=Usage(completion_tokens=1))
    progress = RunProgress(1000, stream=io.StringIO(), is_tty=False, interval_seconds=1e9, clock=lambda: now[0])
    now[0] += 5.0  # loading and the first prefills: no results yet
    progress.update([result])
    assert progress.line().endswith("ETA -")  # one early result says nothing about the rate
    now[0] += 1.0
    progress.update([result] * 99)
    assert progress.line().endswith("ETA -")  # still warming up
    now[0] += 2.0  # 3 s since the first result, 99 more done since: 33 a second
    assert progress.line().endswith("ETA 27 s"), progress.line()  # 900 / 33 a second; not 900 * 8 s / 100 = 72 s
    progress.update([result] * 900)
    assert progress.line().endswith("ETA 0 s")
