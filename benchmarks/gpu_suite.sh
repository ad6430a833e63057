#!/usr/bin/env bash
# Everything that needs a GPU, in one call: the GPU tests, then the engine benchmark on
# gpt-oss-20b and -120b shapes. Logs and JSON go to ${OUT:-gpu-results}/.
#   bash benchmarks/gpu_suite.sh [quick]
set -uo pipefail
out=${OUT:-gpu-results}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
step() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS; "$@" > "$out/$name.log" 2>&1; local rc=$?;
         echo "=== $name rc=$rc $((SECONDS - t0))s"; tail -n ${TAIL:-25} "$out/$name.log"; }
# The tests marked `gpu`, then the kernel tests (they run their Triton kernels on the GPU when
# there is one, under the interpreter otherwise).
step gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/inference ${GPU_TESTS_EXTRA:-}
step kernel_tests python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/inference/ops tests/inference/sample \
  tests/inference/runner
[ "${1:-}" = quick ] && exit 0
TAIL=40 step bench_20b python3 benchmarks/bench_engine.py --model 20b --profile --hf --json "$out/bench_20b.json"
step bench_20b_async python3 benchmarks/bench_engine.py --model 20b --async-scheduling --batches 1,8,64,128
step bench_120b python3 benchmarks/bench_engine.py --model 120b --batches 1,64 --json "$out/bench_120b.json"
step bench_20b_ngram python3 benchmarks/bench_engine.py --model 20b --speculative ngram --json "$out/bench_20b_ngram.json"
