"""What the deployment tests (tests/unit/test_deploy_*.py) share: compose-style interpolation of
compose/ and its .env.example, and the rule that every environment variable a deployment file sets
is one the code reads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from services.api.settings import ApiSettings
from services.ref.__main__ import RefSettings
from services.reward.settings import RewardSettings
from services.rollout.settings import RolloutSettings
from services.trainer.settings import TrainerSettings
from shared.domain.envs.python_tool import ToolSettings
from shared.domain.sandbox import SandboxSettings
from shared.settings import CommonSettings
from tests.support import ROOT

COMPOSE = ROOT / "compose"

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
COMPOSE_FILES = ["compose.yaml", "compose.dev.yaml", "compose.tls.yaml"]


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
