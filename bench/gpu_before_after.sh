#!/usr/bin/env bash
# One GPU, one call: the same benchmarks on two source trees, interleaved, so that a change
# that must not move the figures (a restructuring) is measured against its base on the same
# machine. The trees are copies of two commits (made here with `git archive`, carried as .gpu):
#   mkdir -p .gpu/before .gpu/after
#   git archive BASE | tar -x -C .gpu/before; git archive HEAD | tar -x -C .gpu/after
#   bash bench/gpu_before_after.sh SECTION...     # decode-step | offline | serve
# decode-step: Llama-3.1-8B shape, batch 1/32/128/256, 1k context, before/after/before/after.
# offline: 256 x (512 in, 128 out), before then after. JSON per run in $OUT.
# serve: colocated goodput, `bench/gpu_serve.sh defaults` in each tree (RATES, default 8,12),
#   results in $OUT/before and $OUT/after (carry .gpucache too: the serving stack's wheels).
source "$(dirname "$0")/gpu_common.sh"
root=$PWD
for section in "$@"; do
  case $section in
    decode-step)
      for round in 1 2; do
        for tree in before after; do
          (cd "$root/.gpu/$tree" && run 200 $py -m pdserve.cli bench decode-step --model-shape llama-3.1-8b \
             --batch-sizes 1,32,128,256 --context-len 1024 --steps 20 \
             --output-json "$out/decode-step-$tree-$round.json" 2>&1 | grep -vE "^(WARNING|INFO)")
        done
      done ;;
    offline)
      for tree in before after; do
        (cd "$root/.gpu/$tree" && run 200 $py -m pdserve.cli bench offline --model-shape llama-3.1-8b \
           --num-prompts 256 --min-prompt-len 512 --max-prompt-len 512 --output-len 128 \
           --max-num-batched-tokens 8192 --skip-transformers --output-json "$out/offline-$tree.json" 2>&1 \
           | grep -vE "^(WARNING|INFO)")
      done ;;
    serve)
      for tree in before after; do
        mkdir -p "$out/$tree"
        (cd "$root/.gpu/$tree" && ln -sfn "$root/.gpucache" .gpucache \
           && OUT="$out/$tree" RATES=${RATES:-8,12} bash bench/gpu_serve.sh defaults 2>&1 | grep -vE "^(WARNING|INFO)")
      done ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
