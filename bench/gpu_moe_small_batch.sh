#!/usr/bin/env bash
# One GPU, one call: the fused MoE's pair GEMV (a few tokens) on CUDA.
#   bash bench/gpu_moe_small_batch.sh [SECTION...]   # tests | bench | decode | model (default: all four)
# tests:  the MXFP4 and fused-MoE kernel tests that run the pair GEMV and the grouped GEMMs
# bench:  python -m bench.moe_small_batch (pair GEMV tiles against tuned grouped GEMMs, 1-8 tokens)
# decode: the gpt-oss-20b shape's decode step at batch 1/2/4/32 (random MXFP4 experts, 1k context)
# model:  tests/engine/test_gpt_oss.py -m gpu against transformers (carry .whl: transformers 5.23)
source "$(dirname "$0")/gpu_common.sh"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(tests bench decode model)
for section in "${sections[@]}"; do
  case $section in
    tests)
      run 90 $py -m pytest -q -p no:cacheprovider -x tests/kernels/test_mxfp4.py -k "pair_gemv or launcher" 2>&1 | tail -4 ;;
    bench)
      run 170 $py -m bench.moe_small_batch --output-json "$out/moe-small-batch.json" 2>&1 | grep -vE "^(WARNING|INFO)" ;;
    decode)
      run 120 $py -m pdserve.cli bench decode-step --model-shape gpt-oss-20b --batch-sizes 1,2,4,32 \
        --context-len 1024 --steps 20 --output-json "$out/decode-step-gpt-oss-20b.json" 2>&1 | grep -vE "^(WARNING|INFO)" ;;
    model)
      $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
      run 120 $py -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpt_oss.py 2>&1 | tail -6 ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
