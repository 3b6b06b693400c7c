"""The sandbox in non-root mode, the container default: its caller runs as uid 10001.

Real, not simulated: the test (root) starts a process that drops to uid 10001 with
`setpriv` and calls the sandbox there, at the reward service's default concurrency
(4 workers x parallel=4 = 16 runs at once), beside a fork bomb, while the caller holds
more idle threads than one run may have processes. The caller's code and packages are
bind-mounted into a world-readable directory in a private mount namespace of the test,
so that uid 10001 can import them wherever this checkout and its venv live.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.domain.sandbox import check_isolation
from tests.support.sandbox import host_folder

SERVICE_UID = 10001  # the images' user (deploy/)
REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"

ok, why = check_isolation()


def _system_python_matches() -> bool:
    # The caller runs on the system interpreter with this venv's packages: same minor version.
    try:
        out = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True)
    except OSError:
        return False
    return out.stdout.decode().strip() == str(sys.version_info[:2])


pytestmark = [
    pytest.mark.skipif(not ok, reason=f"sandbox unavailable here: {why}"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a caller as uid 10001"),
    pytest.mark.skipif(not (shutil.which("setpriv") and shutil.which("unshare")), reason="needs util-linux"),
    pytest.mark.skipif(not _system_python_matches(), reason=f"{SYSTEM_PYTHON} is not Python {sys.version_info[:2]}"),
]

CALLER = r"""
import json, sys, threading
from concurrent.futures import ThreadPoolExecutor
from shared.domain.sandbox import Limits, check_isolation, run_code, run_program

home = sys.argv[1]
ok, why = check_isolation()
stop = threading.Event()
for _ in range(40):  # more threads than a run's process limit (32): they must not count against runs
    threading.Thread(target=stop.wait, daemon=True).start()
ADD = [{"stdin": "1 2", "stdout": "3"}, {"stdin": "5 7", "stdout": "12"}]
GOOD = "a, b = map(int, input().split())\nprint(a + b)\n"
# Forks until refused, then keeps what it has: the process limit, not CPU, is what it tests.
BOMB = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.05)\n"
lim = Limits(wall_s=20.0)  # the defaults (nproc=32, ...), with wall-clock room for a loaded 2-core box
with ThreadPoolExecutor(17) as ex:
    bomb = ex.submit(run_code, BOMB, ADD, Limits())  # holds its processes for the default 6 s
    honest = list(ex.map(lambda code: run_code(code, ADD, lim), [GOOD] * 16))
    runs = [bomb.result()] + honest
COUNT = (
    "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
    "        n += 1\nexcept OSError:\n    print(n)\n"
)
forked = run_program(COUNT, limits=Limits(wall_s=20.0)).stdout
secret = f"{home}/secret"
peek = run_code(f"print(open({secret!r}).read())", [{"stdin": "", "stdout": "s3cret"}], lim)
stop.set()
print(json.dumps({
    "ok": ok, "why": why,
    "bomb": [runs[0].fraction, runs[0].reason],
    "honest": [[r.fraction, r.reason, r.detail, round(r.seconds, 2)] for r in runs[1:]],
    "caller_reads_secret": open(secret).read() == "s3cret",
    "peek": [peek.fraction, peek.reason],
    "forked": forked,
}))
"""


@pytest.fixture
def service_home() -> Iterator[Path]:
    """A world-traversable folder with mount points for the code, the packages, and the user's files."""
    with host_folder("burstrl-nonroot-") as d:
        for sub in ("src", "site", "home"):
            (d / sub).mkdir()
        home = d / "home"
        os.chown(home, SERVICE_UID, SERVICE_UID)
        secret = home / "secret"
        secret.write_text("s3cret")
        os.chown(secret, SERVICE_UID, SERVICE_UID)
        secret.chmod(0o600)
        yield d


def run_as_service_user(d: Path) -> dict:
    site = sysconfig.get_paths()["purelib"]
    shell = (
        'mount --bind "$1" "$3/src" && mount --bind "$2" "$3/site" && '
        f"exec setpriv --reuid={SERVICE_UID} --regid={SERVICE_UID} --clear-groups -- "
        'env -i PATH=/usr/bin:/bin LANG=C.UTF-8 HOME="$3/home" PYTHONPATH="$3/src:$3/site" '
        f'{SYSTEM_PYTHON} -c "$4" "$3/home"'
    )
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", shell, "sh"]
    cmd += [str(REPO), site, str(d), CALLER]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_non_root_mode_at_the_default_concurrency(service_home: Path) -> None:
    got = run_as_service_user(service_home)
    assert got["ok"], got["why"]
    failed = [h for h in got["honest"] if h[0] != 1.0]
    assert failed == [], f"{len(failed)} of 16 honest runs failed beside a fork bomb: {failed[:3]}"
    assert got["bomb"][0] == 0.0
    # the limit is the run's own: 32 processes, of which the harness holds a few
    assert 20 <= int(got["forked"]) < 32, got["forked"]
    # the service user's own 0600 file: readable by the service, not from its sandbox
    assert got["caller_reads_secret"]
    assert got["peek"] == [0.0, "runtime_error:FileNotFoundError"], got["peek"]
