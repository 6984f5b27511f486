"""The shipped Dockerfile, compose.yaml and their Prometheus and Grafana files, checked without containers.

`make compose-test` runs them for real with podman (slow, and it needs root and apt); this file is the
part of it `make test` can afford: the image is what the issue asks for (multi-stage on the official
python:3.11-slim, a non-root user, the broker as entry point, a HEALTHCHECK on /livez, data in a volume),
it builds the whole package, every CONVEYOR_* variable it or compose sets is one Conveyor reads, every
file compose mounts exists, and Grafana (which cannot run here) gets the shipped provisioning.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from conveyor.broker.cli.main import build_parser
from conveyor.broker.config.sources import COMMAND_OPTIONS, OTHER_VARIABLES

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "compose.yaml"


@cache
def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def arguments(keyword: str) -> list[str]:
    return [rest for kw, rest in instructions() if kw == keyword]


@cache
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@cache
def known_variables() -> frozenset[str]:
    """Every CONVEYOR_* variable some command reads: the shared and the per-command name of each option."""
    build_parser()
    names = set(OTHER_VARIABLES)
    for command, options in COMMAND_OPTIONS.items():
        names |= {opt.env for opt in options} | {opt.command_env(command) for opt in options}
    return frozenset(names)


def test_the_image_is_multi_stage_on_the_official_slim_python() -> None:
    assert "PYTHON_IMAGE=python:3.11-slim" in arguments("ARG")
    stages = arguments("FROM")
    assert len(stages) >= 2 and all(stage.startswith("${PYTHON_IMAGE}") for stage in stages)
    assert any("--from=build" in copy for copy in arguments("COPY"))


def test_the_image_runs_the_broker_as_a_non_root_user_with_its_data_in_a_volume() -> None:
    user = arguments("USER")[-1].split(":")[0]
    assert user not in {"root", "0"}
    assert re.search(rf"useradd .*--uid (\d+) .*{user}\b", " ".join(arguments("RUN"))), "the user is created"
    assert arguments("ENTRYPOINT")[-1] == '["python", "-m", "conveyor"]'
    volume = arguments("VOLUME")[-1].strip('[]" ')
    assert f"CONVEYOR_BROKER_DATA_DIR={volume} " in " ".join(arguments("ENV"))


def test_the_healthcheck_asks_livez_only() -> None:
    (check,) = arguments("HEALTHCHECK")
    assert "/livez" in check and "/healthz" not in check and "/readyz" not in check


def test_the_build_copies_every_package_folder_and_needs_no_secret() -> None:
    """The wheel is built from what COPY brings in: a folder missing here would be missing from the image."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied = {src for copy in arguments("COPY") if not copy.startswith("--") for src in shlex.split(copy)[:-1]}
    assert folders | {"pyproject.toml", "README.md"} <= copied
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    for path in copied:
        assert (REPO / path).exists()
        assert f"!{path}/" in ignore or f"!{path}" in ignore, f".dockerignore leaves {path} out of the context"
    assert all("required=false" in run for run in arguments("RUN") if "type=secret" in run)


def test_every_conveyor_variable_set_is_one_conveyor_reads() -> None:
    found = set(re.findall(r"\b(CONVEYOR_[A-Z0-9_]+)=", DOCKERFILE.read_text()))
    for service in compose()["services"].values():
        found |= {name for name in service.get("environment", {}) if name.startswith("CONVEYOR_")}
    assert found, "no variable found: the patterns above went stale"
    assert found <= known_variables(), sorted(found - known_variables())


def test_compose_services_use_official_images_and_existing_files() -> None:
    services = compose()["services"]
    assert {"broker", "consumer", "prometheus", "grafana", "etcd", "n1", "n2", "n3"} <= set(services)
    assert services["broker"]["build"] == "." and services["broker"].get("profiles") is None
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")
    assert services["etcd"]["image"].startswith("quay.io/coreos/etcd:")
    assert all(services[name]["profiles"] == ["cluster"] for name in ("etcd", "n1", "n2", "n3"))
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (REPO / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in compose()["volumes"], f"{name}: volume {source} is not declared"


def test_the_consumer_service_runs_the_shipped_examples() -> None:
    consumer = compose()["services"]["consumer"]
    command, module = consumer["command"]
    assert command == "run"
    assert (REPO / (module.replace(".", "/") + ".py")).exists()
    assert "./examples:/app/examples:ro" in consumer["volumes"]


def test_prometheus_loads_the_shipped_rules_and_scrapes_the_jobs_they_name(tmp_path: Path) -> None:
    prometheus = compose()["services"]["prometheus"]
    mounts = dict(volume.split(":")[:2] for volume in prometheus["volumes"])
    config_path = mounts["./deploy/prometheus.yml"]
    assert f"--config.file={config_path}" in prometheus["command"]
    config = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    assert config["rule_files"] == [mounts["./monitoring/alerts.yml"]]
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert {"conveyor-broker", "conveyor-runner"} <= jobs
    rules = (REPO / "monitoring" / "alerts.yml").read_text()
    assert all(f'up{{job="{job}"}}' in rules for job in ("conveyor-broker", "conveyor-runner"))
    promtool = shutil.which("promtool")
    if promtool:  # `make deps` installs it; the file must be one Prometheus accepts
        config["rule_files"] = [str(REPO / "monitoring" / "alerts.yml")]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        checked = subprocess.run(
            [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_grafana_gets_the_shipped_dashboards_and_a_datasource_with_their_uid() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    provider = yaml.safe_load((REPO / "grafana/provisioning/dashboards/conveyor.yml").read_text())["providers"][0]
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning/dashboards/conveyor.yml"].startswith("/etc/grafana/provisioning/dashboards/")
    datasource_file = next(source for source, target in mounts.items() if "/provisioning/datasources/" in target)
    (ours,) = yaml.safe_load((REPO / datasource_file).read_text())["datasources"]
    (shipped,) = yaml.safe_load((REPO / "grafana/provisioning/datasources/conveyor.yml").read_text())["datasources"]
    assert ours["uid"] == shipped["uid"] and ours["type"] == shipped["type"] == "prometheus"
    assert ours["url"] == "http://prometheus:9090"
    for dashboard in sorted((REPO / "grafana" / "dashboards").glob("*.json")):
        assert shipped["uid"] in dashboard.read_text(), f"{dashboard.name} does not default to {shipped['uid']}"


def test_ci_runs_the_container_checks_after_the_suite() -> None:
    """`.ci/run` is what CI runs: the slow container checks come after `make test`, and a failure stops it."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    steps = re.findall(r"^\s*step (\S+)", ci, flags=re.M)
    assert steps == ["test", "image", "compose-test"], steps
    makefile = (REPO / "Makefile").read_text()
    assert all(re.search(rf"^{target}:", makefile, flags=re.M) for target in steps)
