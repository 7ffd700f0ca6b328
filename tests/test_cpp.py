"""Builds the framework-free C++ core with its unit tests (a C++ program, no Python) and runs ctest,
once plainly and once under AddressSanitizer + UndefinedBehaviorSanitizer; installs the core and builds
examples/cpp against the installed CMake package, as a C++ consumer would."""
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


def _require_cmake():
    if shutil.which("cmake") is None:
        pytest.fail("cmake is needed to build the C++ tests; install it (apt-get install cmake or pip install cmake)")


@pytest.mark.parametrize("variant", ["plain", "sanitized"])
def test_ctest(variant, tmp_path_factory):
    _require_cmake()
    build = tmp_path_factory.mktemp(f"cpp-{variant}")
    args = ["-DDPARA_RT_BUILD_TESTS=ON", "-DCMAKE_BUILD_TYPE=Debug" if variant == "sanitized" else "-DCMAKE_BUILD_TYPE=Release"]
    if variant == "sanitized":
        # cudart's own allocations trip LeakSanitizer; the sanitized build checks the CPU backend.
        args += ["-DDPARA_RT_SANITIZE=ON", "-DDPARA_RT_CUDA=OFF"]
    _run(["cmake", "-S", str(ROOT), "-B", str(build), *args])
    _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)])
    out = _run(["ctest", "--test-dir", str(build), "--output-on-failure"])
    assert "100% tests passed" in out, out


def test_installed_package_builds_and_runs_the_example(tmp_path):
    """cmake --install gives find_package(dpara_rt) -> dpara_rt::core; the toy decoding loop of examples/cpp
    links against it and reproduces autoregressive decoding."""
    _require_cmake()
    build, prefix, example = tmp_path / "core", tmp_path / "prefix", tmp_path / "example"
    _run(["cmake", "-S", str(ROOT), "-B", str(build), "-DDPARA_RT_CUDA=OFF", "-DDPARA_RT_BUILD_TESTS=OFF",
          "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_INSTALL_PREFIX={prefix}"])
    _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)])
    _run(["cmake", "--install", str(build)])
    assert (prefix / "include" / "dpara_rt" / "lane.h").is_file()
    _run(["cmake", "-S", str(ROOT / "examples" / "cpp"), "-B", str(example), f"-DCMAKE_PREFIX_PATH={prefix}"])
    _run(["cmake", "--build", str(example), "-j", str(os.cpu_count() or 2)])
    out = _run([str(example / "toy_decode")])
    assert "identical to autoregressive decoding" in out, out
