"""A fault soak (issue 31, item 4): batches flow through two or more `cbq worker` processes while a seeded random
schedule SIGKILLs workers (a replacement starts at once), kills and restarts Redis, pauses it (SIGSTOP),
loses the replies of applied transactions through a TCP proxy, and pushes queue entries that are not UTF-8
(issue 44) onto the head and the tail of the queue. With `slow_clients`, a `cbq serve` runs on the same Redis
throughout, held busy by that many slow-body clients at a time (`tests/reliability/slow_clients.py`). With
`sentinel`, Redis is a primary, a replica and three Sentinels (`tests/reliability/sentinel.py`) that workers,
the server and the soak reach through a `redis+sentinel://` URL, and the Redis faults are failovers instead: the
primary SIGKILLed, a replica promoted, the old primary started again (it comes back as a replica). Used by
`benchmarks/reliability.py --soak` (minutes) and `tests/reliability/test_soak.py` (seconds).

Invariants, checked throughout and at the end: every status read succeeds and reports no inconsistency;
every batch finishes; every request has exactly one result line, completed; the counters equal the sums over
the result lines (counter drift 0); every poison entry pushed was quarantined (a `cbq-bad-id-` placeholder in
the FailedJobRegistry), and none is left in the queue or its intermediate list; with `slow_clients`, the server
ends every slow-body client by its body timeout and answers every health probe (200, or 503 while Redis is
down) between faults.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from producer import settings, store
from producer.store import SubmitOptions, submit_batch, validate_lines
from schemas.keys import BatchField
from tests.producer.server.serving import ServeProcess
from tests.reliability.harness import RedisServer, ReplyDroppingProxy, WorkerProcess, wait_until
from tests.reliability.sentinel import SentinelDeployment
from tests.reliability.slow_clients import SlowBodyClients, probe_health

FAULTS = ("worker_kill", "poison_entries", "redis_restart", "redis_pause", "lost_replies")
SENTINEL_FAULTS = ("worker_kill", "poison_entries", "sentinel_failover")  # one server's faults need its port
RECOVERY_FLAGS = ("--heartbeat-interval", "1", "--stale-after", "4", "--maintenance-interval", "1")
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


@dataclass
class SoakConfig:
    seconds: float  # of faults; then the last batches drain
    seed: int = 0
    num_workers: int = 2
    requests_per_batch: int = 500
    chunk_size: int = 25
    open_batches: int = 2  # a new batch is submitted whenever fewer are unfinished
    fault_every: tuple[float, float] = (5.0, 15.0)  # seconds between faults, uniform
    outage_seconds: tuple[float, float] = (1.0, 8.0)  # Redis down or paused, uniform
    fake_latency_seconds: float = 0.5
    max_num_seqs: int = 200
    drain_timeout_seconds: float = 180.0
    cycle_faults: bool = False  # each kind in turn (short runs that must see every kind), else seeded choice
    slow_clients: int = 0  # slow-body clients at a time against a `cbq serve` (0: no server)
    serve_body_timeout_seconds: float = 3.0
    sentinel: bool = False  # a Sentinel deployment and failovers instead of one server and its faults
    wait_replicas: int = 0  # the workers' --redis-wait-replicas (durable result writes; 0: off)

    @property
    def faults(self) -> tuple[str, ...]:
        return SENTINEL_FAULTS if self.sentinel else FAULTS


@dataclass
class SoakReport:
    seconds: float = 0.0
    faults: Counter[str] = field(default_factory=Counter)
    replies_lost: int = 0
    batches: int = 0
    requests: int = 0
    completed: int = 0
    lost: int = 0
    duplicated: int = 0
    counter_drift: int = 0
    status_reads: int = 0
    status_failures: list[str] = field(default_factory=list)
    unfinished_batches: int = 0
    poison_pushed: int = 0  # queue entries that are not UTF-8
    poison_quarantined: int = 0
    poison_left: int = 0  # still in the queue or its intermediate list at the end
    slow_clients_ended: int = 0  # slow-body clients the server ended by their deadline
    slow_client_failures: list[str] = field(default_factory=list)
    health_probes: int = 0
    health_failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**self.__dict__, "faults": dict(self.faults)}

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.duplicated
            or self.counter_drift
            or self.status_failures
            or self.poison_left
            or self.poison_quarantined != self.poison_pushed
            or self.slow_client_failures
            or self.health_failures
        )


class Soak:
    def __init__(self, root: Path, config: SoakConfig):
        self.root, self.config = root, config
        self.rng = random.Random(config.seed)
        self.redis: RedisServer | None = None
        self.proxy: ReplyDroppingProxy | None = None
        self.deployment: SentinelDeployment | None = None
        if config.sentinel:
            (root / "sentinel").mkdir()
            self.deployment = SentinelDeployment(root / "sentinel")
            self.deployment.start()
            self.url = self.server_url = self.deployment.url
            self.conn = settings.connect(self.url, socket_timeout=2)
        else:
            self.redis = RedisServer(root)
            self.redis.start()
            self.proxy = ReplyDroppingProxy(self.redis.port)
            self.url, self.server_url = self.proxy.url, self.redis.url  # the server's replies are not dropped
            self.conn = self.redis.connect()
        self.queue = Queue("cbq", connection=self.conn, serializer=JSONSerializer)
        self.workers: list[WorkerProcess] = []
        self.batches: dict[str, int] = {}  # batch id -> requests
        self.done: set[str] = set()
        self.report = SoakReport()
        self.server: ServeProcess | None = None
        self.slow_clients: SlowBodyClients | None = None

    def run(self) -> SoakReport:
        if self.config.slow_clients:
            try:
                self._start_server()  # before the clock starts: it takes seconds to answer
            except BaseException:
                self.close()
                raise
        started = time.monotonic()
        try:
            for _ in range(self.config.num_workers):
                self._start_worker()
            next_fault = started + self.rng.uniform(*self.config.fault_every)
            while time.monotonic() - started < self.config.seconds:
                self._top_up_batches()
                self._read_statuses()
                self._probe_server()
                if time.monotonic() >= next_fault:
                    faults = self.config.faults
                    kind = faults[sum(self.report.faults.values()) % len(faults)] if self.config.cycle_faults else None
                    self._inject(kind or self.rng.choice(faults))
                    next_fault = time.monotonic() + self.rng.uniform(*self.config.fault_every)
                time.sleep(0.5)
            if self.proxy is not None:
                self.proxy.drop_exec_replies(0, BatchField.NUM_COMPLETED.value.encode())
            self._stop_slow_clients()
            self._drain()
            self._audit()
        finally:
            self.report.seconds = round(time.monotonic() - started, 1)
            self.report.replies_lost = self.proxy.num_dropped if self.proxy is not None else 0
            self.close()
        return self.report

    def close(self) -> None:
        self._stop_slow_clients()
        if self.server is not None:
            self.server.stop()
        for w in self.workers:
            w.kill()
            w.wait()
        if self.proxy is not None:
            self.proxy.close()
        if self.redis is not None:
            self.redis.kill()
        if self.deployment is not None:
            self.deployment.stop()

    def _start_worker(self) -> None:
        c = self.config
        flags = (
            "--fake-engine",
            "--fake-latency",
            str(c.fake_latency_seconds),
            "--max-num-seqs",
            str(c.max_num_seqs),
        )
        if c.wait_replicas:
            flags += ("--redis-wait-replicas", str(c.wait_replicas), "--redis-wait-timeout", "1")
        log_path = self.root / f"worker{len(self.workers)}.log"
        self.workers.append(WorkerProcess(self.url, log_path, *flags, *RECOVERY_FLAGS))

    def _start_server(self) -> None:
        (self.root / "serve").mkdir()
        timeout = str(self.config.serve_body_timeout_seconds)
        self.server = ServeProcess(self.server_url, self.root / "serve", "--body-timeout", timeout)
        self.slow_clients = SlowBodyClients(
            self.server, self.config.slow_clients, self.config.serve_body_timeout_seconds
        )
        self.slow_clients.start()

    def _probe_server(self) -> None:
        if self.server is None:
            return
        self.report.health_probes += 1
        if failure := probe_health(self.server):
            self.report.health_failures.append(failure)

    def _stop_slow_clients(self) -> None:
        if self.slow_clients is None:
            return
        self.slow_clients.stop()
        self.report.slow_clients_ended = self.slow_clients.ended
        self.report.slow_client_failures = self.slow_clients.failures[:20]
        self.slow_clients = None

    def _inject(self, fault: str) -> None:
        self.report.faults[fault] += 1
        if fault == "worker_kill":
            live = [w for w in self.workers if w.proc.poll() is None]
            victim = self.rng.choice(live)
            victim.kill(signal.SIGKILL)
            victim.wait()
            self._start_worker()
        elif fault == "sentinel_failover":
            self._fail_over()
        elif fault == "redis_restart":
            assert self.redis is not None
            self.redis.kill()
            time.sleep(self.rng.uniform(*self.config.outage_seconds))
            self.redis.start()
        elif fault == "redis_pause":
            assert self.redis is not None and self.redis.proc is not None
            self.redis.proc.send_signal(signal.SIGSTOP)
            time.sleep(self.rng.uniform(*self.config.outage_seconds))
            self.redis.proc.send_signal(signal.SIGCONT)
        elif fault == "poison_entries":
            self._push_poison()
        else:  # the next results writes (they bump the counters) and admissions lose their replies
            assert self.proxy is not None
            self.proxy.drop_exec_replies(self.rng.randint(1, 3), BatchField.NUM_COMPLETED.value.encode())
            self.proxy.drop_exec_replies(1, BatchField.FIRST_STARTED_AT.value.encode())

    def _fail_over(self) -> None:
        """SIGKILL the primary; once the Sentinels promoted the replica, start the old primary again after an
        outage's length and wait until it replicates the new one, so that the next failover has a replica."""
        assert self.deployment is not None
        old_primary = self.deployment.kill_primary()
        wait_until(lambda: self._primary_port() not in (old_primary, None), timeout=60, interval=0.2)
        time.sleep(self.rng.uniform(*self.config.outage_seconds))
        self.deployment.restart_node(old_primary)
        wait_until(self.deployment.is_ready, timeout=60, interval=0.2)

    def _primary_port(self) -> int | None:
        assert self.deployment is not None
        try:
            return self.deployment.primary_port()
        except REDIS_ERRORS:
            return None

    def _push_poison(self) -> None:
        """One entry at the head of the queue (the next dequeue takes it) and one at the tail."""
        n = self.report.poison_pushed
        try:
            self.conn.lpush(self.queue.key, b"\xff\xfe head %d \x80" % n)
            self.report.poison_pushed += 1
            self.conn.rpush(self.queue.key, b"\xff\xfe tail %d \x80" % n)
            self.report.poison_pushed += 1
        except REDIS_ERRORS:
            pass  # Redis is coming back: not pushed, not counted

    def _poison_left(self) -> int:
        keys = (self.queue.key, self.queue.intermediate_queue_key)
        entries = [entry for key in keys for entry in self.conn.lrange(key, 0, -1)]
        return sum(1 for entry in entries if entry.startswith(b"\xff\xfe"))

    def _top_up_batches(self) -> None:
        try:
            if len(self.batches) - len(self.done) >= self.config.open_batches:
                return
            prefix = f"b{len(self.batches)}-"
            n = self.config.requests_per_batch
            lines = [
                json.dumps({"custom_id": f"{prefix}{i}", "prompt": f"soak prompt {i}"}) for i in range(n)
            ]
            options = SubmitOptions(queue="cbq", chunk_size=self.config.chunk_size, retries=5)
            batch_id = submit_batch(self.conn, validate_lines(lines).requests, options).batch_id
        except REDIS_ERRORS:
            return  # Redis is coming back; a submit whose reply is lost is not counted (none of its ids are)
        assert batch_id is not None
        self.batches[batch_id] = n

    def _read_statuses(self) -> None:
        for batch_id in [b for b in self.batches if b not in self.done]:
            try:
                status = store.get_status(self.conn, batch_id)
            except REDIS_ERRORS:
                continue
            except Exception as exc:  # the invariant: status reads never fail on what is stored
                self.report.status_failures.append(f"{batch_id}: {type(exc).__name__}: {exc}"[:300])
                continue
            self.report.status_reads += 1
            if status.is_done:
                self.done.add(batch_id)
            if status.inconsistencies:
                self.report.status_failures.append(f"{batch_id}: {status.inconsistencies}"[:300])

    def _drain(self) -> None:
        def all_done() -> bool:
            self._read_statuses()
            return len(self.done) == len(self.batches)

        try:
            wait_until(all_done, timeout=self.config.drain_timeout_seconds, interval=1.0)
        except AssertionError:
            pass  # counted below as unfinished batches

    def _audit(self) -> None:
        r = self.report
        try:  # an entry pushed at the tail is taken once the batches ahead of it are
            wait_until(lambda: self._poison_left() == 0, timeout=15, interval=0.5)
        except AssertionError:
            pass
        r.poison_left = self._poison_left()
        placeholders = self.queue.failed_job_registry.get_job_ids()
        r.poison_quarantined = sum(1 for job_id in placeholders if job_id.startswith("cbq-bad-id-"))
        for batch_id, n in self.batches.items():
            status = store.get_status(self.conn, batch_id)
            lines = list(store.iter_results(self.conn, batch_id, partial=True))
            r.batches += 1
            r.requests += n
            r.unfinished_batches += not status.is_done
            r.completed += sum(1 for line in lines if line.finish_reason in ("stop", "length"))
            r.lost += n - len({line.custom_id for line in lines})
            r.duplicated += len(lines) - len({line.custom_id for line in lines})
            meta = store.read_meta(self.conn, batch_id)
            recorded = sum(
                int(meta.get(BatchField.counter_of(o).value, 0)) for o in ("completed", "failed", "cancelled")
            )
            prompt = int(meta.get(BatchField.PROMPT_TOKENS.value, 0))
            completion = int(meta.get(BatchField.COMPLETION_TOKENS.value, 0))
            r.counter_drift += abs(recorded - len(lines))
            r.counter_drift += abs(prompt - sum(line.usage.prompt_tokens for line in lines))
            r.counter_drift += abs(completion - sum(line.usage.completion_tokens for line in lines))
