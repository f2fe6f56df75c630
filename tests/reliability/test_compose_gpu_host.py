"""docker-compose.yml and the Dockerfile on a GPU host (issue 30): the image has the C compiler Triton builds its
launcher with, the workers get HF_TOKEN and refuse to start without CBQ_MODEL (one line), the server starts
only in its own profile (with keys), and the header states the driver and CUDA requirements. No Docker daemon
here: the file is also checked with `docker-compose config` where that tool is installed."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml
from click.testing import CliRunner

from producer.cli import main
from tests.reliability.conftest import REPO_ROOT

COMPOSE_TEXT = (REPO_ROOT / "docker-compose.yml").read_text()
SERVICES = yaml.safe_load(COMPOSE_TEXT)["services"]
DOCKERFILE = (REPO_ROOT / "Dockerfile").read_text()


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


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_docker_compose_accepts_the_file_with_every_profile():
    args = ["docker-compose", "-f", "docker-compose.yml"]
    profiles = ["--profile", "cpu", "--profile", "cli", "--profile", "server"]
    subprocess.run([*args, "config", "-q"], cwd=REPO_ROOT, check=True, timeout=60)
    services = subprocess.run(
        [*args, *profiles, "config", "--services"],
        cwd=REPO_ROOT,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert sorted(services) == ["cli", "redis", "server", "worker", "worker-cpu"]
