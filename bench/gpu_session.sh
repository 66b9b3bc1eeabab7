#!/usr/bin/env bash
# One GPU session, the checks in order of what they tell per minute, within about 12 minutes on
# one H100 / H200; every result also goes to JSON under $OUT (default bench/out), and a table at
# the end. Run from the repository root:  bash bench/gpu_session.sh
#   1. the GPU tests (-m gpu): CUDA paths, flex attention, sync-free steps, comm overlap   ~3 min
#   2. per-module MFU, compiled, training precision (fp32 master, optimizer once per 8
#      microbatches): Llama-7B layers at 8K packed, ViT-H/14 224 px, SD-2.1 U-Net 512 px   ~3 min
#   3. Llama-7B layers on 8K of 4 documents: flex against varlen flash attention           ~1.5 min
#   4. ViT-H on images of 224 / 336 / 448 px: one variable-length batch against per size  ~1.5 min
#   5. step 2 eager (what compiling gains)                                                 ~1.5 min
#   6. the 13B layers, ViT-H at 448 px, 8K of 4 documents (flex), compiled                 ~1.5 min
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PY=${PYTHON:-python}
step() {  # step NAME SECONDS COMMAND...: run with a deadline, keep going whatever it returns
    local name=$1 limit=$2; shift 2
    echo "== $name (at most ${limit}s)"
    local t0=$SECONDS
    timeout --signal=INT "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$OUT/steps.jsonl"
}
: > "$OUT/steps.jsonl"
step "gpu tests" 140 $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu --junitxml "$OUT/gpu_tests.xml"
MODS=(--steps 5 --warmup 2 --accum 8 --master-fp32)
step "modules compiled" 260 $PY bench/gpu_modules.py --modules llm7b,vit,unet512 "${MODS[@]}" --compile --engine \
    --json "$OUT/modules_compiled.json"
step "packed documents" 90 $PY bench/gpu_modules.py --modules llm7b --docs 4 --doc-attention flex,varlen \
    "${MODS[@]}" --compile --json "$OUT/modules_docs.json"
step "mixed image sizes" 90 $PY bench/gpu_modules.py --modules vitmix,vitmix_groups "${MODS[@]}" --compile \
    --json "$OUT/modules_mixed.json"
step "modules eager" 90 $PY bench/gpu_modules.py --modules llm7b,vit,unet512 "${MODS[@]}" \
    --json "$OUT/modules_eager.json"
step "larger shapes" 90 $PY bench/gpu_modules.py --modules llm13b,vit448 --docs 4 "${MODS[@]}" --compile \
    --json "$OUT/modules_larger.json"
$PY bench/gpu_session_table.py "$OUT"
