"""The fault soak, short (benchmarks/reliability.py --soak runs it for minutes): two workers, every kind of
fault in turn (worker SIGKILL, Redis kill and restart, Redis paused, lost replies, queue entries that are not
UTF-8), then every invariant."""

from __future__ import annotations

import shutil

import pytest

from tests.reliability.soak import FAULTS, Soak, SoakConfig


def test_a_short_fault_soak_loses_nothing_and_counts_exactly(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    config = SoakConfig(
        seconds=20,  # every kind comes by 19.2 s at the latest (faults 2-2.5 s apart, outages at most 2 s)
        seed=31,
        requests_per_batch=120,
        chunk_size=15,
        fault_every=(2.0, 2.5),
        outage_seconds=(0.5, 2.0),
        fake_latency_seconds=0.2,
        max_num_seqs=60,
        drain_timeout_seconds=90,  # recovery after the last fault takes seconds; a loaded 2-core box, more
        cycle_faults=True,
    )
    report = Soak(tmp_path, config).run()
    summary = report.as_dict()
    assert set(report.faults) == set(FAULTS), summary
    assert report.replies_lost > 0 and report.batches >= 2, summary
    assert report.unfinished_batches == 0, summary
    assert (report.lost, report.duplicated, report.counter_drift) == (0, 0, 0), summary
    assert report.completed == report.requests, summary
    assert report.status_failures == [] and report.status_reads > 0, summary
    assert report.poison_pushed > 0 and report.poison_quarantined == report.poison_pushed, summary
    assert report.poison_left == 0 and report.ok, summary
