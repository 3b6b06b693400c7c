"""What the sandbox's root holds: its interpreter, the stdlib and the libraries they load.

The harness builds the root inside the new mount namespace, on an empty tmpfs, from the
plan made here: each path below is bound read-only at its own place, and every symlink on
the way to it (merged /usr's /lib -> usr/lib, python3 -> python3.11, the libraries'
soname links) is recreated as a symlink. Nothing else of the host is there: no dataset,
no model cache, no home folder, no database socket, no file the service user can read.

The interpreter is asked (once, as the sandbox's own uid, so a path it cannot read fails
here, loudly) for its module path; `ldd` names the shared libraries that the interpreter
and its extension modules load. site-packages and dist-packages inside the stdlib are
covered by empty folders: the sandbox runs `python -I -S`, so installed packages are not
its business.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import threading
from typing import Any

from shared.domain.sandbox.errors import SandboxUnavailable

PROBE = (
    "import json, os, sys\n"
    "paths = [p for p in sys.path if os.path.exists(p)]\n"
    "exts = [os.path.join(d, n) for d in paths if os.path.isdir(d) for n in sorted(os.listdir(d)) if n.endswith('.so')]\n"
    "print(json.dumps({'paths': paths, 'exts': exts}))\n"
)
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
LOADER_CACHE = "/etc/ld.so.cache"  # where the dynamic loader finds libraries outside its default folders
MASKED = ("site-packages", "dist-packages")
# Where the harness builds the root before pivoting into it: an existing folder that no
# bound path lives under (the build hides the folder's own contents from the build).
STAGES = ("/tmp", "/mnt", "/media", "/srv", "/var/tmp")
_LDD_LINE = re.compile(r"^\s+(?:\S+\s+=>\s+)?(/\S+)\s+\(0x[0-9a-fA-F]+\)\s*$")

_plans: dict[tuple[Any, ...], dict[str, Any]] = {}
_lock = threading.Lock()


def _unavailable(python: str, why: str) -> SandboxUnavailable:
    return SandboxUnavailable(
        f"BURSTRL_SANDBOX_PYTHON={python} cannot run as the sandbox's unprivileged uid: {why} "
        "(point it at an interpreter every user can read and execute, e.g. /usr/bin/python3)"
    )


def _probe(python: str, ids: dict[str, Any]) -> dict[str, list[str]]:
    try:
        out = subprocess.run(
            [python, "-I", "-S", "-c", PROBE],
            capture_output=True,
            timeout=60,
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            **ids,
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise _unavailable(python, str(e)) from e
    if out.returncode != 0:
        raise _unavailable(python, out.stderr.decode(errors="replace").strip()[-300:] or f"exit {out.returncode}")
    try:
        got = json.loads(out.stdout)
        return {"paths": [str(p) for p in got["paths"]], "exts": [str(p) for p in got["exts"]]}
    except (ValueError, KeyError, TypeError) as e:
        raise _unavailable(python, f"unexpected answer from its probe: {e}") from e


def _libraries(files: list[str]) -> list[str]:
    ldd = shutil.which("ldd")
    if ldd is None:
        raise SandboxUnavailable("the sandbox needs `ldd` (Debian: libc-bin) to find the interpreter's libraries")
    # ldd exits non-zero when any file is not dynamic (e.g. a static interpreter): read what it found.
    out = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60, env={"LC_ALL": "C"})
    return [m.group(1) for line in out.stdout.splitlines() if (m := _LDD_LINE.match(line))]


def _walk(path: str, ops: dict[str, list[str]], hops: int = 0) -> None:
    """Add the ops that make `path` resolve in the new root as it does on the host."""
    if hops > 40:
        raise SandboxUnavailable(f"too many symlinks on the way to {path}")
    parts = [p for p in path.split("/") if p and p != "."]
    cur = ""
    for k, name in enumerate(parts):
        if name == "..":  # `cur` holds no symlink, so going up is plain string work
            cur = cur.rsplit("/", 1)[0]
            continue
        nxt = f"{cur}/{name}"
        st = os.lstat(nxt)
        rest = parts[k + 1 :]
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(nxt)
            ops.setdefault(nxt, ["symlink", nxt, target])
            base = target if target.startswith("/") else f"{cur}/{target}"
            _walk("/".join([base, *rest]), ops, hops + 1)
            return
        if not rest:
            ops.setdefault(nxt, ["bind", nxt])
            return
        if not stat.S_ISDIR(st.st_mode):
            raise SandboxUnavailable(f"{nxt} is not a folder (on the way to {path})")
        cur = nxt


def _under(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def make_plan(python: str, ids: dict[str, Any]) -> dict[str, Any]:
    """The root's plan for `python`: {"stage": folder, "ops": [[kind, path, (target)], ...]}."""
    probe = _probe(python, ids)
    real = os.path.realpath(python)
    wanted = [python, *probe["paths"], *_libraries([real, *probe["exts"]])]
    wanted += [p for p in (LOADER_CACHE, *DEVICES) if os.path.exists(p)]
    ops: dict[str, list[str]] = {}
    try:
        for p in wanted:
            _walk(os.path.abspath(p), ops)
    except OSError as e:
        raise _unavailable(python, f"{e.filename}: {e.strerror}") from e
    folders = [p for p, op in ops.items() if op[0] == "bind" and os.path.isdir(p)]
    # Whatever lies inside a bound folder comes with it (and could not be added to it: read-only).
    plan = [op for p, op in ops.items() if not any(_under(p, f) for f in folders)]
    plan += [["mask", f"{f}/{m}"] for f in folders for m in MASKED if os.path.isdir(f"{f}/{m}")]
    paths = [op[1] for op in plan]
    for stage in STAGES:
        if (
            os.path.isdir(stage)
            and not os.path.islink(stage)
            and not any(p == stage or _under(p, stage) for p in paths)
        ):
            return {"stage": stage, "ops": plan}
    raise SandboxUnavailable(f"no folder to build the sandbox's root in: each of {STAGES} is missing or in use")


def root_plan(python: str, ids: dict[str, Any]) -> dict[str, Any]:
    """make_plan, cached per interpreter (and its file's identity, so an upgrade re-plans)."""
    try:
        st = os.stat(python)
    except OSError as e:
        raise _unavailable(python, e.strerror or str(e)) from e
    key = (python, st.st_ino, st.st_mtime_ns, bool(ids))  # any pool uid reads what another one does
    with _lock:
        if key not in _plans:
            _plans[key] = make_plan(python, ids)
        return _plans[key]
