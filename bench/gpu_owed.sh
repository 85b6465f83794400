#!/usr/bin/env bash
# One GPU, one call: the checks owed on CUDA.
#   bash bench/gpu_owed.sh [SECTION...]   # canary | logprobs | sampler | decode120 | profile20 | tiers | groups
# canary:    the host-staged transfer canary test, with every process's stacks dumped if it hangs
# logprobs:  prompt logprobs on CUDA at a 152k vocabulary (float32, bf16) against transformers
# sampler:   bench/sampler_gpu_probe.py (seeded, unseeded, greedy rows at V=152k)
# decode120: the gpt-oss-120b shape's decode step at batch 1/32/128
# profile20: the gpt-oss-20b shape's batch-1 step under the profiler
# tiers:     the host and disk KV tier tests on CUDA (the engine's auto device), and what a host hit
#            costs against recomputing it (bench/host_hit_cost.py)
# groups:    the RMSNorm and linear-attention kernel tests, and the cache-group engine tests on CUDA
#            (Qwen3-Next, Qwen3.5, Gemma 3 against transformers; carry .whl: transformers 5.23)
source "$(dirname "$0")/gpu_common.sh"
sections=("$@")
for section in "${sections[@]}"; do
  case $section in
    canary)
      for t in test_gpu_same_device_host_staged test_gpu_canary_host_staged; do
        ( $py -m pytest -q -p no:cacheprovider -o faulthandler_timeout=30 -s \
            "tests/kv_transfer/test_gpu_transfers.py::$t" 2>&1 | tail -60 ) &
        pid=$!; sleep 28
        for c in $(pgrep -f "multiprocessing.spawn"); do echo "== stacks of $c"; kill -USR1 "$c"; done
        wait $pid
      done ;;
    logprobs)
      run 200 $py -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_prompt_logprobs.py 2>&1 | tail -15 ;;
    sampler)
      run 90 $py bench/sampler_gpu_probe.py ;;
    decode120)
      run 300 $py -m pdserve.cli bench decode-step --model-shape gpt-oss-120b --batch-sizes 1,32,128 \
        --context-len 1024 --steps 20 --output-json "$out/decode-step-gpt-oss-120b.json" 2>&1 | grep -vE "^(WARNING|INFO)" ;;
    profile20)
      run 200 $py -m pdserve.cli bench decode-step --model-shape gpt-oss-20b --batch-sizes 1,32 \
        --context-len 1024 --steps 20 --profile 5 --output-json "$out/decode-step-gpt-oss-20b-profile.json" 2>&1 \
        | grep -vE "^(WARNING|INFO)" ;;
    tiers)
      run 240 $py -m pytest -q -p no:cacheprovider tests/engine/test_kv_offload.py tests/engine/test_kv_disk_tier.py 2>&1 | tail -8
      run 120 $py -m bench.host_hit_cost --trials 5 2>&1 | grep -vE "^(WARNING|INFO)" | tail -15 ;;
    groups)
      run 100 $py -m pytest -q -p no:cacheprovider tests/kernels/test_rms_norm.py tests/kernels/test_linear_attention.py \
        2>&1 | tail -4
      run 200 $py -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_cache_groups_gpu.py 2>&1 | tail -8 ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
