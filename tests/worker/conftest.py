"""Helpers for the queue-worker tests: the `cbq` CLI bound to the test's Redis, and a burst-worker runner."""

from __future__ import annotations

import json
import signal

import pytest
from click.testing import CliRunner

from producer import settings
from producer.cli import main
from worker.fake_engine import FakeEngine
from worker.queue_worker import CbqWorker


@pytest.fixture
def cbq(conn, monkeypatch):
    """Run `cbq ARGS...` in-process against the test's Redis (whatever --redis-url says)."""
    monkeypatch.setattr(settings, "connect", lambda url, **options: conn)
    runner = CliRunner()

    def invoke(*args, input=None):
        return runner.invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)

    return invoke


def run_burst_worker(conn, engine=None, queue="cbq", **kwargs) -> CbqWorker:
    """Run a CbqWorker in burst mode in this thread; restores the signal handlers rq installs."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    kwargs.setdefault("model_name", "fake")
    worker = CbqWorker([queue], engine or FakeEngine(), connection=conn, **kwargs)
    try:
        worker.work(burst=True, logging_level="WARNING")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return worker


@pytest.fixture
def restore_signal_handlers():
    """Puts back the SIGINT/SIGTERM handlers that a worker run in this process (rq) replaced."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture
def burst_worker(conn):
    """run_burst_worker on the test's Redis."""

    def run(engine=None, queue="cbq", **kwargs) -> CbqWorker:
        return run_burst_worker(conn, engine, queue, **kwargs)

    return run


@pytest.fixture
def write_jsonl(tmp_path):
    """write_jsonl(objs, name) -> path of a JSONL file with one line per object (strings go in verbatim)."""

    def write(objs, name="in.jsonl") -> str:
        path = tmp_path / name
        path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
        return str(path)

    return write
