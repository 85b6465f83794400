#!/usr/bin/env bash
# GPU figures for multi-LoRA (docs/benchmarks.md, "Multi-LoRA"):
#   bash bench/gpu_lora.sh SECTION...     (run from the repo root on a CUDA machine)
# Sections:
#   check    the shrink/expand kernels against their references on the GPU (bf16, fp16, fp32)
#   steps    Llama-3.1-8B shape, 8 random adapters of rank 16 on every linear layer: decode steps
#            at batch 32 and 256 with and without adapter rows, an 8k-token prefill plain and
#            under one adapter, an adapter's load time (bench/lora_steps.py)
#   long     the same shape, batch 32 of 4k-token prompts under adapters against plain
# Results (JSON) go to $OUT (or ./gpu-out).
source "$(dirname "$0")/gpu_common.sh"
for section in "$@"; do
  case $section in
    check) run 300 $py -m pytest -q -p no:cacheprovider tests/kernels/test_lora.py ;;
    steps) run 400 $py -m bench.lora_steps --model-shape llama-3.1-8b --adapters 8 --rank 16 --batch-sizes 32,256 \
             --context-len 1024 --steps 10 --prefill-len 8192 --output-json "$out/lora-steps.json" ;;
    long) run 300 $py -m bench.lora_steps --model-shape llama-3.1-8b --adapters 8 --rank 16 --batch-sizes 32 \
            --context-len 4096 --steps 10 --prefill-len 4096 --output-json "$out/lora-steps-4k.json" ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
