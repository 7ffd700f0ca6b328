#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (< 8 minutes): build with the CUDA backend, run the
# kernel tests compiled (not interpreted), the kernel benchmark, and an end-to-end run on CUDA lanes.
# Usage: bash bench/gpu_check.sh OUTDIR
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 DPARA_RT_CUDA=ON
unset TRITON_INTERPRET
status=0
step() { echo "== $1"; shift; "$@" || { echo "!! failed: $*"; status=1; }; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
step "build (CUDA backend)" python3 -m pip install -q --no-build-isolation -e .
step "build info" python3 -c "import dpara_rt, json; i = dpara_rt.build_info(); print(json.dumps(i)); json.dump(i, open('$out/build_info.json', 'w')); assert i['cuda_compiled'] and i['cuda_devices'] > 0"
step "core on CUDA" python3 -m pytest -q -x tests/test_core_lanes.py tests/test_core_ring.py --junitxml="$out/core_tests.xml"
step "kernel tests (compiled Triton)" python3 -m pytest -q tests/test_kernel_tree_attention.py tests/test_kernel_markov_head.py tests/test_kernel_verify.py tests/test_kernel_ops.py --junitxml="$out/kernel_tests.xml"
step "kernel benchmark" timeout 180 python3 bench/bench_kernels.py --out "$out/bench_kernels.json"
step "end to end on CUDA lanes" timeout 180 python3 bench/gpu_e2e.py --out "$out/gpu_e2e.json"
echo "gpu_check: done (status $status); results in $out"
exit $status
