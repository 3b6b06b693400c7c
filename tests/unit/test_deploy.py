"""Deployment files, checked offline (no Docker engine, no cluster, no network).

- compose/: every file validates against the compose-spec JSON schema (the copy check-jsonschema
  ships, Apache-2.0, from github.com/compose-spec/compose-spec) after compose-style interpolation,
  plus what a schema cannot say: required secrets are ${VAR:?}, `up rollout ref reward` starts
  exactly those and their dependencies, dependencies wait on health, healthchecks call /readyz on the
  role's port, and each burstrl container runs the command the e2e test runs as a local process.
- docker/: every compose build target exists, final stages run as non-root, base images are pinned.
- deploy/k8s/: every resource file and every rendered overlay passes kubernetes-validate's bundled
  schemas in strict mode; kustomization references resolve (rendered with `kubectl kustomize` when
  kubectl is installed).
- deploy/grafana/: the dashboard queries only metrics the code exports.
- deploy/burst/: the recipe refuses plaintext or pod-local endpoints before touching the network.
- configs/: each example is a valid JobSpec plus valid service settings, and its numbers are what the
  `burstrl plan` command it cites prints.
Environment variable names anywhere here must be ones the code reads (or are listed in PENDING).

Over ~400 lines: one offline validator per deployment surface (compose, docker, k8s,
grafana), sharing the interpolation and schema helpers at the top.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.resources
import io
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.api.settings import ApiSettings
from services.cli.launch import ROLES, Launcher
from services.ref.__main__ import RefSettings
from services.reward.settings import RewardSettings
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from shared.domain.envs.python_tool import ToolSettings
from shared.domain.sandbox import SandboxSettings
from shared.domain.tasks import task_names
from shared.job import JobSpec
from shared.settings import DEFAULT_PORTS, CommonSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.32.0"

# Settings other engineers are adding right now; the deployment files already use these names.
# Drop a name from here once the code reads it; a name that lands under another spelling must be
# renamed in compose/, deploy/ and configs/ too.
PENDING: dict[str, str] = {}  # names a config may use before the code reads them (none now)
# Read by shared/store.py, or by boto3 itself.
STORE_ENV = {"STORE_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"}
STORE_ENV |= {"AWS_CA_BUNDLE"}
REQUIRED_SECRETS = [
    "BURSTRL_TOKEN",
    "REDIS_PASSWORD",
    "MINIO_ROOT_USER",
    "MINIO_ROOT_PASSWORD",
    "STORE_ACCESS_KEY",
    "STORE_SECRET_KEY",
]
SETTINGS_CLASSES = [CommonSettings, ApiSettings, RolloutSettings, TrainerSettings, RefSettings, RewardSettings]
SETTINGS_CLASSES += [SandboxSettings, ToolSettings]


# ------------------------------------------------------------------------------------ helpers
def env_names_read_by_code() -> set[str]:
    """Every environment variable the settings classes read (aliases, or prefix + field name)."""
    names: set[str] = set()
    for cls in SETTINGS_CLASSES:
        prefix = cls.model_config.get("env_prefix", "")
        for field_name, f in cls.model_fields.items():
            alias = f.validation_alias
            if alias is None:
                names.add(f"{prefix}{field_name}".upper())
            elif isinstance(alias, str):
                names.add(alias.upper())
            else:
                names |= {str(c).upper() for c in alias.choices}
    return names


KNOWN_ENV = env_names_read_by_code() | STORE_ENV


def check_env_names(names: list[str], where: str) -> None:
    """burstrl's own names (BURSTRL_*, REDIS_URL, STORE_*, AWS_*) must be read by the code."""
    ours = [n for n in names if n.startswith(("BURSTRL_", "STORE_", "AWS_")) or n == "REDIS_URL"]
    unknown = [n for n in ours if n not in KNOWN_ENV and n not in PENDING]
    assert not unknown, f"{where}: {unknown} are read by no settings class (typo? renamed?)"


_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]+)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
_EXPR = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?$", re.S)


class MissingRequired(KeyError):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation: $$, $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e}, ${VAR?e}, ${VAR:+r}."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group("bare"):
            return env.get(m.group("bare"), "")
        e = _EXPR.match(m.group("braced"))
        assert e, f"bad interpolation {m.group(0)!r}"
        name, op, arg = e["name"], e["op"], e["arg"]
        val, is_set = env.get(name), name in env
        present = bool(val) if (op or "").startswith(":") else is_set
        if op in (":-", "-"):
            return val if present else arg
        if op in (":?", "?"):
            if not present:
                raise MissingRequired(f"{name}: {arg}")
            return val
        if op in (":+", "+"):
            return arg if present else ""
        return val or ""

    return _VAR.sub(sub, value)


def dotenv(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def filled_env() -> dict[str, str]:
    """.env.example with every required secret filled in, as a user's .env would be."""
    env = dotenv(COMPOSE / ".env.example")
    for k in REQUIRED_SECRETS:
        env[k] = f"{k.lower().replace('_', '')}0123456789abcdef"
    env["TLS_DIR"] = "/srv/burstrl/tls"
    return env


def load_compose(name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    raw = yaml.safe_load((COMPOSE / name).read_text())  # PyYAML resolves anchors and `<<` merges
    return interpolate(raw, filled_env() if env is None else env)


def merge(base: Any, over: Any) -> Any:
    """Enough of compose's override merge for the checks here (mappings merge, the rest replaces)."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {k: merge(base[k], v) if k in base else v for k, v in over.items()} | {
            k: v for k, v in base.items() if k not in over
        }
    return over


@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    text = importlib.resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    return json.loads(text.read_text())


def burstrl_role(svc: dict[str, Any]) -> str | None:
    """The burstrl role a compose service runs (`python -m services.<role>`), else None."""
    cmd = svc.get("command")
    if isinstance(cmd, list) and len(cmd) == 3 and cmd[1] == "-m" and str(cmd[2]).startswith("services."):
        return cmd[2].removeprefix("services.")
    return None


def is_burstrl_image(svc: dict[str, Any]) -> bool:
    return str(svc.get("image", "")).startswith("burstrl/") or "build" in svc


def env_keys(svc: dict[str, Any]) -> list[str]:
    env = svc.get("environment") or {}
    return list(env) if isinstance(env, dict) else [e.split("=", 1)[0] for e in env]


def launcher_command(role: str, tmp_path: Path) -> list[str]:
    """The exact argv the e2e test's Launcher.start_service spawns for a role."""
    launcher = Launcher(tmp_path / "run")
    seen: list[list[str]] = []
    launcher._spawn = lambda name, cmd, env, port, cpus=None: seen.append(cmd)  # type: ignore[method-assign]
    launcher.start_service(role, {})
    return seen[0]


def e2e_roles() -> list[str]:
    tree = ast.parse((ROOT / "tests" / "e2e" / "test_e2e.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "ROLES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/e2e/test_e2e.py defines no ROLES")


# ------------------------------------------------------------------------------------ compose
COMPOSE_FILES = ["compose.yaml", "compose.dev.yaml", "compose.tls.yaml"]


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_passes_compose_spec_schema(name: str, compose_schema: dict[str, Any]) -> None:
    doc = load_compose(name)
    validator = jsonschema.Draft202012Validator(compose_schema)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize("name", ["compose.dev.yaml", "compose.tls.yaml"])
def test_compose_overrides_merge_into_a_valid_model(name: str, compose_schema: dict[str, Any]) -> None:
    base, over = load_compose("compose.yaml"), load_compose(name)
    assert set(over["services"]) <= set(base["services"]) | {"store-tls"}, "override names an unknown service"
    jsonschema.Draft202012Validator(compose_schema).validate(merge(base, over))


class _TaggedLoader(yaml.SafeLoader):
    """Compose's merge tags: `!reset` drops a value from the files before, `!override` replaces it."""


for _tag in ("!reset", "!override"):
    _TaggedLoader.add_constructor(
        _tag,
        lambda loader, node: (
            loader.construct_mapping(node, deep=True)
            if isinstance(node, yaml.MappingNode)
            else loader.construct_sequence(node, deep=True)
            if isinstance(node, yaml.SequenceNode)
            else loader.construct_scalar(node) or None
        ),
    )

TEST_OVERRIDES = {
    "compose.test.yaml": ["compose.yaml"],
    "compose.test-tls.yaml": ["compose.yaml", "compose.tls.yaml"],
    "compose.test-burst.yaml": ["../deploy/burst/compose.burst.yaml"],
}
TEST_ENV = {"TEST_MODEL_DIR": "/tmp/model", "TEST_API_PORT": "18700", "TEST_REDIS_TLS_PORT": "16380"}
TEST_ENV |= {"TEST_STORE_TLS_PORT": "19443", "TEST_BURST_NETWORK": "burst-net"}


def burst_compose_env() -> dict[str, str]:
    """deploy/burst/trainer.env.example, filled in as a user's trainer.env would be."""
    env = dotenv(ROOT / "deploy" / "burst" / "trainer.env.example") | {"BURSTRL_TOKEN": "0123456789abcdef0123456789"}
    return env | {"AWS_ACCESS_KEY_ID": "burstrl", "AWS_SECRET_ACCESS_KEY": "0123456789abcdef"}


@pytest.mark.parametrize("name", sorted(TEST_OVERRIDES))
def test_container_test_overrides_are_valid_and_name_known_services(name: str, compose_schema: dict[str, Any]) -> None:
    """The container tests' stand-ins (tests/e2e/test_containers.py) validate, and override only what exists."""
    raw = yaml.load((COMPOSE / name).read_text(), Loader=_TaggedLoader)  # noqa: S506 (SafeLoader subclass)
    doc = interpolate(raw, filled_env() | TEST_ENV)
    jsonschema.Draft202012Validator(compose_schema).validate(doc)
    known: set[str] = set()
    for base in TEST_OVERRIDES[name]:
        known |= set(load_compose(base, burst_compose_env() if "burst" in base else None)["services"])
    assert set(doc["services"]) <= known, f"{name} names unknown services: {set(doc['services']) - known}"
    for svc_name, svc in doc["services"].items():
        check_env_names(env_keys(svc), f"{name}:{svc_name}")
        image = svc.get("image", "")
        assert not image or image.startswith(("localhost/burstrl-local/", "burstrl/")), f"{svc_name}: {image}"


def test_burst_compose_runs_the_recipe_and_requires_its_secrets(compose_schema: dict[str, Any]) -> None:
    path = "../deploy/burst/compose.burst.yaml"
    env = burst_compose_env()
    doc = load_compose(path, env)
    jsonschema.Draft202012Validator(compose_schema).validate(doc)
    trainer = doc["services"]["trainer"]
    assert trainer["command"] == ["burstrl-burst"] and trainer["restart"] == "on-failure"
    assert trainer["image"].startswith("burstrl/trainer:")
    check_env_names(env_keys(trainer), "compose.burst.yaml")
    assert trainer["environment"]["BURST_ROLLOUT"] == "0"  # a replica beside the trainer is opt-in
    with_replica = load_compose(path, env | {"BURST_ROLLOUT": "1", "BURST_IMAGE": "burstrl/burst"})["services"]
    assert with_replica["trainer"]["image"].startswith("burstrl/burst:")  # the image that has vLLM
    assert with_replica["trainer"]["environment"]["BURST_ROLLOUT"] == "1"
    for secret in ("REDIS_URL", "STORE_ENDPOINT_URL", "AWS_SECRET_ACCESS_KEY", "BURSTRL_TOKEN"):
        with pytest.raises(MissingRequired, match=secret):
            load_compose(path, {k: v for k, v in env.items() if k != secret})


def test_schema_check_catches_a_bad_file(compose_schema: dict[str, Any]) -> None:
    """The validation above would notice a broken file (not a schema that accepts anything)."""
    bad = {"services": {"x": {"image": "redis:7", "depends_on": {"y": {"condition": "when_i_feel_like_it"}}}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(compose_schema).validate(bad)


@pytest.mark.parametrize("secret", REQUIRED_SECRETS)
def test_compose_requires_every_secret(secret: str) -> None:
    text = (COMPOSE / "compose.yaml").read_text()
    uses = re.findall(r"\$\{" + secret + r"([^}]*)\}", text)
    assert uses, f"{secret} is not used"
    assert all(u.startswith(":?") and len(u) > 4 for u in uses), f"{secret} must always be ${{{secret}:?message}}"
    env = filled_env()
    env[secret] = ""
    with pytest.raises(MissingRequired, match=secret):
        load_compose("compose.yaml", env)
    assert dotenv(COMPOSE / ".env.example").get(secret, None) == "", f".env.example must list {secret}, empty"


def test_every_compose_variable_is_documented_in_env_example() -> None:
    documented = set(dotenv(COMPOSE / ".env.example"))
    for name in COMPOSE_FILES:
        text = re.sub(r"(^|\s)#.*$", "", (COMPOSE / name).read_text(), flags=re.M).replace("$$", "")
        used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
        assert used <= documented, f"{name}: {sorted(used - documented)} missing from .env.example"


def test_compose_up_rollout_ref_reward_starts_exactly_those_and_their_dependencies() -> None:
    services = load_compose("compose.yaml")["services"]

    def closure(names: list[str]) -> set[str]:
        out: set[str] = set()
        todo = list(names)
        while todo:
            n = todo.pop()
            if n not in out:
                out.add(n)
                todo += list(services[n].get("depends_on") or {})
        return out

    started = closure(["rollout", "ref", "reward"])
    assert started == {"rollout", "ref", "reward", "redis", "minio", "minio-init"}, started
    for infra in ("redis", "minio", "minio-init"):  # no profile: there on every box, never gated
        assert "profiles" not in services[infra]
    assert "trainer" in services and "api" in services  # services of their own
    assert "trainer" not in started and "api" not in started


def test_compose_profiles() -> None:
    services = load_compose("compose.yaml")["services"]
    by_profile: dict[str, set[str]] = {}
    for name, svc in services.items():
        for p in svc.get("profiles", []):
            by_profile.setdefault(p, set()).add(name)
    assert {"mi50", "nvidia", "cpu"} <= set(by_profile)
    always = {n for n, s in services.items() if "profiles" not in s}
    # Each hardware profile (plus the profile-less services) runs the whole pipeline but the trainer,
    # which the cpu profile also runs (everything on one laptop).
    for profile, needs in {"mi50": {"rollout", "ref"}, "nvidia": {"rollout", "ref"}, "cpu": set(ROLES)}.items():
        roles = {burstrl_role(services[n]) for n in by_profile[profile] | always} - {None}
        assert needs | {"api", "reward"} <= roles, f"profile {profile} runs only {roles}"
    # The MI50 profile: gfx906 engines (the community fork, ROCm), one card each; clients in remote mode.
    engines = [services[n] for n in by_profile["mi50"] if "vllm-gfx906" in str(services[n].get("image"))]
    assert len(engines) == 2
    cards = {e["environment"]["ROCR_VISIBLE_DEVICES"] for e in engines}
    assert len(cards) == 2, "rollout and ref engines must not share a card"
    for e in engines:
        assert "rocm6.3" in e["image"] and "/dev/kfd" in e["devices"]
        assert "--dtype=float16" in e["command"], "gfx906 has no bf16"
    clients = [services[n] for n in by_profile["mi50"] if burstrl_role(services[n])]
    for c in clients:
        role = burstrl_role(c)
        assert c["environment"][f"BURSTRL_{role.upper()}_ENGINE"] == "remote"
        url = c["environment"][f"BURSTRL_{role.upper()}_ENGINE_URL"]
        assert url.startswith("http://engine-") and not url.endswith("/v1"), "a base URL: the client adds /v1"


def test_mi50_engines_run_the_maintained_gfx906_fork_when_asked() -> None:
    """Issue 44, item 11: the archived nlzy fork (vLLM 0.11.2) stays the default, and its maintained
    successor, which .env.example names, is one variable away: both engines run it, pinned, fp16."""
    documented = re.findall(r"^#.*\bMI50_ENGINE_IMAGE=(\S+)", (COMPOSE / ".env.example").read_text(), re.M)
    assert len(documented) == 1 and "vllm-gfx906-mobydick:v0.23.1" in documented[0], documented
    for image in (filled_env()["MI50_ENGINE_IMAGE"], documented[0]):
        services = load_compose("compose.yaml", filled_env() | {"MI50_ENGINE_IMAGE": image})["services"]
        for name in ("engine-rollout", "engine-ref"):
            assert services[name]["image"] == image and not image.endswith(":latest")
            assert "--dtype=float16" in services[name]["command"]
    assert filled_env()["MI50_ENGINE_IMAGE"] == "nalanzeyu/vllm-gfx906:v0.11.2-rocm6.3"


def test_compose_depends_on_waits_for_health() -> None:
    services = load_compose("compose.yaml")["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on must use the long form with a condition"
        for dep, spec in deps.items():
            one_shot = services[dep].get("restart") == "no"
            want = "service_completed_successfully" if one_shot else "service_healthy"
            assert spec.get("condition") == want, f"{name} -> {dep}: condition must be {want}"
            if not one_shot:
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck to wait for"


def test_compose_burstrl_services_run_the_e2e_commands_and_check_readyz(tmp_path: Path) -> None:
    services = load_compose("compose.yaml")["services"]
    roles_seen = set()
    e2e = e2e_roles()
    for name, svc in services.items():
        if not is_burstrl_image(svc):
            continue
        role = burstrl_role(svc)
        if role is None:  # a one-shot helper: must be a real `burstrl` CLI command
            from services.cli.main import app

            cmd = svc["command"]
            commands = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
            assert cmd[0] == "burstrl" and cmd[1] in commands, f"{name}: {cmd}"
            assert svc.get("restart") == "no"
            continue
        roles_seen.add(role)
        assert role in e2e, f"{name}: services.{role} is not a process the e2e test runs"
        local = launcher_command(role, tmp_path)
        assert svc["command"] == ["python", *local[1:]], f"{name}: {svc['command']} != e2e's {local}"
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "burstrl-healthcheck", f"{name}: {test}"
        assert test[2] == f"http://127.0.0.1:{DEFAULT_PORTS[role]}/readyz", f"{name}: wrong port or path"
        env = svc["environment"]
        assert env["BURSTRL_HOST"] == "0.0.0.0" and env["BURSTRL_TOKEN"]
        assert "BURSTRL_DEV" not in env, "local-dev mode is loopback-only; containers need the token"
        assert env["REDIS_URL"].startswith("redis://:") and "@redis:6379" in env["REDIS_URL"]
        assert env["STORE_URL"].startswith("s3://") and env["STORE_ENDPOINT_URL"] == "http://minio:9000"
        check_env_names(env_keys(svc), f"compose service {name}")
    assert roles_seen == set(ROLES)


def test_compose_redis_and_minio_are_configured_not_to_lose_data() -> None:
    services = load_compose("compose.yaml")["services"]
    redis_cmd = " ".join(services["redis"]["command"])
    for flag in ("--appendonly yes", "--maxmemory-policy noeviction", '--requirepass "$REDIS_PASSWORD"'):
        assert flag in redis_cmd, flag
    assert services["redis"]["volumes"] and services["minio"]["volumes"]
    minio_cmd = " ".join(services["minio"]["command"])
    assert "minioadmin" in minio_cmd and "exit 1" in minio_cmd, "MinIO must refuse its default credentials"
    for var in ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"):
        assert services["minio"]["environment"][var].endswith("0123456789abcdef")  # from the (filled) .env
    tls = load_compose("compose.tls.yaml")["services"]["redis"]
    assert "--tls-port 6380" in " ".join(tls["command"]) and "--appendonly yes" in " ".join(tls["command"])


def test_compose_images_are_pinned() -> None:
    for name in COMPOSE_FILES:
        for svc_name, svc in load_compose(name)["services"].items():
            image = svc.get("image")
            if image is None:
                continue
            repo, _, tag = image.rpartition(":")
            assert repo and tag and tag != "latest", f"{name}:{svc_name}: image {image!r} is not pinned"


# ------------------------------------------------------------------------------------ docker
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


# ------------------------------------------------------------------------------------ kubernetes
def k8s_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def resource_files() -> list[Path]:
    out = []
    for k in kustomizations():
        spec = yaml.safe_load(k.read_text())
        out += [k.parent / r for r in spec.get("resources", []) if (k.parent / r).is_file()]
    return sorted(set(out))


@pytest.mark.parametrize("path", resource_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_k8s_resource_file_passes_schema(path: Path) -> None:
    docs = k8s_docs(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.parent.relative_to(K8S)))
def test_kustomization_references_resolve(path: Path) -> None:
    spec = yaml.safe_load(path.read_text())
    assert spec["apiVersion"].startswith("kustomize.config.k8s.io/")
    assert spec["kind"] in ("Kustomization", "Component")
    for ref in spec.get("resources", []) + spec.get("components", []):
        target = path.parent / ref
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{path}: {ref} does not exist"
    for patch in spec.get("patches", []):
        if "path" in patch:
            assert (path.parent / patch["path"]).is_file(), f"{path}: patch {patch['path']} does not exist"


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: overlays are checked by reference only")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


@pytest.mark.parametrize("overlay", ["nvidia", "mi50"])
def test_k8s_overlay_renders_and_validates(overlay: str) -> None:
    docs = render(overlay)
    by_kind: dict[tuple[str, str], dict[str, Any]] = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"].get("namespace", "burstrl") == "burstrl"
    configmaps = {n for k, n in by_kind if k == "ConfigMap"}
    for doc in docs:
        for c in containers(doc):
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] in configmaps, f"{doc['metadata']['name']}: dangling configmap"
            for e in c.get("env", []):
                secret = e.get("valueFrom", {}).get("secretKeyRef")
                assert secret is None or secret["name"] == "burstrl-secrets"  # created out of band (README)
            if str(c.get("image", "")).startswith("burstrl/"):
                role = c["name"]
                names = [e["name"] for e in c.get("env", [])] + list(by_kind[("ConfigMap", "burstrl-config")]["data"])
                check_env_names(names, f"k8s {overlay}/{role}")
                assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
                assert c["ports"][0]["containerPort"] == DEFAULT_PORTS[role]
                assert ":" in c["image"] and not c["image"].endswith(":latest")
    rollout = by_kind[("Deployment", "rollout")]
    assert rollout["spec"]["replicas"] >= 2, "rollout replicas scale in the overlay"
    if overlay == "nvidia":
        job = by_kind[("Job", "trainer")]
        cmd = containers(job)[0]["command"]
        assert cmd[0] == "torchrun" and cmd[-2:] == ["-m", "services.trainer"]
        assert containers(job)[0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    else:
        assert ("Job", "trainer") not in by_kind, "the MI50 cluster's trainer is the rented burst"
        engine = next(c for c in containers(rollout) if c["name"] == "engine")
        assert "vllm-gfx906" in engine["image"] and engine["resources"]["limits"]["amd.com/gpu"] == 1


@pytest.mark.parametrize("overlay", ["nvidia", "mi50"])
def test_k8s_services_called_by_name_have_a_service(overlay: str) -> None:
    """What other pods call by name has a Service: the api (clients), reward (rollout's tool calls
    run in its sandbox). rollout and ref are only scraped per pod; they pull their work from Redis."""
    docs = render(overlay)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "burstrl-config")
    for d in docs:
        if d["kind"] != "Deployment" or d["metadata"]["name"] not in ("api", "reward"):
            continue
        name = d["metadata"]["name"]
        assert name in services, f"Deployment {name} has no Service"
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert services[name]["spec"]["selector"].items() <= labels.items(), f"Service {name} selects no pod"
        ports = {p["containerPort"] for c in containers(d) for p in c.get("ports", [])}
        assert {p["port"] for p in services[name]["spec"]["ports"]} & ports, f"Service {name}: wrong port"
    url = config["data"]["BURSTRL_TOOLS_SANDBOX_URL"]
    assert url == f"http://reward:{DEFAULT_PORTS['reward']}" and "reward" in services


def test_k8s_validation_catches_a_bad_manifest() -> None:
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}, "spec": {"replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


# ------------------------------------------------------------------------------------ grafana
def exported_metrics() -> set[str]:
    """Series names the code exports, from its prometheus_client constructors."""
    suffixes = {"Counter": ["_total", "_created"], "Gauge": [""], "Histogram": ["_bucket", "_sum", "_count"]}
    suffixes["Summary"] = ["_sum", "_count"]
    out = set()
    for path in list((ROOT / "shared").rglob("*.py")) + list((ROOT / "services").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in suffixes and node.args:
                name = node.args[0]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    base = name.value.removesuffix("_total")
                    out |= {base + s for s in suffixes[node.func.id]}
    return out


def test_grafana_dashboard_uses_exported_metrics() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "burstrl-dashboard.json").read_text())
    exported = exported_metrics()
    assert "burstrl_ready" in exported and "burstrl_rollout_tokens_total" in exported
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs and dash["uid"] and dash["title"]
    used = {m for e in exprs for m in re.findall(r"\b(burstrl_[a-z0-9_]+)\b", e)}
    assert used, "the dashboard queries no burstrl metric"
    assert used <= exported, f"not exported by the code: {sorted(used - exported)}"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", "data source must be the dashboard variable"
    scrape = yaml.safe_load((ROOT / "deploy" / "grafana" / "prometheus.yml").read_text())
    assert all(j["job_name"].startswith("burstrl") for j in scrape["scrape_configs"])  # `up{job=~"burstrl.*"}`


# ------------------------------------------------------------------------------------ burst recipe
BURST = ROOT / "deploy" / "burst" / "start-trainer.sh"
BURST_ENV = {
    "REDIS_URL": "rediss://:secretpassword@home.example.net:6380/0",
    "STORE_URL": "s3://burstrl/runs",
    "STORE_ENDPOINT_URL": "https://home.example.net:9443",
    "AWS_ACCESS_KEY_ID": "burstrl",
    "AWS_SECRET_ACCESS_KEY": "0123456789abcdef0123",
    "BURSTRL_TOKEN": "0123456789abcdef0123456789abcdef",
    "PATH": "/usr/bin:/bin",
}


REPLICA = {
    "BURST_HOURS": "10",
    "BURST_ROLLOUT": "1",
    "BURSTRL_ROLLOUT_MODEL": "Qwen/Qwen2.5-1.5B",
    "BURST_ROLLOUT_MEMORY_SHARE": "0.3",
    "BURST_TRAINER_GB": "90",
}


def run_burst(**over: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in {**BURST_ENV, **over}.items() if v is not None}
    return subprocess.run(["bash", str(BURST)], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"REDIS_URL": "redis://:pw@home.example.net:6379/0"}, "rediss://"),
        ({"REDIS_URL": "rediss://home.example.net:6380/0"}, "no password"),
        ({"REDIS_URL": "rediss://:pw@127.0.0.1:6380/0"}, "this box"),
        ({"STORE_ENDPOINT_URL": "http://home.example.net:9000"}, "https://"),
        ({"STORE_URL": "file:///workspace/store"}, "dies with the pod"),
        ({"BURSTRL_TOKEN": ""}, "BURSTRL_TOKEN is required"),
        ({}, "BURST_HOURS is required"),  # no time budget given
        ({"BURST_HOURS": "0.25"}, "too short"),  # 15 minutes minus the 20-minute margin
        ({"BURSTRL_TRAINER_TIME_BUDGET_S": "300"}, "too short"),
        ({"BURST_HOURS": "ten"}, "number of hours"),
        # A rollout replica beside the trainer: the flag, the model and both shares of the card.
        ({"BURST_HOURS": "10", "BURST_ROLLOUT": "yes"}, "BURST_ROLLOUT must be 0 or 1"),
        ({"BURST_HOURS": "10", "BURST_ROLLOUT": "1"}, "BURSTRL_ROLLOUT_MODEL is required"),
        ({"BURST_HOURS": "10", "BURST_ROLLOUT": "1", "BURSTRL_ROLLOUT_MODEL": "m"}, "BURST_ROLLOUT_MEMORY_SHARE is"),
        *(
            (
                {**REPLICA, "BURST_ROLLOUT_MEMORY_SHARE": bad},
                "BURST_ROLLOUT_MEMORY_SHARE must be a fraction of the card in (0, 1]",
            )
            for bad in ("0", "1.5", "-0.3", "nan", "0.")
        ),
        *(
            ({**REPLICA, "BURST_TRAINER_GB": bad}, "BURST_TRAINER_GB must be a positive number of GB")
            for bad in ("0", "-3", "inf", "lots")
        ),
        (REPLICA, "needs vLLM, which this image lacks"),  # the plain trainer image
    ],
)
def test_burst_recipe_refuses_what_a_stopped_rental_would_lose(over: dict[str, str], says: str) -> None:
    out = run_burst(**over)
    assert out.returncode == 2 and says in out.stderr, out.stderr


# Stand-ins for what the burst image runs, so the recipe's supervision runs for real: `python`
# answers the vLLM check and the preflight, and as `-m services.rollout` records its environment
# and the signal it gets; `torchrun` trains for a moment (or until SIGTERM).
FAKE_PYTHON = """#!/usr/bin/env bash
case "$1 $2" in
  "-c import vllm") exit 0 ;;
  "- ") cat >/dev/null; echo "burst: Redis and the store are reachable"; exit 0 ;;
  "-m services.rollout")
    env | grep -E '^BURSTRL_(REPLICA|PORT|ROLLOUT_GPU_MEMORY_UTILIZATION|ROLLOUT_TRAINER_RESERVE_GB)=' | sort >"$OUT/rollout.env"
    trap 'echo TERM >>"$OUT/rollout.log"; exit 0' TERM
    while :; do sleep 0.1; done ;;
esac
exit 1
"""
FAKE_TORCHRUN = """#!/usr/bin/env bash
trap 'echo TERM >>"$OUT/trainer.log"; exit 0' TERM
for _ in $(seq 1 "${TRAIN_TICKS:-10}"); do sleep 0.1; done
echo done >>"$OUT/trainer.log"
"""


def _fake_image(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("torchrun", FAKE_TORCHRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**REPLICA, "PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path), "BURSTRL_DATA_DIR": str(tmp_path)}


def test_burst_recipe_stops_its_replica_when_the_trainer_ends(tmp_path: Path) -> None:
    env = {**BURST_ENV, **_fake_image(tmp_path)}
    out = subprocess.run(["bash", str(BURST)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "trainer.log").read_text() == "done\n"  # the trainer ran its course
    assert (tmp_path / "rollout.log").read_text() == "TERM\n"  # then the replica was told to leave
    given = (tmp_path / "rollout.env").read_text().splitlines()
    assert "BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION=0.3" in given and "BURSTRL_ROLLOUT_TRAINER_RESERVE_GB=90" in given
    assert "BURSTRL_PORT=8701" in given and any(g.startswith("BURSTRL_REPLICA=burst-") for g in given)


def test_burst_recipe_hands_sigterm_to_the_trainer_and_its_replica(tmp_path: Path) -> None:
    env = {**BURST_ENV, **_fake_image(tmp_path), "TRAIN_TICKS": "600"}
    proc = subprocess.Popen(["bash", str(BURST)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while not (tmp_path / "rollout.env").exists() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the trap is set right after both start
        proc.send_signal(signal.SIGTERM)  # the provider stops the pod
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / "trainer.log").read_text() == "TERM\n"
    assert "TERM" in (tmp_path / "rollout.log").read_text()


def test_burst_recipe_shape() -> None:
    for script in (BURST, ROOT / "deploy" / "burst" / "make-certs.sh"):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = BURST.read_text()
    assert "export BURSTRL_TRAINER_TIME_BUDGET_S" in text
    last = [line for line in text.splitlines() if line.startswith("exec ")][-1]
    assert "torchrun" in last and last.endswith("-m services.trainer"), "exec: SIGTERM must reach the trainer"
    env = dotenv(ROOT / "deploy" / "burst" / "trainer.env.example")
    assert env["REDIS_URL"].startswith("rediss://") and env["STORE_ENDPOINT_URL"].startswith("https://")
    check_env_names(list(env), "deploy/burst/trainer.env.example")


# ------------------------------------------------------------------------------------ example configs
CONFIGS = sorted((ROOT / "configs").glob("*/*.toml"))
NAME_RE = re.compile(
    r"^(?P<model>[a-z0-9.-]+)_(?P<task>grpo-[a-z]+)_(?P<gpunums>\d+(?:\+\d+)*)_(?P<device>[a-z0-9]+(?:\+[a-z0-9]+)*)"
    r"_(?P<train>[a-z0-9-]+)_(?P<infer>[a-z0-9-]+)\.toml$"
)
NOT_JOB = {"meta", "plan", "tuning", "env"}  # the non-JobSpec tables of a config


def job_part(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in NOT_JOB}


def run_plan(command: str) -> tuple[int, dict[str, Any]]:
    from services.plan.cli import main as plan_main

    argv = shlex.split(command)
    assert argv[:3] == [".venv/bin/python", "-m", "services.plan"] and argv[-1] == "--json", command
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = plan_main(argv[3:])
    return code, json.loads(buf.getvalue())


def test_configs_cover_models_devices_and_both_tags() -> None:
    assert len(CONFIGS) >= 8
    metas = [tomllib.loads(p.read_text())["meta"] for p in CONFIGS]
    devices = {d for m in metas for d in m["device"].split("+")}
    assert {"mi50", "rtx4070", "h100", "h200"} <= devices
    assert {m["profile"] for m in metas} == {"min", "recommended"}
    assert len({m["model"] for m in metas}) >= 5


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_is_a_valid_job_and_valid_settings(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = NAME_RE.match(path.name)
    assert m, f"{path.name} does not follow [model]_[task]_[gpunums]_[device]_[train]_[infer].toml"
    cfg = tomllib.loads(path.read_text())
    meta = cfg["meta"]
    assert meta["profile"] == path.parent.name in ("min", "recommended")
    assert {k: meta[k] for k in m.groupdict()} == m.groupdict(), "meta disagrees with the file name"
    assert len(meta["gpunums"].split("+")) == len(meta["device"].split("+"))
    assert meta["obtained"] in ("estimated", "measured")
    if meta["obtained"] == "measured":
        assert meta.get("measured_how"), "a measured config says how it was measured"

    # The job: exactly what `burstrl submit` would post, once the non-job tables are dropped.
    job = JobSpec.model_validate(job_part(cfg))
    assert job.task in task_names()
    uses_ref = "--no-ref" not in shlex.split(meta["command"])
    assert job.uses_ref == uses_ref, "kl_coef > 0 exactly when the plan includes the ref role"

    # The services' settings, built the way they are at start-up: from the environment.
    for var in list(__import__("os").environ):
        if var.startswith("BURSTRL_") or var in ("REDIS_URL", "STORE_URL"):
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("BURSTRL_TOKEN", "0123456789abcdef0123456789abcdef")
    classes = {"trainer": TrainerSettings, "rollout": RolloutSettings, "ref": RefSettings}
    env_tables = cfg.get("env", {})
    assert "trainer" in env_tables and "rollout" in env_tables
    assert ("ref" in env_tables) == uses_ref
    built = {}
    for svc, env in env_tables.items():
        if svc == "compose":
            assert set(env) <= set(dotenv(COMPOSE / ".env.example")), f"{svc}: not a compose/.env variable"
            continue
        check_env_names(list(env), f"{path.name} [env.{svc}]")
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, str(v))
            built[svc] = classes[svc]()
    rollout: RolloutSettings = built["rollout"]
    argv = shlex.split(meta["command"])
    prompt_len = int(argv[argv.index("--prompt-len") + 1])
    assert rollout.model == job.base_model, "rollout must serve the job's base model"
    if rollout.engine == "remote":  # the engine's limits are `vllm serve` arguments, set from compose/.env
        compose_env = env_tables["compose"]
        assert compose_env["BURSTRL_MODEL"] == job.base_model == rollout.engine_served_model
        limits = (compose_env[f"BURSTRL_{k}"] for k in ("MAX_MODEL_LEN", "MAX_LORA_RANK", "MAX_LORAS"))
    else:
        limits = (rollout.max_model_len, rollout.max_lora_rank, rollout.max_loras)
    max_model_len, max_lora_rank, max_loras = limits
    assert max_model_len >= prompt_len + job.sampling.max_tokens
    assert max_lora_rank >= job.lora_rank
    assert max_loras >= job.max_staleness + 2
    if "ref" in built:
        assert built["ref"].model == job.base_model
    if "mi50" in meta["device"]:
        assert meta["infer"] == "vllm-gfx906" and rollout.engine == "remote"
    # One vocabulary: every tuned setting that names a field of the role's settings reaches that
    # service with the same value (the rest are layout facts: weights served, replicas...).
    for svc, settings in built.items():
        tuned = cfg["tuning"][svc]
        if tuned.get("engine") == "remote":
            continue  # a remote engine's sizes are `vllm serve` flags (the comment under [env.rollout])
        for k in (k for k in tuned if k in classes[svc].model_fields):
            assert getattr(settings, k) == tuned[k], f"{path.name}: [tuning.{svc}] {k} does not reach [env.{svc}]"
    # The file name says what the trainer uses.
    t = cfg["tuning"]["trainer"]
    parts = meta["train"].split("-")
    assert parts[0] == ("full" if job.algorithm.finetune == "full" else "qlora" if t["base_bits"] == 4 else "lora")
    assert ("fsdp2" in parts) == (t["sharding"] == "fsdp") and ("offload" in parts) == t["cpu_offload"]
    assert ("ddp" in parts) == (t["sharding"] == "ddp" and t["processes"] > 1)
    assert ("adam8bit" in parts) == (t["optimizer"] == "adamw8bit")
    assert meta["task"] == f"grpo-{job.algorithm.finetune}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_numbers_come_from_the_cited_plan_command(path: Path) -> None:
    cfg = tomllib.loads(path.read_text())
    if cfg["meta"]["obtained"] != "estimated":
        pytest.skip("measured, not estimated")
    code, plan = run_plan(cfg["meta"]["command"])
    hint = f"{path.name} drifted from its plan command: run `.venv/bin/python configs/generate.py`"
    assert code == 0 and plan["fits"], f"{path.name}: the planner says this does not fit"
    assert plan["placement"] == cfg["plan"]["placement"], hint
    assert cfg["plan"]["step_time_s"] == pytest.approx(plan["step_time_s"], rel=0.1), hint
    argv = shlex.split(cfg["meta"]["command"])
    job = job_part(cfg)
    assert int(argv[argv.index("--group-size") + 1]) == job["group_size"]
    assert int(argv[argv.index("--batch") + 1]) == job["batch_size"]
    assert int(argv[argv.index("--completion-len") + 1]) == job["sampling"]["max_tokens"]
    assert int(argv[argv.index("--rank") + 1]) == job["lora_rank"]
    profile = cfg["meta"]["profile"]
    for role in plan["roles"]:
        tuned = cfg["tuning"][role["role"]]
        settings = role["recommended"] if profile == "recommended" else role["min_settings"]
        settings = settings | (role["layout"] if profile == "recommended" else role["min_layout"])
        peak = role["peak_gb"] if profile == "recommended" else role["min_peak_gb"]
        assert tuned["cards"] == f"{role['count']}x {role['card']}", hint
        assert tuned["peak_gb"] == pytest.approx(peak, rel=0.1, abs=0.2), hint
        for k, v in settings.items():
            assert tuned[k] == (pytest.approx(v, rel=0.1) if isinstance(v, float) else v), f"{hint} ({k})"
    if profile == "min":  # every memory saver on
        assert cfg["tuning"]["trainer"]["gradient_checkpointing"] is True
