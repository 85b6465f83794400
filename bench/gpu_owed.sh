#!/usr/bin/env bash
# One GPU, one call: the checks owed on CUDA.
#   bash bench/gpu_owed.sh [SECTION...]   # canary | logprobs | sampler | decode120 | profile20 | tiers | groups
#                                         # | gemma4 | up-auto | trtllm (TRTLLM_ROWS, TRTLLM_SCALE)
# canary:    the host-staged transfer canary test, with every process's stacks dumped if it hangs
# logprobs:  prompt logprobs on CUDA at a 152k vocabulary (float32, bf16) against transformers
# sampler:   bench/sampler_gpu_probe.py (seeded, unseeded, greedy rows at V=152k)
# decode120: the gpt-oss-120b shape's decode step at batch 1/32/128
# profile20: the gpt-oss-20b shape's batch-1 step under the profiler
# tiers:     the host and disk KV tier tests on CUDA (the engine's auto device), and what a host hit
#            costs against recomputing it (bench/host_hit_cost.py)
# groups:    the RMSNorm and linear-attention kernel tests, and the cache-group engine tests on CUDA
#            (Qwen3-Next, Qwen3.5, Gemma 3 against transformers; carry .whl: transformers 5.23)
# gemma4:    tests/engine/test_gemma4.py -m gpu (dense and MoE, float32 and bf16; carry .whl)
# up-auto:   pdserve up with --device auto on the GPU: the supervisor asks a child process for CUDA,
#            the servers load on it, one chat completion is served (needs the serving stack)
# trtllm:    TensorRT-LLM's Llama-3.1-8B FP8 rows (TRTLLM_ROWS=2048/128,5000/500 TRTLLM_SCALE=0.25: the
#            rows and the share of each row's requests); each row's result is written as it finishes
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
    gemma4)
      run 300 $py -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gemma4.py 2>&1 | tail -8 ;;
    up-auto)
      need_stack
      model=$($py -m bench.model_shapes llama-3.2-1b --tokenizer | tail -1)
      $py -m pdserve.cli up --model "$model" --load-format dummy --http-port 18080 --grpc-port 18081 \
        --prefill-port 18090 --decode-port 18095 > "$out/up-auto.log" 2>&1 & up=$!
      for _ in $(seq 1 180); do
        curl -sf localhost:18080/v1/completions -H 'content-type: application/json' \
          -d '{"prompt": "a b c", "max_tokens": 4}' > "$out/up-auto-answer.json" && break; sleep 1; done
      head -c 400 "$out/up-auto-answer.json"; echo
      grep -m4 -E "device=|host-hit" "$out/up-auto.log"
      kill $up; wait $up ;;
    trtllm)
      rows=${TRTLLM_ROWS:-128/128,128/2048,1000/1000,2048/128,2048/2048,5000/500}
      run 560 $py -m pdserve.cli bench throughput --model-shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 \
        --max-num-seqs 512 --max-num-batched-tokens 8192 --trtllm-table --rows "$rows" \
        --num-prompts-scale "${TRTLLM_SCALE:-0.25}" --output-json "$out/throughput-trtllm.json" 2>&1 \
        | grep -vE "^(WARNING|INFO)|generate:" ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
