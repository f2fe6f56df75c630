"""docker-compose.yml and the Dockerfile on a GPU host (issue 30): the image has the C compiler Triton builds its
launcher with, the workers get HF_TOKEN and refuse to start without CBQ_MODEL (one line), the server starts
only in its own profile (with keys), and the header states the driver and CUDA requirements. No Docker daemon
here: the file is validated against the compose-spec JSON schema that Docker Compose v2 uses (a copy in
tests/fixtures/compose_spec/), and a broken copy must fail that check."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from producer.cli import main
from tests.reliability.conftest import REPO_ROOT

COMPOSE_TEXT = (REPO_ROOT / "docker-compose.yml").read_text()
SERVICES = yaml.safe_load(COMPOSE_TEXT)["services"]
DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()
COMPOSE_SCHEMA = json.loads(
    (REPO_ROOT / "tests" / "fixtures" / "compose_spec" / "compose-spec.json").read_text()
)


def test_the_image_installs_a_c_compiler_before_dropping_root_and_cpu_images_skip_it():
    assert re.search(r'^ARG CC_PACKAGES="gcc libc6-dev"$', DOCKERFILE, re.MULTILINE)
    assert DOCKERFILE.index("apt-get install") < DOCKERFILE.index("\nUSER ")
    assert "CC_PACKAGES" not in SERVICES["worker"]["build"].get("args", {})  # the CUDA worker keeps gcc
    for name in ("worker-cpu", "cli", "server"):
        assert SERVICES[name]["build"]["args"]["CC_PACKAGES"] == "", name


def test_workers_get_hf_token_and_refuse_to_start_without_a_model():
    for name in ("worker", "worker-cpu"):
        service = SERVICES[name]
        assert service["environment"]["HF_TOKEN"] == "${HF_TOKEN:-}"
        command = service["command"]
        assert command[command.index("--model") + 1] == "${CBQ_MODEL:-}"  # empty when unset
    result = CliRunner().invoke(main, ["worker", "--model", "", "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 1
    from worker.engine.models import PRESETS

    assert result.stderr.strip().splitlines() == [
        "Error: no model given: set CBQ_MODEL or pass --model: a checkpoint folder, a hub id (org/name) or a "
        f"preset ({', '.join(PRESETS)})"
    ]


def test_the_server_starts_only_in_its_profile_and_the_header_names_the_requirements():
    assert SERVICES["server"]["profiles"] == ["server"]
    assert "CBQ_API_KEYS=k1 docker compose --profile server up -d server" in COMPOSE_TEXT
    for needed in ("580 or newer", "NVIDIA Container\n# Toolkit", "capability 8.0", "HF_TOKEN"):
        assert needed in COMPOSE_TEXT, needed


def compose_errors(compose: dict) -> list[str]:
    """What is wrong with a parsed compose file: the compose-spec JSON schema's errors (unknown keys, wrong
    types or values, anywhere in the file), and the references the schema cannot see (a `depends_on` service or
    a named volume that the file does not define). Empty when the file is valid."""
    validator = jsonschema.Draft202012Validator(COMPOSE_SCHEMA)
    errors = []
    for error in sorted(validator.iter_errors(compose), key=lambda e: list(map(str, e.absolute_path))):
        # "Not valid under any of the given schemas" (a oneOf): report the branch's error that went deepest.
        while error.context:
            error = max(error.context, key=lambda e: len(e.absolute_path))
        errors.append(f"{'.'.join(map(str, error.absolute_path)) or '(top level)'}: {error.message}")
    if errors:
        return errors
    services, volumes = compose["services"], compose.get("volumes") or {}
    for name, service in services.items():
        for needed in service.get("depends_on") or {}:
            if needed not in services:
                errors.append(f"services.{name}.depends_on: no service {needed!r}")
        for mount in service.get("volumes") or []:
            source = mount.split(":")[0] if isinstance(mount, str) else mount.get("source", "")
            if source and not source.startswith((".", "/", "~", "$")) and source not in volumes:
                errors.append(f"services.{name}.volumes: no top-level volume {source!r}")
    return errors


def test_the_compose_file_follows_the_compose_spec_with_every_profile():
    # The schema Docker Compose v2 validates with (tests/fixtures/compose_spec/README.md says where it is from);
    # no container engine is needed here.
    assert compose_errors(yaml.safe_load(COMPOSE_TEXT)) == []
    assert sorted(SERVICES) == ["cli", "redis", "server", "worker", "worker-cpu"]
    profiles = {name: service.get("profiles", []) for name, service in SERVICES.items()}
    assert profiles == {
        "redis": [],
        "worker": [],
        "worker-cpu": ["cpu"],
        "cli": ["cli"],
        "server": ["server"],
    }


@pytest.mark.parametrize(
    "break_it, error",
    [
        (
            lambda c: c["services"]["redis"].update(restrat="always"),
            "'restrat' does not match any of the regexes",
        ),
        (
            lambda c: c["services"]["server"].update(ports="8000:8000"),
            "services.server.ports: '8000:8000' is not",
        ),
        (
            lambda c: c["services"]["cli"]["depends_on"]["redis"].update(condition="healthy"),
            "services.cli.depends_on.redis.condition: 'healthy' is not one of",
        ),
        (lambda c: c.update(service={}), "(top level): 'service' does not match any of the regexes"),
        (lambda c: c["services"]["server"].update(depends_on=["valkey"]), "no service 'valkey'"),
        (lambda c: c["volumes"].pop("cbq-files"), "services.server.volumes: no top-level volume 'cbq-files'"),
    ],
    ids=["unknown-key", "wrong-type", "bad-enum", "top-level-typo", "missing-service", "missing-volume"],
)
def test_a_broken_compose_file_fails_validation(break_it, error):
    compose = yaml.safe_load(COMPOSE_TEXT)
    break_it(compose)
    errors = compose_errors(compose)
    assert any(error in e for e in errors), errors
