"""`burstrl demo` refuses a model or environment it has no demo for, naming the option, before
starting anything (the real command line, in a subprocess)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.cli.demo import SMOLLM2_JOB, check_choice
from shared.job import JobSpec
from tests.support import ROOT


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--model", "llama"], "--model: no demo for model 'llama'"),
        (["--env", "shell"], "--env: no demo for environment 'shell'"),
        (["--model", "smollm2", "--env", "calc"], "give --model or --env, not both"),
        (["--steps", "-1"], "--steps: must be 0"),
    ],
)
def test_demo_refuses_what_it_cannot_run(args: list[str], said: str, tmp_path) -> None:  # noqa: ANN001
    out = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "demo", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "BURSTRL_HOME": str(tmp_path), "COLUMNS": "200"},
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert said in out.stdout, out.stdout
    assert not (tmp_path / "run").exists()  # nothing was started


def test_the_smollm2_demo_job_is_a_valid_job() -> None:
    check_choice("", "smollm2")
    spec = JobSpec(**SMOLLM2_JOB, base_model="m")
    assert spec.prompt_format == "chat" and spec.kl_coef > 0  # chat prompts; the ref service in the loop
