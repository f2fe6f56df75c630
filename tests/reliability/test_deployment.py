"""docker-compose.yml (issue 10, deployment): every cbq command it runs, or tells the reader to run, exists in the
CLI with those options, and the stack keeps its data: Redis with an fsynced append-only file on a named volume,
not on the host's 6379, restart policies and healthchecks, a GPU worker by default, a non-root image.
(test_compose_gpu_host.py also validates the file against the compose-spec JSON schema.)"""

from __future__ import annotations

import re
import shlex

import click
import pytest
import yaml

from producer.cli import main
from tests.reliability.conftest import REPO_ROOT

COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
CBQ_SERVICES = [name for name, service in SERVICES.items() if "build" in service]


def substitute(arg: str) -> str:
    """Compose's `${VAR:-default}`, with the default (what runs when nothing is set)."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


def command_of(name: str) -> click.Command:
    ctx = click.Context(main)
    command = main.get_command(ctx, name)
    assert command is not None, f"`cbq {name}` does not exist"
    return command


@pytest.mark.parametrize("service", [s for s in CBQ_SERVICES if "command" in SERVICES[s]])
def test_each_service_command_parses_in_the_cli(service):
    args = [substitute(a) for a in SERVICES[service]["command"]]
    command = command_of(args[0])
    command.make_context(args[0], args[1:])  # raises on an unknown option or a bad value


def test_every_command_the_comments_suggest_exists():
    suggested = re.findall(
        r"docker compose run --rm cli (.+)", (REPO_ROOT / "docker-compose.yml").read_text()
    )
    assert suggested
    for line in suggested:
        name, *args = shlex.split(line.split("#")[0])
        command = command_of(name)
        known = {opt for param in command.params for opt in param.opts + param.secondary_opts}
        flags = [a for a in args if a.startswith("-")]
        assert set(flags) <= known, (name, set(flags) - known)


def test_redis_keeps_its_data_and_stays_off_the_hosts_6379():
    redis = SERVICES["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    assert (
        any(v.startswith("redis-data:/data") for v in redis["volumes"]) and "redis-data" in COMPOSE["volumes"]
    )
    assert redis["restart"] == "unless-stopped" and "healthcheck" in redis
    [port] = [substitute(p) for p in redis["ports"]]
    assert port.startswith("127.0.0.1:") and not port.startswith("127.0.0.1:6379:"), port


def test_the_worker_runs_on_a_gpu_by_default_with_models_and_cache_volumes():
    worker = SERVICES["worker"]
    assert "cuda" in substitute(worker["build"]["args"]["BASE"])
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert worker["restart"] == "unless-stopped" and "healthcheck" in worker
    mounts = [v.split(":")[1] for v in worker["volumes"]]
    assert "/models" in mounts and worker["environment"]["HF_HOME"] in mounts
    assert worker["environment"]["CBQ_HEALTH_FILE"] in " ".join(worker["healthcheck"]["test"])


def test_the_cli_service_works_on_the_hosts_files_and_the_image_is_not_root():
    cli = SERVICES["cli"]
    assert ".:/work" in cli["volumes"] and cli["working_dir"] == "/work"
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER (?!root)\S+", dockerfile, re.MULTILINE)
