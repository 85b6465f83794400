#!/usr/bin/env bash
# One GPU, one call: the per-layer glue fused (q/k/V norms with RoPE, GELU-tanh gates, Gemma 4's
# layer ends) measured against the tree before it, and the decode attention's tiles swept.
#   mkdir -p .gpu/before; git archive BASE | tar -x -C .gpu/before    # carry .gpu and .whl
#   bash bench/gpu_fused_glue.sh [SECTION...]     # kernels | decode | blas | tiles | exact (default: all)
# kernels: the fused kernels' tests and the linear-attention kernels' on CUDA; decode: decode step at
# batch 1/32/128, 1k context, Gemma 4 E2B and Qwen3.5 shapes, before then after (ROUNDS rounds,
# default 1); blas: Gemma 4 E2B's with each graph's BLAS library chosen by timing
# (PDSERVE_DECODE_BLAS=auto); tiles: bench.attention_tiles on Gemma 4 E2B's head shapes; exact: the
# hybrid, Gemma 3 and Gemma 4 families against transformers on CUDA.
source "$(dirname "$0")/gpu_common.sh"
root=$PWD
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(kernels decode blas tiles exact)
for section in "${sections[@]}"; do
  case $section in
    kernels)
      run 150 $py -m pytest -q -p no:cacheprovider tests/kernels/test_rms_norm.py tests/kernels/test_rope.py \
        tests/kernels/test_activation.py tests/kernels/test_linear_attention.py 2>&1 | tail -4 ;;
    decode)
      for round in $(seq ${ROUNDS:-1}); do
        for shape in ${SHAPES:-gemma-4-e2b qwen3.5-text-default}; do
          for tree in before after; do
            dir=$root; [ $tree = before ] && dir=$root/.gpu/before
            (cd "$dir" && run 150 $py -m pdserve.cli bench decode-step --model-shape $shape --batch-sizes 1,32,128 \
               --context-len 1024 --steps 20 --output-json "$out/decode-step-$shape-$tree-$round.json" 2>&1 \
               | grep -E "^batch|rror")
          done
        done
      done ;;
    blas)
      PDSERVE_DECODE_BLAS=auto run 150 $py -m pdserve.cli bench decode-step --model-shape gemma-4-e2b \
        --batch-sizes 1,32,128 --context-len 1024 --steps 20 --output-json "$out/decode-step-gemma-4-e2b-blas-auto.json" \
        2>&1 | grep -E "^batch|rror|chose|cuBLAS" ;;
    tiles)
      run ${TILES_LIMIT:-200} $py -m bench.attention_tiles --model-shape gemma-4-e2b --batch-sizes ${TILES_BATCHES:-1,32,128} ${TILES_FLAGS:-} \
        --output-json "$out/attention-tiles-gemma-4-e2b.json" 2>&1 | grep -v Warning ;;
    exact)
      run ${EXACT_LIMIT:-300} $py -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cache_groups_gpu.py \
        tests/engine/test_gemma4.py 2>&1 | tail -4 ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
