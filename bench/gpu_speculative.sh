#!/usr/bin/env bash
# GPU figures for speculative decoding (docs/benchmarks.md, "Speculative decoding"):
#   bash bench/gpu_speculative.sh SECTION...     (run from the repo root on a CUDA machine)
# Sections:
#   oracle   Llama-3.1-8B shape, proposals = the target's own greedy continuation (100% accepted),
#            k = 4, batch 1, 8, 32, 128: verify steps against plain steps, tokens/s
#   k-sweep  the same at batch 1 and 32 for k = 1, 2, 4, 8 (where speculation stops paying)
#   draft    a 1B-shaped draft model (llama-3.2-1b) beside the 8B shape, k = 4, batch 1, 8, 32:
#            the draft's time per round against the target's step, and the acceptance at
#            which drafting pays (random weights: nothing is accepted)
#   oracle32 the oracle at batch 1 and 8 in float32: in bf16 a verify step's rounding flips
#            near-tied greedy choices of random weights (the JSON's greedy_match), so the
#            100%-acceptance mechanics are read where the choices do not tie
# Real acceptance (n-gram on copy-heavy prompts) needs the default model's weights, which do not
# travel to the GPU machine: measure it on CPU (pdserve bench spec-decode --proposer ngram).
# Results (JSON) go to $OUT (or ./gpu-out).
source "$(dirname "$0")/gpu_common.sh"
oracle() { local name=$1 sizes=$2 k=$3; shift 3
           run 240 $py -m pdserve.cli bench spec-decode --model-shape llama-3.1-8b --proposer oracle \
             --num-speculative-tokens "$k" --batch-sizes "$sizes" --prompt-len 1024 --output-len 64 \
             --max-model-len 2048 --max-num-batched-tokens 16384 --output-json "$out/spec-$name.json" "$@"; }
for section in "$@"; do
  case $section in
    oracle) oracle oracle-k4 1,8,32,128 4 ;;
    k-sweep) for k in 1 2 8; do oracle "oracle-k$k" 1,32 "$k"; done ;;
    oracle32) oracle oracle-k4-fp32 1,8 4 --dtype float32 ;;
    draft) run 300 $py -m pdserve.cli bench spec-decode --model-shape llama-3.1-8b --proposer draft \
             --draft-shape llama-3.2-1b --num-speculative-tokens 4 --batch-sizes 1,8,32 --prompt-len 1024 \
             --output-len 64 --max-model-len 2048 --max-num-batched-tokens 16384 --output-json "$out/spec-draft-1b.json" ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
