"""The fault soak, short (benchmarks/reliability.py --soak runs it for minutes): two workers, every kind of
fault in turn (worker SIGKILL, Redis kill and restart, Redis paused, lost replies, queue entries that are not
UTF-8), a `cbq serve` held busy by slow-body clients throughout, then every invariant; and the same with Redis
behind Sentinel, whose faults are failovers, and workers whose result writes wait for the replica."""

from __future__ import annotations

import shutil

import pytest

from tests.reliability.soak import FAULTS, SENTINEL_FAULTS, Soak, SoakConfig


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
        slow_clients=3,
        serve_body_timeout_seconds=2.0,
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
    assert report.poison_left == 0, summary
    assert report.slow_clients_ended >= 3 and report.slow_client_failures == [], summary
    assert report.health_probes > 0 and report.health_failures == [], summary
    assert report.ok, summary


def test_a_short_soak_through_sentinel_failovers_loses_nothing(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    config = SoakConfig(
        seconds=20,  # a failover takes 2-5 s here (down after 1 s, then the old primary back in sync)
        seed=44,
        requests_per_batch=120,
        chunk_size=15,
        fault_every=(2.0, 2.5),
        outage_seconds=(0.5, 1.0),
        fake_latency_seconds=0.2,
        max_num_seqs=60,
        drain_timeout_seconds=90,
        cycle_faults=True,
        slow_clients=2,
        serve_body_timeout_seconds=2.0,
        sentinel=True,
        wait_replicas=1,  # durable result writes across the failovers (a second at most while no replica is up)
    )
    report = Soak(tmp_path, config).run()
    summary = report.as_dict()
    assert set(report.faults) == set(SENTINEL_FAULTS) and report.batches >= 2, summary
    assert report.unfinished_batches == 0 and report.completed == report.requests, summary
    assert (report.lost, report.duplicated, report.counter_drift) == (0, 0, 0), summary
    assert report.status_failures == [] and report.poison_quarantined == report.poison_pushed > 0, summary
    assert report.slow_client_failures == [] and report.health_failures == [], summary
    assert report.ok, summary
