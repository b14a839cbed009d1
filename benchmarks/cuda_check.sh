#!/usr/bin/env bash
# The CUDA check, one command on a GPU machine (docs/speed.md, "The CUDA path"): the cuda-marked
# test set (tests/cuda), then benchmarks/throughput.py --device cuda with kvserve, kvserve without
# its decode graphs, and transformers. Logs and JSON go to $OUT (default /tmp/cuda_check).
#
#   bash benchmarks/cuda_check.sh              # from the repository root, on the GPU machine
#
# That machine's own python3 and packages are used (torch with CUDA, transformers); a missing
# package can be carried as wheels in .whl/ (installed to /tmp/site). KVSERVE_NATIVE=0 skips the
# CPU kernels' build: the CPU engines the tests compare against run on the torch path.
set -uo pipefail
OUT=${OUT:-/tmp/cuda_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVSERVE_NATIVE=${KVSERVE_NATIVE:-0}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  grep -m1 "model name" /proc/cpuinfo
} 2>&1 | tee "$OUT/machine.txt"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -q -rfEs tests/cuda 2>&1 | tee "$OUT/cuda_tests.log"
echo "tests exit ${PIPESTATUS[0]}" | tee -a "$OUT/cuda_tests.log"
timeout "${BENCH_TIMEOUT:-360}" python3 benchmarks/throughput.py --device cuda --repeats "${REPEATS:-3}" \
  --engines "${ENGINES:-kvserve,kvserve-eager,transformers}" ${BENCH_ARGS:-} --out "$OUT/throughput_cuda.json" 2>&1 \
  | tee "$OUT/throughput_cuda.log"
echo "bench exit ${PIPESTATUS[0]}" | tee -a "$OUT/throughput_cuda.log"
if [ -n "${PROFILE:-}" ]; then
  timeout "${PROFILE_TIMEOUT:-240}" python3 benchmarks/cuda_step_profile.py --out "$OUT/cuda_step_profile.json" 2>&1 \
    | tee "$OUT/cuda_step_profile.log"
fi
