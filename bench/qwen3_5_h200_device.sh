#!/bin/bash
# bench/qwen3_5_h200.py on the device machine from a carried copy of this branch (issue 29, H200 run 2).
# The image has torch, transformers and einops; it lacks fla-core, so:
#   here:  DIR=/work/main/.wt/qwen29 (git-ignored in main); DIR/repo = `git ls-files` of this branch;
#          DIR/whl/fla_core-0.6.0-py3-none-any.whl; DIR/go.sh = this file
#   call:  carry [".wt/qwen29"]   command: COMMIT=<sha> TOTAL_S=280 BENCH_S=260 BUDGET_S=190 bash .wt/qwen29/go.sh
#   (run 2: 261 s of command, 310 s of device time with the start; the graphs part alone:
#    BENCH_ARGS="--skip 9B,speed,27B,kernels")
# Results in $OUT: qwen3_5_h200.json (rewritten after every step), log.txt, smi.txt, gpu_test.txt (the CUDA
# graphs test, tests/engine/test_qwen3_5_kernels.py, run without pytest's conftest when time is left).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
[ -n "${NOPIP:-}" ] || pip install -q --no-index --no-deps --target /tmp/site "$HERE"/whl/*.whl
export PYTHONPATH=/tmp/site:$HERE/repo PYTHONUNBUFFERED=1 KVMEM_COMMIT="${COMMIT:-}"
cd "$HERE/repo"
OUTD="${OUT:-/tmp/out}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUTD/smi.txt" 2>&1
python3 -c "import torch, transformers, einops; print(torch.__version__, transformers.__version__)"
timeout "${BENCH_S:-280}" python3 -m bench.qwen3_5_h200 --out "$OUTD/qwen3_5_h200.json" --budget-s "${BUDGET_S:-200}" ${BENCH_ARGS:-} \
  > "$OUTD/log.txt" 2>&1
echo "bench rc $?"
grep -v "Warning\|warn(" "$OUTD/log.txt" | cut -c1-400 | tail -40
LEFT=$(( ${TOTAL_S:-300} - SECONDS ))
echo "left ${LEFT}s"
if [ "$LEFT" -gt 45 ]; then
  timeout "$LEFT" python3 -c "from tests.engine.test_qwen3_5_kernels import test_decode_graphs_replay_as_the_eager_runner as t; t(); print('GPU TEST PASSED')" > "$OUTD/gpu_test.txt" 2>&1
  echo "gpu test rc $?"; tail -5 "$OUTD/gpu_test.txt"
fi
