"""The docs site's generated pages, written at build time (mkdocs-gen-files, mkdocs.yml).

Reference pages come from their single sources, so they cannot drift from the code: the JobSpec
from its pydantic schema, the HTTP API from the api's OpenAPI document, the CLI from typer, the
settings from the pydantic-settings models. The benchmark pages come from bench/results/, where
the benchmarks write them. Nothing here is committed under docs/: `make docs` builds the site.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mkdocs_gen_files
from pydantic import AliasChoices
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# Building the api's app needs settings; these make a valid local-dev runtime (nothing connects).
os.environ.setdefault("BURSTRL_DEV", "1")
os.environ.setdefault("BURSTRL_ROLLOUT_MODEL", "<model>")
os.environ.setdefault("BURSTRL_REF_MODEL", "<model>")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# -- the JobSpec ------------------------------------------------------------------------------
def _type_of(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    if "anyOf" in prop:
        return " or ".join(_type_of(p) for p in prop["anyOf"])
    if prop.get("type") == "array":
        return f"list of {_type_of(prop.get('items', {}))}"
    if prop.get("type") == "object" and "additionalProperties" in prop:
        return f"map of {_type_of(prop['additionalProperties']) if isinstance(prop['additionalProperties'], dict) else 'any'}"
    return str(prop.get("type", "any"))


def _model_table(title: str, schema: dict[str, Any]) -> list[str]:
    lines = [f"## {title}", ""]
    if desc := schema.get("description"):
        lines += [desc.strip(), ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    required = set(schema.get("required", []))
    for name, prop in schema.get("properties", {}).items():
        default = "required" if name in required else f"`{json.dumps(prop.get('default'))}`"
        lines.append(
            f"| `{name}` | {_cell(_type_of(prop))} | {_cell(default)} | {_cell(prop.get('description', ''))} |"
        )
    return lines + [""]


def jobspec_page() -> str:
    from shared.job import JobSpec

    schema = JobSpec.model_json_schema()
    out = [
        "# Job specification",
        "",
        "A job is a TOML or JSON document posted to `POST /v1/jobs` (`burstrl submit FILE`). "
        "Generated from `shared.job.JobSpec`; bad input gets a 422 naming the field.",
        "",
    ]
    out += _model_table("JobSpec", schema)
    for name, sub in sorted(schema.get("$defs", {}).items()):
        if "properties" in sub:
            out += _model_table(name, sub)
        elif "enum" in sub:
            out += [f"## {name}", "", " \\| ".join(f"`{v}`" for v in sub["enum"]), ""]
    return "\n".join(out)


# -- the HTTP API -----------------------------------------------------------------------------
def api_openapi() -> dict[str, Any]:
    from services.api.app import build_routes
    from services.api.settings import ApiSettings
    from shared.service import ServiceRuntime

    rt = ServiceRuntime("api", ApiSettings())
    build_routes(rt, None)
    return rt.app.openapi()


def http_page(spec: dict[str, Any]) -> str:
    out = [
        "# HTTP API (the api service)",
        "",
        "Generated from the api's OpenAPI document ([openapi.json](openapi.json); a running api serves it "
        "at `/openapi.json` behind the token). Every route but `/healthz`, `/readyz` and `/metrics` takes "
        "`Authorization: Bearer $BURSTRL_TOKEN`.",
        "",
        "| method | path | what it does |",
        "|---|---|---|",
    ]
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            what = op.get("summary", "")
            if desc := (op.get("description") or "").strip():
                what = f"{what}: {desc.splitlines()[0]}" if what else desc.splitlines()[0]
            out.append(f"| {method.upper()} | `{path}` | {_cell(what)} |")
    return "\n".join(out) + "\n"


# -- the CLI ----------------------------------------------------------------------------------
def cli_page() -> str:
    import typer
    from typer.cli import get_docs_for_click

    from services.cli.main import app

    command = typer.main.get_command(app)
    ctx = typer.Context(command)
    return get_docs_for_click(obj=command, ctx=ctx, name="burstrl", title="Command line: `burstrl`")


# -- the settings -----------------------------------------------------------------------------
def _env_name(prefix: str, name: str, field: FieldInfo) -> str:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return " or ".join(f"`{c}`" for c in alias.choices if isinstance(c, str))
    if isinstance(alias, str):
        return f"`{alias}`"
    return f"`{prefix}{name.upper()}`"


def _default(value: Any) -> str:
    if isinstance(value, Path):
        value = str(value)
    elif hasattr(value, "get_secret_value"):
        value = "" if not value.get_secret_value() else "(set)"
    elif hasattr(value, "value") and not isinstance(value, (int, float, str)):
        value = value.value  # an Enum
    return f"`{json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else value!r}`"


def settings_page() -> str:
    from services.api.settings import ApiSettings
    from services.ref.settings import RefSettings
    from services.reward.settings import RewardSettings
    from services.rollout.settings import RolloutSettings
    from services.trainer.settings import TrainerSettings
    from shared.settings import CommonSettings

    out = [
        "# Settings",
        "",
        "Every service is configured by environment variables (pydantic-settings; `burstrl up --config FILE` "
        "fills them from a TOML's `[env.*]` tables). Generated from each service's settings model.",
        "",
    ]
    common = set(CommonSettings.model_fields)
    for title, model in (
        ("Every service", CommonSettings),
        ("api", ApiSettings),
        ("rollout", RolloutSettings),
        ("reward", RewardSettings),
        ("ref", RefSettings),
        ("trainer", TrainerSettings),
    ):
        prefix = model.model_config.get("env_prefix", "")
        out += [f"## {title}", "", "| variable | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            if model is not CommonSettings and name in common:
                continue
            default = "required" if field.is_required() else _default(field.get_default(call_default_factory=False))
            if field.default_factory is not None:
                default = "computed"
            kind = getattr(field.annotation, "__name__", str(field.annotation)).replace("typing.", "")
            row = [_env_name(prefix, name, field), _cell(kind), _cell(default), _cell(field.description or "")]
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    spec = api_openapi()
    pages = {
        "reference/jobspec.md": jobspec_page(),
        "reference/http.md": http_page(spec),
        "reference/openapi.json": json.dumps(spec, indent=1),
        "reference/cli.md": cli_page(),
        "reference/settings.md": settings_page(),
    }
    for path, text in pages.items():
        with mkdocs_gen_files.open(path, "w") as fh:
            fh.write(text)
    # The benchmark pages and plots, where the benchmarks write them.
    if RESULTS.is_dir():
        for f in sorted(RESULTS.iterdir()):
            if f.suffix in (".md", ".png", ".svg"):
                with mkdocs_gen_files.open(f"bench/{f.name}", "wb") as fh:
                    fh.write(f.read_bytes())


main()
