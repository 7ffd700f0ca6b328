"""Builds the framework-free C++ core with its unit tests (a C++ program, no Python) and runs ctest,
once plainly and once under AddressSanitizer + UndefinedBehaviorSanitizer."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, cwd=ROOT):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.parametrize("variant", ["plain", "sanitized"])
def test_ctest(variant, tmp_path_factory):
    if shutil.which("cmake") is None:
        pytest.fail("cmake is needed to build the C++ tests; install it (apt-get install cmake or pip install cmake)")
    build = tmp_path_factory.mktemp(f"cpp-{variant}")
    args = ["-DDPARA_RT_BUILD_TESTS=ON", "-DCMAKE_BUILD_TYPE=Debug" if variant == "sanitized" else "-DCMAKE_BUILD_TYPE=Release"]
    if variant == "sanitized":
        # cudart's own allocations trip LeakSanitizer; the sanitized build checks the CPU backend.
        args += ["-DDPARA_RT_SANITIZE=ON", "-DDPARA_RT_CUDA=OFF"]
    _run(["cmake", "-S", str(ROOT), "-B", str(build), *args])
    _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)])
    out = _run(["ctest", "--test-dir", str(build), "--output-on-failure"])
    assert "100% tests passed" in out, out
