"""The tiny models the tests use: where each lives, and building the slow ones ahead of the tests.

Paths: the fixtures in tests/conftest.py and the prebuild below read them from here, so a model
built ahead is the one a test opens.

The prebuild (a pytest plugin, loaded from tests/conftest.py): the tool-use (calculator) model
and the distillation teacher are one-thread SFT builds of minutes each (shared/ml/threads.py).
Built when the first test that needs one asks for it, the build starts minutes into the suite,
the test's worker waits on it, and the other tests that need it wait behind the same file lock
(a fresh clone's `make test`: test_multiturn_remote's setup 203-253 s, test_multiturn_demo's and
test_multiturn_vllm's 94-131 s waiting for it with three workers). So when the session starts,
one background process builds whichever of them the collected tests need, one after the other,
while the workers run the tests that need none. A test that asks first waits on the same lock
(shared/ml/models.py `_building`): it never reads a half-built folder, and if the background
build fails the test builds the model itself and fails there, with the error in its own output.
The build's log is .burstrl/logs/prebuild.log. Restored from the machine's model cache, each
"build" is a copy of seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

MODELS = ROOT / ".burstrl" / "models"
TINY = Path(os.environ.get("BURSTRL_TEST_MODEL", MODELS / "tiny-sft"))
CALC = MODELS / "tiny-calc"
TEACHER = MODELS / "tiny-teacher"

# fixture name -> the model it builds, in the order the background process builds them: the
# calculator model first (the longer build, from its own random init); the teacher needs the
# tiny model, which the first worker builds from the suite's first seconds.
PREBUILT = ("calc_model", "teacher_model")
LOG = ROOT / ".burstrl" / "logs" / "prebuild.log"
_PROC = pytest.StashKey[subprocess.Popen[bytes]]()


def prebuilds_for(fixture_names: set[str]) -> list[str]:
    """The builds (fixture names, in build order) that tests using `fixture_names` need."""
    return [name for name in PREBUILT if name in fixture_names]


def build(name: str) -> Path:
    """Build (or restore, or find built) the model behind fixture `name`; the fixtures call this."""
    from shared.ml.models import ensure_calc_model, ensure_teacher_model, ensure_tiny_model

    if name == "tiny_model":
        return ensure_tiny_model(TINY)
    if name == "calc_model":
        return ensure_calc_model(CALC)
    if name == "teacher_model":
        return ensure_teacher_model(TEACHER, ensure_tiny_model(TINY))
    raise ValueError(f"no test model is built for fixture {name!r}; known: tiny_model, {', '.join(PREBUILT)}")


def pytest_collection_finish(session: pytest.Session) -> None:
    # One spawner per session: the first xdist worker, or the process of a serial run (each
    # worker collects every test; the controller collects none).
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or session.config.option.collectonly:
        return
    names: set[str] = set()
    for item in session.items:
        names.update(getattr(item, "fixturenames", ()))
    wanted = prebuilds_for(names)
    if not wanted:
        return
    LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(LOG, "ab") as log:
        # its own session: a Ctrl-C to pytest's group does not hit it mid-write; sessionfinish
        # below stops it by its pid
        session.config.stash[_PROC] = subprocess.Popen(
            [sys.executable, "-m", "tests.support.models", *wanted],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    proc = session.config.stash.get(_PROC, None)
    if proc is None or proc.poll() is not None:
        return
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        proc.terminate()  # the user stopped the run: do not make them wait for a build
    # Otherwise a test of this session asked for what it builds, and another worker may still be
    # waiting on it: let it finish (it holds the file lock; the kernel frees it if it dies).
    try:
        proc.wait(timeout=None if exitstatus != pytest.ExitCode.INTERRUPTED else 10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str]) -> int:
    for name in argv:
        print(f"prebuild: {name} -> {build(name)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
