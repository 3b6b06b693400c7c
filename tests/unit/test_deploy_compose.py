"""compose/, checked offline (no Docker engine, no network): every file validates against the
compose-spec JSON schema (the copy check-jsonschema ships, Apache-2.0, from
github.com/compose-spec/compose-spec) after compose-style interpolation (tests/support/deploy.py),
plus what a schema cannot say: required secrets are ${VAR:?}, `up rollout ref reward` starts
exactly those and their dependencies, dependencies wait on health, healthchecks call /readyz on the
role's port, and each burstrl container runs the command the e2e test runs as a local process.
Environment variable names anywhere here must be ones the code reads (or are listed in
PENDING, tests/support/deploy.py).
"""

from __future__ import annotations

import ast
import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services.cli.launch import ROLES, Launcher
from shared.settings import DEFAULT_PORTS
from tests.support import ROOT
from tests.support.deploy import (
    COMPOSE,
    COMPOSE_FILES,
    REQUIRED_SECRETS,
    MissingRequired,
    check_env_names,
    dotenv,
    filled_env,
    interpolate,
    load_compose,
    merge,
)


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
