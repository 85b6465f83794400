#!/usr/bin/env bash
# One GPU, one call: gpt-oss on CUDA (attention sinks, biases, MXFP4 experts).
#   bash bench/gpu_gpt_oss.sh [SECTION...]      # tests | decode | before-after (default: all three)
# tests:        the attention, fused-MoE and MXFP4 kernel tests (sinks through split-K and the dense
#               prefill kernel) and tests/engine/test_gpt_oss.py -m gpu (float and MXFP4 experts,
#               float32 and bf16, against transformers on the same GPU)
# decode:       gpt-oss-20b and -120b shapes (random MXFP4 experts), decode step at batch 1/32/128, 1k context
# before-after: the Llama-3.1-8B decode step in the tree before sinks and biases (.gpu/before,
#               `git archive 638a9b6~1`) and in this one, interleaved: the paths without sinks keep their speed
source "$(dirname "$0")/gpu_common.sh"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(tests decode before-after)
root=$PWD
for section in "${sections[@]}"; do
  case $section in
    tests)
      run ${TESTS_LIMIT:-240} $py -m pytest -q -p no:cacheprovider -x tests/kernels/test_attention_sinks.py \
        tests/kernels/test_paged_attention.py tests/kernels/test_prefill_self_attention.py \
        tests/kernels/test_fused_moe.py tests/kernels/test_mxfp4.py 2>&1 | tail -8
      run ${GPU_TESTS_LIMIT:-150} $py -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpt_oss.py 2>&1 | tail -15 ;;
    decode)
      for shape in ${SHAPES_TO_RUN:-gpt-oss-20b gpt-oss-120b}; do
        run 170 $py -m pdserve.cli bench decode-step --model-shape "$shape" --batch-sizes 1,32,128 \
          --context-len 1024 --steps 20 --output-json "$out/decode-step-$shape.json" 2>&1 | grep -vE "^(WARNING|INFO)"
      done ;;
    before-after)
      for tree in before after; do
        dir=$root; [ $tree = before ] && dir=$root/.gpu/before
        (cd "$dir" && run 150 $py -m pdserve.cli bench decode-step --model-shape llama-3.1-8b --batch-sizes 1,32,128 \
           --context-len 1024 --steps 20 --output-json "$out/decode-step-llama8b-$tree.json" 2>&1 \
           | grep -vE "^(WARNING|INFO)")
      done ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
