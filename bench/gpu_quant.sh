#!/usr/bin/env bash
# GPU figures for quantization (docs/benchmarks.md, "Quantization on one H200"), all in one call
# so that the 16-bit and quantized runs share the machine:
#   bash bench/gpu_quant.sh SECTION...     (run from the repo root on a CUDA machine)
# Sections:
#   step-bf16   decode step, Llama-3.1-8B shape, bf16 weights and KV, batch 1, 32, 256
#   step-fp8    the same with --quantization fp8 (W8A8, per-channel weights), batch 1, 32
#   step-kv8    the same with --kv-cache-dtype fp8 (bf16 weights), batch 256
#   step-int4   the same with --quantization gptq (int4, groups of 128), batch 1
#   gemm        the FP8 GEMM against bf16 at the projection shapes (bench/fp8_gemm.py)
#   offline     256 x (512 -> 128) offline, bf16 and FP8 W8A8 + FP8 KV
# Results (JSON) go to $OUT (or ./gpu-out).
source "$(dirname "$0")/gpu_common.sh"
step() { local name=$1 sizes=$2; shift 2
         run 150 $py -m pdserve.cli bench decode-step --model-shape llama-3.1-8b --batch-sizes "$sizes" \
           --context-len 1024 --steps 10 --max-model-len 2048 --max-num-batched-tokens 16384 \
           --output-json "$out/decode-step-$name.json" "$@" 2>&1 | grep -E "^(batch|decode|==|Traceback|.*Error)"; }
offline() { local name=$1; shift
            run 150 $py -m pdserve.cli bench offline --model-shape llama-3.1-8b --num-prompts 256 \
              --min-prompt-len 512 --max-prompt-len 512 --output-len 128 --max-num-batched-tokens 8192 \
              --output-json "$out/offline-$name.json" "$@" 2>&1 | grep -E "^(pdserve|==|Traceback|.*Error)"; }
for section in "$@"; do
  case $section in
    step-bf16) step bf16 1,32,256 ;;
    step-fp8) step fp8 1,32 --quantization fp8 ;;
    step-kv8) step kv8 256 --kv-cache-dtype fp8 ;;
    step-int4) step int4 1 --quantization gptq ;;
    gemm) run 150 $py -m bench.fp8_gemm --output-json "$out/fp8-gemm.json" 2>&1 | tail -60 ;;
    offline) offline bf16; offline fp8 --quantization fp8 --kv-cache-dtype fp8 ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
