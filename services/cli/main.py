"""`burstrl` — the command line. Heavy imports are deferred so `--help` is instant."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="burstrl: GRPO across always-on and burst hardware.")
console = Console()
HOME = Path(os.environ.get("BURSTRL_HOME", ".burstrl"))
TINY = HOME / "models" / "tiny-sft"


def _api(url: str | None) -> str:
    return (url or os.environ.get("BURSTRL_API_URL") or "http://127.0.0.1:8700").rstrip("/")


def _headers() -> dict[str, str]:
    tok = os.environ.get("BURSTRL_TOKEN", "")
    return {"Authorization": f"Bearer {tok}"} if tok else {}


@app.command("init-model")
def init_model(
    out: Annotated[Path, typer.Option(help="Where to write the SFT-warm-started model.")] = TINY, force: bool = False
) -> None:
    """Build the tiny offline model (tokenizer + Qwen2) and warm-start it with TRL SFT."""
    from services.cli.model import ensure_tiny_model

    path = ensure_tiny_model(out, force=force, log=console.print)
    console.print(f"[green]model ready:[/] {path}")


@app.command()
def up(
    model: Annotated[Path, typer.Option(help="Base model for rollout/ref.")] = TINY,
    roles: Annotated[str, typer.Option(help="Comma-separated roles to start.")] = "api,reward,ref,rollout,trainer",
) -> None:
    """Start Redis (unless REDIS_URL is set) and the services as local processes."""
    from services.cli.stack import start_stack

    start_stack(HOME, str(model.resolve()), roles.split(","), log=console.print)


@app.command()
def down() -> None:
    """Stop every process `burstrl up` started (by pid)."""
    from services.cli.launch import Launcher

    Launcher(HOME / "run").stop_all()
    console.print("stopped")


@app.command()
def submit(
    job: Annotated[Path, typer.Argument(help="Job TOML file (fields of JobSpec).")],
    follow: bool = False,
    api: str | None = None,
) -> None:
    """Submit a job over HTTP; --follow shows its progress until it finishes."""
    import httpx

    spec: dict[str, Any] = tomllib.loads(job.read_text())
    base = Path(str(spec.get("base_model", ""))).expanduser()
    if spec.get("base_model") and base.exists():  # a local path means the submitter's cwd
        spec["base_model"] = str(base.resolve())
    resp = httpx.post(f"{_api(api)}/v1/jobs", json=spec, headers=_headers(), timeout=30)
    if resp.status_code == 422:
        for err in resp.json()["detail"]:
            console.print(f"[red]{'.'.join(str(x) for x in err['loc'][1:])}[/]: {err['msg']}")
        raise typer.Exit(2)
    resp.raise_for_status()
    job_id = resp.json()["id"]
    console.print(f"submitted [bold]{job_id}[/]")
    if follow:
        from services.cli.follow import follow_job, print_summary

        status = follow_job(_api(api), job_id, _headers(), console)
        print_summary(status, console)


@app.command()
def status(job_id: Annotated[str | None, typer.Argument()] = None, api: str | None = None) -> None:
    """Services and their health, or one job's status."""
    import httpx

    from services.cli.follow import print_services, print_summary

    if job_id:
        print_summary(httpx.get(f"{_api(api)}/v1/jobs/{job_id}", headers=_headers(), timeout=10).json(), console)
    else:
        print_services(httpx.get(f"{_api(api)}/v1/services", headers=_headers(), timeout=10).json(), console)


@app.command()
def jobs(api: str | None = None) -> None:
    """List jobs."""
    import httpx

    for j in httpx.get(f"{_api(api)}/v1/jobs", headers=_headers(), timeout=10).json():
        console.print(f"{j['id']:<24} {j['state']:<10} steps={j['spec']['steps']} task={j['spec']['task']}")


@app.command()
def demo(steps: int = 40, keep_running: bool = False) -> None:
    """The main job end to end: tiny model, all services, a real GRPO run, a table and a plot."""
    from services.cli.demo import run_demo

    raise typer.Exit(run_demo(HOME, steps=steps, keep_running=keep_running, console=console))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def plan(ctx: typer.Context) -> None:
    """Will this run fit? Memory and time per role for a model on your cards (see --help)."""
    from shared.plan.cli import main as plan_main

    raise typer.Exit(plan_main(list(ctx.args)))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
