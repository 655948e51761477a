#!/usr/bin/env bash
# The GPU check of issue 29, on one CUDA GPU, in under 8 minutes:
#   1. the tests that run on CUDA (encoding and decoding on the device, CUDA indices into the
#      loaders, the diff and the cost model), with the machine's own python3 and torch;
#   2. the cost model calibrated on the GPU (UpdateCost.calibrate(device="cuda"), its figures);
#   3. the main side-by-side bench and the diff bench with --device cuda;
#   4. ./dev bench --engine (vLLM's CUDA build), when `import vllm` works there; otherwise it
#      says so and skips: vLLM is not on the lent GPU machines and its wheel is larger than
#      what can be carried to them.
# Usage, from the repository root: bash benchmarks/gpu_check.sh [OUTPUT_DIR] (default: $OUT, or
# build/gpu-check). Each step's output goes to OUTPUT_DIR/<step>.txt as well as to the terminal;
# a step that fails is reported and the others still run; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-build/gpu-check}}
mkdir -p "$out"
python=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$SECONDS
failed=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, tee its output
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s, at $((SECONDS - start)) s)" | tee -a "$out/summary.txt"
    if timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"; then
        echo "== $name passed" | tee -a "$out/summary.txt"
    else
        echo "== $name FAILED" | tee -a "$out/summary.txt"
        failed+=("$name")
    fi
}

step device 60 "$python" -c '
import torch
assert torch.cuda.is_available(), "no CUDA device"
print(torch.__version__, torch.cuda.get_device_name(0))
'
step tests 150 "$python" -m pytest -q -x -p no:cacheprovider -o addopts="" \
    tests/test_encoding.py tests/test_replay_inputs.py tests/test_cost.py tests/test_prepare.py
step calibrate 60 "$python" -c '
import torch
from patchctx import UpdateCost, prepare
spent = prepare("cuda")
print(f"prepare(cuda): {spent:.2f} s (the first patch load of this process)")
for dtype in (torch.bfloat16, torch.float32):
    cost = UpdateCost.calibrate(numel=2**24, dtype=dtype, device="cuda", link_bytes_per_second=25e9)
    print(dtype)
    print(cost.describe())
'
step bench 120 "$python" -m benchmarks.patch_bench --device cuda --measure time --repeats 3
step diff-bench 60 "$python" -m benchmarks.diff_bench --device cuda
if "$python" -c "import vllm" 2>/dev/null; then
    step engine-bench 240 "$python" -m benchmarks.engine_bench --repeats 2 \
        --densities 0.001 0.01 0.1 --links 0 1.25e8 1.25e9 --json "$out/engine.json"
else
    echo "== engine-bench skipped: vLLM is not importable with $python here" |
        tee -a "$out/summary.txt"
fi
echo "== gpu_check done in $((SECONDS - start)) s; failed: ${failed[*]:-none}" |
    tee -a "$out/summary.txt"
[[ ${#failed[@]} -eq 0 ]]
