#!/usr/bin/env bash
# One GPU, one call: the KV cache groups and the hybrid models on CUDA.
#   bash bench/gpu_groups.sh [SECTION...]      # tests | capacity | decode (default: all three)
# tests:    tests/engine/test_cache_groups_gpu.py (Qwen3-Next, Qwen3.5, Gemma 3 through CUDA graphs,
#           chunked prefill and state snapshots, against transformers on the same GPU)
# capacity: Gemma 3-12B at 32k tokens: requests that fit, KV per request against what its layers
#           need, with the groups and with --disable-hybrid-kv-cache-manager (JSON in $OUT)
# decode:   a Qwen3.5 shape (QWEN_SHAPE; the 27B one's float32 construction needs more than 80 GB), decode step at batch 1/32/128, 1k context
source "$(dirname "$0")/gpu_common.sh"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(tests capacity decode)
for section in "${sections[@]}"; do
  case $section in
    tests)
      run ${TESTS_LIMIT:-200} $py -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cache_groups_gpu.py \
        tests/engine/test_gemma4.py 2>&1 | tail -15 ;;
    capacity)
      for flag in ${CAPACITY_FLAGS:-""}; do
        run 100 $py -m bench.cache_capacity --model-shape gemma-3-12b --context-len 32768 $flag 2>&1 \
          | grep -vE "^(WARNING|INFO|==)" | tail -1 | tee "$out/capacity-gemma-3-12b${flag:+-one-table}.json"
      done ;;
    decode)
      run 150 $py -m pdserve.cli bench decode-step --model-shape ${QWEN_SHAPE:-qwen3.5-text-default} --batch-sizes 1,32,128 \
        --context-len 1024 --steps 20 --output-json "$out/decode-step-${QWEN_SHAPE:-qwen3.5-text-default}.json" 2>&1 \
        | grep -vE "^(WARNING|INFO)" ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
