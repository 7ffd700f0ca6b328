#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (< 8 minutes): build with the CUDA backend, run the
# core's device tests (C++ and Python: device ring, pinned staging, CUDA lanes ordered by events), the kernel
# tests compiled (not interpreted), the kernel benchmark, and an end-to-end run on CUDA lanes. Ends with one
# PASS/FAIL line per check and an overall PASS or FAIL (exit status 1 on FAIL).
# Usage: bash bench/gpu_check.sh OUTDIR
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 DPARA_RT_CUDA=ON
unset TRITON_INTERPRET
jobs=$(nproc 2>/dev/null || echo 4)

results=()
step() {
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "== $name"
  "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then results+=("PASS  $name ($((SECONDS - t0)) s)")
  else results+=("FAIL  $name (exit $rc, $((SECONDS - t0)) s)"); fi
}

cpp_tests() {  # the C++ unit tests on a CUDA build: their device branches run only where a GPU is seen
  cmake -S . -B build/gpu-cpp -DDPARA_RT_CUDA=ON -DDPARA_RT_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release &&
    cmake --build build/gpu-cpp -j "$jobs" &&
    ctest --test-dir build/gpu-cpp --output-on-failure
}

step "GPU visible" bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee '$out/gpu.txt'"
step "build (CUDA backend)" python3 -m pip install -q --no-build-isolation -e .
# The device tests branch on what the core and torch see: both must see the GPU, or they test the wrong branch.
step "build info sees the GPU" python3 -c "
import dpara_rt, json, torch
i = dpara_rt.build_info(); i['torch_cuda'] = torch.cuda.is_available()
print(json.dumps(i)); json.dump(i, open('$out/build_info.json', 'w'))
assert i['cuda_compiled'] and i['cuda_devices'] > 0 and i['torch_cuda'], 'no CUDA device seen by the core or torch'"
step "C++ core tests on CUDA" cpp_tests
step "core tests on CUDA" python3 -m pytest -q -rs tests/test_core_lanes.py tests/test_core_ring.py tests/test_core_round.py --junitxml="$out/core_tests.xml"
step "kernel tests (compiled Triton)" python3 -m pytest -q tests/test_kernel_tree_attention.py tests/test_kernel_markov_head.py tests/test_kernel_verify.py tests/test_kernel_ops.py --junitxml="$out/kernel_tests.xml"
step "kernel benchmark" timeout 180 python3 bench/bench_kernels.py --out "$out/bench_kernels.json"
step "end to end on CUDA lanes" timeout 180 python3 bench/gpu_e2e.py --out "$out/gpu_e2e.json"

echo "== summary (results in $out)"
printf '%s\n' "${results[@]}" | tee "$out/summary.txt"
if printf '%s\n' "${results[@]}" | grep -q '^FAIL'; then
  echo FAIL | tee -a "$out/summary.txt"
  exit 1
fi
echo PASS | tee -a "$out/summary.txt"
