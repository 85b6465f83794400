#!/usr/bin/env bash
# GPU checks and figures for the model families (docs/benchmarks.md, "Model families"):
#   bash bench/gpu_families.sh SECTION...     (run from the repo root on a CUDA machine)
# Sections: tests, kernels, moe-step, moe-peer, dense-step, dense-peer, moe-offline.
# Results (JSON) go to $OUT (or ./gpu-out); PDSERVE_CACHE_DIR keeps the fused-MoE tuning
# between sections.
source "$(dirname "$0")/gpu_common.sh"
for section in "$@"; do
  case $section in
    tests) run 220 $py -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fused_moe.py \
             tests/kernels/test_paged_attention.py tests/engine/test_model_families_gpu.py > "$out/tests.log" 2>&1
           $py -m pytest -q -p no:cacheprovider tests/kernels/test_moe_routing.py >> "$out/tests.log" 2>&1
           grep -E "passed|failed|^FAILED|^ERROR" "$out/tests.log" ;;
    kernels) run 150 $py -m pdserve.cli bench kernels --output-json "$out/kernels.json" ;;
    moe-step) run 200 $py -m pdserve.cli bench decode-step --model-shape qwen3-30b-a3b \
                --batch-sizes 1,32,128,256 --context-len 1024 --steps 10 --max-model-len 2048 \
                --max-num-batched-tokens 16384 --profile 3 --output-json "$out/decode-step-qwen3-30b-a3b.json" ;;
    moe-peer) run 300 $py -m pdserve.cli bench decode-step --model-shape qwen3-30b-a3b --batch-sizes 1,32,128 \
                --context-len 1024 --steps 5 --peer transformers --peer-eager \
                --output-json "$out/decode-step-qwen3-30b-a3b-peer.json" ;;
    dense-step) run 240 $py -m pdserve.cli bench decode-step --model-shape qwen3-8b \
                  --batch-sizes 1,32,128,256 --context-len 1024 --steps 10 --max-model-len 2048 \
                  --max-num-batched-tokens 16384 --output-json "$out/decode-step-qwen3-8b.json" ;;
    dense-peer) run 300 $py -m pdserve.cli bench decode-step --model-shape qwen3-8b --batch-sizes 1,32,128 \
                  --context-len 1024 --steps 10 --peer transformers \
                  --output-json "$out/decode-step-qwen3-8b-peer.json" ;;
    moe-offline) run 200 $py -m pdserve.cli bench offline --model-shape qwen3-30b-a3b --num-prompts 256 \
                   --min-prompt-len 512 --max-prompt-len 512 --output-len 128 --max-num-batched-tokens 8192 \
                   --output-json "$out/offline-qwen3-30b-a3b.json" ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
find "$PDSERVE_CACHE_DIR/moe_configs" -name '*.json' -exec cp {} "$out/" \; 2>/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
