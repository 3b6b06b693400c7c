"""Every bench/ script loads: its imports resolve in this tree (a harness module that moved
broke `make bench` once: bench/backlog.py still imported tests.backlog_helpers).

Run as a separate process, as `make bench` runs them; tests never import bench/ themselves."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT

# Load each script as a module (not as __main__: nothing runs), one process for all of them.
LOAD_ALL = """
import importlib.util, pathlib, sys
failed = []
for path in sorted(pathlib.Path("bench").glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"bench_check.{path.stem}", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        failed.append(f"{path}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_bench_script_loads():
    proc = subprocess.run([sys.executable, "-c", LOAD_ALL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
