"""A Redis Sentinel deployment of the test's own, for the failover tests: a primary, one replica and three
Sentinels (the redis-server binary with `--sentinel`), on free loopback ports with configs in a tmp dir, and
short detection times (down after 1 s, failover timeout 5 s)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import redis

from tests.reliability.harness import free_port, wait_until

SERVICE = "cbq"


class SentinelDeployment:
    def __init__(self, data_dir: Path, num_sentinels: int = 3):
        self.data_dir = data_dir
        self.node_ports = [free_port(), free_port()]  # the first starts as primary, the second replicates it
        self.sentinel_ports = [free_port() for _ in range(num_sentinels)]
        self.nodes: dict[int, subprocess.Popen] = {}
        self.sentinels: list[subprocess.Popen] = []
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        self.url = f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> None:
        primary, replica = self.node_ports
        self._start_node(primary)
        self._start_node(replica, "--replicaof", "127.0.0.1", str(primary))
        for port in self.sentinel_ports:
            conf = self.data_dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.data_dir}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 5000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    ["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        wait_until(self.is_ready, timeout=30, interval=0.2)

    def _start_node(self, port: int, *args: str) -> None:
        node_dir = self.data_dir / f"node-{port}"
        node_dir.mkdir(exist_ok=True)  # a node started again keeps its data
        self.nodes[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--dir", str(node_dir), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def is_ready(self) -> bool:
        """Every Sentinel knows the primary, its replica (in sync) and the other Sentinels."""
        try:
            for port in self.sentinel_ports:
                s = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
                master = s.sentinel_master(SERVICE)
                replicas = s.sentinel_slaves(SERVICE)
                if master["num-other-sentinels"] < len(self.sentinel_ports) - 1 or len(replicas) != 1:
                    return False
                if replicas[0]["master-link-status"] != "ok":
                    return False
            return True
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            return False

    def primary_port(self) -> int:
        s = redis.Redis(port=self.sentinel_ports[0], socket_timeout=1, decode_responses=True)
        _host, port = s.sentinel_get_master_addr_by_name(SERVICE)
        return int(port)

    def kill_primary(self) -> int:
        """kill -9 the current primary; returns its port."""
        port = self.primary_port()
        self.nodes[port].send_signal(signal.SIGKILL)
        self.nodes[port].wait(10)
        return port

    def restart_node(self, port: int) -> None:
        """Start a killed node again on its port and data; the Sentinels make it a replica of the primary they
        promoted meanwhile."""
        self._start_node(port)

    def connect_node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port)

    def stop(self) -> None:
        for proc in [*self.sentinels, *self.nodes.values()]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
