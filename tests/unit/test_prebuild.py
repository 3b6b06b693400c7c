"""The background model prebuild of tests/support/models.py: what it builds, and its refusals."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT
from tests.support.models import PREBUILT, prebuilds_for


def test_only_the_builds_the_collected_tests_use_in_build_order() -> None:
    assert prebuilds_for({"r", "teacher_model", "calc_model", "tiny_model"}) == ["calc_model", "teacher_model"]
    assert prebuilds_for({"teacher_model"}) == ["teacher_model"]
    # the tiny model is the first worker's own first build; a session of unit tests builds nothing
    assert prebuilds_for({"tiny_model", "r", "tmp_path"}) == []
    assert list(PREBUILT) == ["calc_model", "teacher_model"]


def test_the_prebuild_process_refuses_a_fixture_it_has_no_model_for() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.models", "no_such_model"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "no test model is built for fixture 'no_such_model'" in proc.stderr
