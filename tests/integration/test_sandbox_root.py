"""The sandbox's filesystem: the interpreter, its stdlib and the payload, nothing else of the host.

Each case runs a real sandbox. Files the tests plant live outside /tmp (the sandbox has
always had a private /tmp, so a file there proves nothing): in /var/tmp, as a job's
dataset or a local database's socket would be somewhere on the host.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.domain.sandbox import Limits, check_isolation, run_code, run_program
from shared.domain.tasks.base import _task_for, score_many
from shared.task_spec import TaskSpec
from tests.support.sandbox import host_folder

ok, why = check_isolation()
pytestmark = pytest.mark.skipif(not ok, reason=f"sandbox unavailable here: {why}")

TIGHT = Limits(cpu_s=2, wall_s=8.0, max_output=1 << 16)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A world-readable directory on the host, outside /tmp (removed afterwards)."""
    with host_folder("burstrl-sandbox-test-") as d:
        yield d


def test_the_dataset_a_task_was_loaded_from_is_unreachable(host_dir: Path) -> None:
    # The reported hack: read the job's own JSONL, print the expected stdout, score 1.0.
    expected = secrets.token_hex(8)
    data = host_dir / "train.jsonl"
    row = {"prompt": "Print the secret.", "tests": json.dumps([{"stdin": "", "stdout": expected}])}
    data.write_text(json.dumps(row) + "\n")
    data.chmod(0o644)
    spec = TaskSpec.model_validate(
        {
            "source": {"kind": "jsonl", "path": str(data), "fields": ["tests"], "heldout_fraction": 0.0},
            "verifiers": [{"name": "code"}],
        }
    )
    task = _task_for("sandbox-hack", "", spec.model_dump_json())
    item = next(iter(task.train_items(0)))
    hack = (
        "```python\nimport json\n"
        f"row = json.loads(open({str(data)!r}).readline())\n"
        "print(json.loads(row['tests'])[0]['stdout'])\n```"
    )
    honest = f"```python\nprint({expected!r})\n```"
    hacked, solved = score_many(task, [hack, honest], item.fields)
    assert solved["code"] == 1.0, solved
    assert hacked["code"] == 0.0 and "code!runtime_error:FileNotFoundError" in hacked, hacked


def test_only_the_interpreter_is_visible(host_dir: Path) -> None:
    (host_dir / "x").write_text("host file")
    hf_home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    paths = ["/srv", "/home", "/var/lib", "/var", "/opt", "/root", "/run", "/sys", "/etc/passwd", "/etc/hostname"]
    paths += [hf_home, str(host_dir), str(REPO)]
    paths += [sys.prefix] if sys.prefix != sys.base_prefix else []  # this test's venv
    code = (
        "import json, os\n"
        f"paths = {paths!r}\n"
        "print(json.dumps({'seen': [p for p in paths if os.path.exists(p)], 'top': sorted(os.listdir('/')),\n"
        "                  'etc': sorted(os.listdir('/etc')) if os.path.isdir('/etc') else []}))\n"
    )
    r = run_program(code, limits=TIGHT)
    assert r.reason == "ok", r
    got = json.loads(r.stdout)
    assert got["seen"] == []
    # The top level holds what the interpreter lives in (usr and the merged-/usr links), the
    # loader's cache, a few device nodes, its own /proc and /tmp: no data directory of the host.
    assert set(got["top"]) <= {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc", "tmp"}
    assert set(got["etc"]) <= {"ld.so.cache"}


def test_the_stdlib_still_works() -> None:
    mods = [
        "collections", "ctypes", "datetime", "decimal", "fractions", "hashlib", "heapq", "itertools", "json",
        "math", "random", "re", "sqlite3", "statistics", "string", "struct", "unicodedata", "zlib", "bz2", "lzma",
    ]  # fmt: skip
    code = "import importlib\nfor m in " + repr(mods) + ":\n    importlib.import_module(m)\nprint('ok')\n"
    code += "import threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
    code += "import os\nif os.fork() == 0:\n    os._exit(0)\nprint(os.wait()[1])\n"
    code += "import hashlib, random\nprint(len(hashlib.sha256(random.randbytes(8)).hexdigest()))\n"
    r = run_program(code, limits=TIGHT)
    assert (r.reason, r.stdout) == ("ok", "ok\nthread\n0\n64\n"), r


def test_site_packages_are_masked() -> None:
    # Installed packages are the host's business: the sandbox sees an empty site-packages.
    code = (
        "import os, sys\n"
        "dirs = [os.path.join(p, d) for p in sys.path for d in ('site-packages', 'dist-packages')]\n"
        "print(sum(len(os.listdir(d)) for d in dirs if os.path.isdir(d)))\n"
    )
    r = run_program(code, limits=TIGHT)
    assert (r.reason, r.stdout) == ("ok", "0\n"), r


def _serve_unix(path: Path, greeting: bytes) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    path.chmod(0o777)
    srv.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.sendall(greeting)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_host_unix_sockets_are_unreachable(host_dir: Path) -> None:
    sock = host_dir / "service.sock"
    srv = _serve_unix(sock, b"hello from the host\n")
    try:
        # Local databases (MariaDB, PostgreSQL) listen on such sockets.
        targets = [str(sock)] + [
            p for p in ("/run/mysqld/mysqld.sock", "/var/run/postgresql/.s.PGSQL.5432") if os.path.exists(p)
        ]
        for target in targets:
            code = (
                "import socket\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(2)\n"
                f"s.connect({target!r})\nprint(s.recv(100))\n"
            )
            r = run_code(code, [{"stdin": "", "stdout": "b'hello from the host\\n'"}], TIGHT)
            assert r.passed == 0 and r.reason.startswith("runtime_error:"), (target, r)
        # the host side can connect: the socket is real
        c = socket.socket(socket.AF_UNIX)
        c.connect(str(sock))
        assert c.recv(100) == b"hello from the host\n"
        c.close()
    finally:
        srv.close()


def _with_masked_proc(script: str, **env: str) -> list:
    """Run `script` in a private mount namespace whose /proc has a path masked, as Docker does."""
    shell = 'mount --bind /dev/null /proc/keys && exec "$0" -c "$1"'
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", shell, sys.executable, script]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full_env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


PROC_SCRIPT = """
import json
from shared.domain.sandbox import SandboxUnavailable, check_isolation, run_code
ok, why = check_isolation()
try:
    ran = run_code("import os\\nprint(os.path.exists('/proc'))", [{"stdin": "", "stdout": "False"}]).reason
except SandboxUnavailable as e:
    ran = "unavailable: " + str(e)
print(json.dumps([ok, why, ran]))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root to mask /proc/keys")
def test_a_failed_private_proc_mount_refuses() -> None:
    # Docker masks /proc paths with bind mounts; a user namespace may then not mount a /proc
    # of its own. Simulated in a private mount namespace of this test (the host is untouched).
    ok_, why_, ran = _with_masked_proc(PROC_SCRIPT)
    assert ok_ is False and "/proc" in why_, why_
    assert ran.startswith("unavailable:") and "/proc" in ran, ran
    # The operator may choose no /proc at all instead (never the host's): then code runs.
    ok_, why_, ran = _with_masked_proc(PROC_SCRIPT, BURSTRL_SANDBOX_PROC="off")
    assert ok_ is True and "no /proc" in why_, why_
    assert ran == "ok", ran
