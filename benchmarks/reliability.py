"""Fault injection at scale (issue 10): worker kills, Redis outages and poison inputs against real processes.

    python benchmarks/reliability.py [--requests 1600] [--outages 3,60] [--json-out benchmarks/reliability.json]
    python benchmarks/reliability.py --soak 600 [--seed 0] [--workers 2] [--slow-clients 4] [--sentinel [--wait-replicas 1]] [--json-out ...]

`--soak SECONDS` runs the fault soak instead (issue 31; `tests/reliability/soak.py`): batches keep flowing
through `--workers` worker processes while a seeded random schedule SIGKILLs workers, kills and restarts Redis,
pauses it, loses the replies of applied transactions through a TCP proxy and pushes queue entries that are not
UTF-8, while `--slow-clients` slow-body clients hold a `cbq serve` on the same Redis busy; then it checks that
every request has exactly one result, the counters equal the result lines, no status read failed, every
poison entry was quarantined, the server ended every slow-body client by its body timeout and answered every
health probe. `--sentinel`: Redis is a primary, a replica and three Sentinels, and its faults are failovers
(the primary SIGKILLed, the old primary back as a replica).

Each scenario starts its own redis-server (append-only file, fsync always) on a free port and real `cbq worker`
processes (the instant fake engine with a fixed per-request latency, so a batch stays in flight long enough to
be hit). Workers run with the default recovery settings (heartbeat 10 s, stale after 40 s, cleanup every 15 s,
outage limit 300 s). For every batch it checks exactly-once completion: lost = requests without a completed
result line, duplicated = counted outcomes beyond the result lines.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rq.job import Job  # noqa: E402
from rq.queue import Queue  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from producer import store  # noqa: E402
from producer.store import SubmitOptions, submit_batch, validate_lines  # noqa: E402
from schemas import keys  # noqa: E402
from tests.reliability.harness import RedisServer, WorkerProcess, wait_until  # noqa: E402
from tests.reliability.soak import Soak, SoakConfig  # noqa: E402

LATENCY = ("--fake-engine", "--fake-latency", "2", "--max-num-seqs", "256")


def submit(conn, n: int, prefix: str, **options) -> str:
    lines = [json.dumps({"custom_id": f"{prefix}{i}", "prompt": f"prompt {i}"}) for i in range(n)]
    return submit_batch(conn, validate_lines(lines).requests, SubmitOptions(queue="cbq", **options)).batch_id


def audit(conn, batch_id: str, n: int) -> dict:
    lines = list(store.iter_results(conn, batch_id, partial=True))
    status = store.get_status(conn, batch_id)
    completed = sum(1 for line in lines if line.finish_reason in ("stop", "length"))
    return {
        "requests": n,
        "completed": completed,
        "failed": status.num_failed,
        "lost": n - len(lines),
        "duplicated": status.num_finished - len(lines),
    }


def _chunks_in_flight(conn, batch_id: str) -> dict[str, bytes]:
    """Chunk job id -> the worker running it, for the chunks with requests inside an engine."""
    running = [j.decode() for j, n in conn.hgetall(keys.batch_running(batch_id)).items() if int(n) > 0]
    return {job_id: conn.hget(Job.key_for(job_id), "worker_name") for job_id in running}


def _all_taken_again(conn, orphans: dict[str, bytes]) -> bool:
    """Every orphaned chunk is finished, or started again by another worker."""
    for job_id, dead_worker in orphans.items():
        status, worker = conn.hmget(Job.key_for(job_id), ["status", "worker_name"])
        if status != b"finished" and (status != b"started" or worker == dead_worker):
            return False
    return True


def progress(conn, batch_id: str) -> int:
    return store.get_status(conn, batch_id).num_finished


class Scenario:
    def __init__(self, root: Path, name: str):
        self.dir = root / name
        self.dir.mkdir()
        self.redis = RedisServer(self.dir)
        self.redis.start()
        self.conn = self.redis.connect()
        self.workers: list[WorkerProcess] = []

    def worker(self, *args: str) -> WorkerProcess:
        w = WorkerProcess(self.redis.url, self.dir / f"worker{len(self.workers)}.log", *args)
        self.workers.append(w)
        return w

    def close(self) -> None:
        for w in self.workers:
            w.kill()
            w.wait()
        self.redis.kill()


def kill_worker(root: Path, n: int, successor_delay: float) -> dict:
    """SIGKILL the worker once a quarter of the batch is done; start the next one `successor_delay` s later."""
    s = Scenario(root, f"kill_worker_{int(successor_delay)}s")
    try:
        batch_id = submit(s.conn, n, "k")
        first = s.worker(*LATENCY)
        wait_until(lambda: progress(s.conn, batch_id) >= n // 4, timeout=120)
        first.kill(signal.SIGKILL)
        killed_at = time.monotonic()
        orphans = _chunks_in_flight(s.conn, batch_id)
        time.sleep(successor_delay)
        s.worker(*LATENCY)
        wait_until(lambda: _all_taken_again(s.conn, orphans), timeout=300, interval=0.1)
        rerun_after = time.monotonic() - killed_at
        wait_until(lambda: store.get_status(s.conn, batch_id).is_done, timeout=300, interval=0.1)
        return {
            "scenario": f"worker SIGKILL, successor after {successor_delay:g} s",
            "kills": 1,
            "chunks_orphaned": len(orphans),
            "seconds_until_orphans_run_again": round(rerun_after, 1),
            "seconds_to_batch_done": round(time.monotonic() - killed_at, 1),
            **audit(s.conn, batch_id, n),
        }
    finally:
        s.close()


def redis_outage(root: Path, n: int, outage_seconds: float) -> dict:
    """SIGKILL Redis with the batch in flight; restart it (same AOF) `outage_seconds` later."""
    s = Scenario(root, f"redis_outage_{int(outage_seconds)}s")
    try:
        batch_id = submit(s.conn, n, "r")
        worker = s.worker(*LATENCY)
        wait_until(lambda: progress(s.conn, batch_id) >= n // 4, timeout=120)
        s.redis.kill()
        time.sleep(outage_seconds)
        s.redis.start()
        back_at = time.monotonic()
        wait_until(lambda: store.get_status(s.conn, batch_id).is_done, timeout=300, interval=0.1)
        return {
            "scenario": f"Redis SIGKILL, restarted after {outage_seconds:g} s",
            "outages": 1,
            "worker_survived": worker.proc.poll() is None,
            "seconds_to_batch_done_after_restart": round(time.monotonic() - back_at, 1),
            **audit(s.conn, batch_id, n),
        }
    finally:
        s.close()


def poison(root: Path, n: int) -> dict:
    """Undecodable and forged chunk jobs next to a good batch, and a file of bad lines."""
    s = Scenario(root, "poison")
    try:
        bad_batch = submit(s.conn, 70, "p", chunk_size=10, retries=0)
        jobs = [keys.chunk_job_id(bad_batch, c) for c in range(7)]
        raw = zlib.decompress(s.conn.hget(Job.key_for(jobs[5]), "data"))
        func, instance, args, kwargs = json.loads(raw)
        forged = json.dumps([func, instance, args, {**kwargs, "start": 0, "stop": 10**9}]).encode()
        s.conn.hset(Job.key_for(jobs[0]), "data", zlib.compress(b"\x80\x04pickled"))
        s.conn.hset(Job.key_for(jobs[1]), "data", b"{not json")
        s.conn.hset(Job.key_for(jobs[2]), "created_at", "yesterday")
        s.conn.hset(Job.key_for(jobs[3]), "timeout", "soon")
        s.conn.hset(Job.key_for(jobs[4]), "status", "bogus")
        s.conn.hset(Job.key_for(jobs[5]), "data", zlib.compress(forged))
        queue = Queue("cbq", connection=s.conn, serializer=JSONSerializer)
        s.conn.lrem(queue.key, 0, jobs[6])
        s.conn.hset(Job.key_for(jobs[6]), mapping={"status": "started", "created_at": "not a date"})
        s.conn.zadd(queue.started_job_registry.key, {f"{jobs[6]}:dead": 1})
        good = submit(s.conn, n, "g")
        bad_lines = [
            b'{"prompt": "caf\xe9"}',
            b'{"prompt": "x", "max_new_tokens": ' + b"7" * 5000 + b"}",
            b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            b'{"prompt": "\\ud800"}',
            b'{"prompt": "x", "top_k": 2147483648}',
        ]
        line_errors = validate_lines(bad_lines).errors
        started = time.monotonic()
        first, second = s.worker(*LATENCY, "--burst"), s.worker(*LATENCY, "--burst")
        exits = [first.wait(300), second.wait(300)]
        failed_jobs = queue.failed_job_registry.get_job_ids()
        return {
            "scenario": "7 poison chunk jobs + 5 bad input lines, 2 workers",
            "poison_jobs": len(jobs),
            "poison_jobs_in_failed_registry": len(set(failed_jobs) & set(jobs)),
            "bad_lines_rejected_with_line_numbers": sum(1 for e in line_errors if str(e).startswith("line ")),
            "worker_exit_codes": exits,
            "seconds": round(time.monotonic() - started, 1),
            **audit(s.conn, good, n),
        }
    finally:
        s.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1600)
    parser.add_argument("--outages", default="3,60", help="Redis outage lengths in seconds, comma-separated")
    parser.add_argument(
        "--successor-delays", default="0,45", help="seconds between a kill and the next worker"
    )
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--soak", type=float, metavar="SECONDS", help="run the fault soak for this long instead")
    parser.add_argument("--seed", type=int, default=0, help="of the soak's fault schedule")
    parser.add_argument("--workers", type=int, default=2, help="worker processes in the soak")
    parser.add_argument(
        "--slow-clients", type=int, default=4, help="slow-body clients at a time against cbq serve (0: no server)"
    )
    parser.add_argument("--sentinel", action="store_true", help="soak a Sentinel deployment through failovers")
    parser.add_argument(
        "--wait-replicas", type=int, default=0, help="the soak's workers' --redis-wait-replicas (0: off)"
    )
    args = parser.parse_args()
    if args.soak:
        with tempfile.TemporaryDirectory() as tmp:
            config = SoakConfig(
                seconds=args.soak,
                seed=args.seed,
                num_workers=args.workers,
                slow_clients=args.slow_clients,
                sentinel=args.sentinel,
                wait_replicas=args.wait_replicas,
            )
            report = Soak(Path(tmp), config).run().as_dict()
        report = {"scenario": "fault soak", "config": config.__dict__, **report}
        print(json.dumps(report), flush=True)
        if args.json_out:
            args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for delay in (float(d) for d in args.successor_delays.split(",")):
            rows.append(kill_worker(root, args.requests, delay))
            print(json.dumps(rows[-1]), flush=True)
        for outage in (float(o) for o in args.outages.split(",")):
            rows.append(redis_outage(root, args.requests, outage))
            print(json.dumps(rows[-1]), flush=True)
        rows.append(poison(root, args.requests))
        print(json.dumps(rows[-1]), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
