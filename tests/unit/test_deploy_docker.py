"""docker/, checked offline: every compose build target exists, final stages run as non-root
with a /readyz healthcheck, base images and requirements are pinned, and the healthcheck script
knows the services' ports.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib

from services.cli.launch import ROLES
from shared.settings import DEFAULT_PORTS
from tests.support import ROOT
from tests.support.deploy import COMPOSE_FILES, load_compose


def dockerfile_stages() -> dict[str, list[str]]:
    """Stage name -> its instruction lines (continuations joined)."""
    text = (ROOT / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            current = m.group(2) or m.group(1)
            stages[current] = [line]
        elif current:
            stages[current].append(line)
    return stages


def stage_lines(stages: dict[str, list[str]], name: str) -> list[str]:
    """A stage's lines after its parents' (what the final image inherits)."""
    first = stages[name][0].split()[1]
    return (stage_lines(stages, first) if first in stages else []) + stages[name]


def test_dockerfile_targets_users_healthchecks_and_pins() -> None:
    stages = dockerfile_stages()
    text = (ROOT / "docker" / "Dockerfile").read_text()
    targets = set()
    for name in COMPOSE_FILES:
        for svc in load_compose(name)["services"].values():
            if "build" in svc:
                assert svc["build"]["dockerfile"] == "docker/Dockerfile" and svc["build"]["context"] == ".."
                targets.add(svc["build"]["target"])
    assert targets <= set(stages), f"missing targets: {targets - set(stages)}"
    for role in ROLES:  # a target per role (NVIDIA flavour for the GPU roles)
        assert role in stages
    for target in set(ROLES) | targets:
        lines = stage_lines(stages, target)
        users = [line.split()[1] for line in lines if line.upper().startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), f"{target} runs as root"
        checks = [line for line in lines if line.upper().startswith("HEALTHCHECK ")]
        assert checks and "burstrl-healthcheck" in checks[-1], f"{target}: no /readyz healthcheck"
        cmd = [line for line in lines if line.upper().startswith("CMD ")][-1]
        if target in ROLES:
            assert json.loads(cmd[4:]) == ["python", "-m", f"services.{target}"]
    # Base images come from ARGs with pinned tags; nothing floats.
    for arg, value in re.findall(r"^ARG (\w+_IMAGE)=(\S+)", text, re.M):
        assert ":" in value and not value.endswith(":latest"), f"{arg}={value}"
    for arg in ("TORCH_VERSION", "VLLM_VERSION"):
        assert re.search(rf"^ARG {arg}=\d+\.\d+\.\d+$", text, re.M), f"{arg} must be pinned"
    for req in ("requirements-slim.txt", "requirements-ml.txt"):
        for line in (ROOT / "docker" / req).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                assert re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.+]*", line.strip()), f"{req}: {line}"


def test_image_requirements_pin_every_dependency_pyproject_declares() -> None:
    """The images install requirements-*.txt and then burstrl with --no-deps: a dependency missing
    there is missing in the image (math-verify was: the reward image could not verify math)."""

    def names(specs: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower().replace("_", "-") for spec in specs}

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for req, wanted in [
        ("requirements-slim.txt", names(project["dependencies"])),
        ("requirements-ml.txt", names(project["optional-dependencies"]["ml"]) - {"torch"}),  # torch: per image
    ]:
        lines = [ln for ln in (ROOT / "docker" / req).read_text().splitlines() if ln.strip() and ln[0] != "#"]
        pinned = names(lines)
        assert wanted <= pinned, f"docker/{req} misses {sorted(wanted - pinned)} (pyproject.toml declares them)"


def test_healthcheck_script_matches_the_services_ports() -> None:
    tree = ast.parse((ROOT / "docker" / "healthcheck.py").read_text())
    ports = next(
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "DEFAULT_PORTS"
    )
    assert ports == DEFAULT_PORTS
    out = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "healthcheck.py"), "http://127.0.0.1:9/readyz"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 1  # nothing listens on the discard port: unhealthy, not a traceback
    assert "Traceback" not in out.stderr
