"""The `burstrl` command line (typer + rich): up, down, submit, status, demo, plan, init-model."""
