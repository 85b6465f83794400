#!/usr/bin/env bash
# Expert parallelism against tensor parallelism and one GPU, Qwen3-30B-A3B shape (two GPUs):
#   bash bench/gpu_expert_parallel.sh       (repo root, a machine with two CUDA GPUs)
source "$(dirname "$0")/gpu_common.sh"
common=(bench decode-step --model-shape qwen3-30b-a3b --batch-sizes 1,32,128 --context-len 1024 --steps 10
        --max-model-len 2048 --max-num-batched-tokens 16384 --max-num-seqs 128)
for variant in ep2 tp2 one; do
  case $variant in
    ep2) extra=(--tensor-parallel-size 2 --enable-expert-parallel) ;;
    tp2) extra=(--tensor-parallel-size 2) ;;
    one) extra=() ;;
  esac
  echo "== $variant"
  timeout 150 $py -m pdserve.cli "${common[@]}" "${extra[@]}" --output-json "$out/decode-step-qwen3-30b-a3b-$variant.json" \
    2>&1 | grep -E "^batch|Error|error" ; echo "== rc=${PIPESTATUS[0]}"
done
