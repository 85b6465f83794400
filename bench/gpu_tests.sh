#!/usr/bin/env bash
# The GPU test files on one H200, each in a process of its own (an engine test's memory profile
# counts what earlier tests' engines still hold), under a limit per file; one line per file.
#   bash bench/gpu_tests.sh [FILE...]     # default: every test file with GPU tests (two GPUs skip)
# Kernel files run whole (their CUDA cases compare bf16/fp16 against the references); the others
# with -m gpu. A log per file in $OUT/tests/. Carry .gpucache/serve-wheels for the cluster test.
source "$(dirname "$0")/gpu_common.sh"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  files=(tests/kernels tests/engine/test_cuda_graphs_gpu.py tests/engine/test_cuda_engine.py
         tests/engine/test_fp8_kv_engine.py tests/engine/test_gemm_backend.py tests/engine/test_model_families_gpu.py
         tests/kv_transfer tests/e2e/test_gpu_cluster.py)
fi
mkdir -p "$out/tests"
[ -d "$serve_wheels" ] && need_stack  # (the cluster test starts a gateway)
for f in "${files[@]}"; do
  marks=(-m gpu)
  # The compiled CPU attention's tests run in CI; on the H200 image the block-id error of
  # test_a_block_id_outside_the_cache_is_an_error kills the process (SIGSEGV), while the
  # extension's other errors reach Python there: not yet explained.
  [[ $f == tests/kernels* ]] && marks=(--ignore=tests/kernels/test_cpu_attention.py)
  log=$out/tests/$(echo "$f" | tr '/' '_').log
  t=$SECONDS
  timeout "${LIMIT:-240}" $py -m pytest -q -p no:cacheprovider "${marks[@]}" "$f" > "$log" 2>&1
  rc=$?
  echo "$f: rc=$rc in $((SECONDS - t)) s: $(tail -1 "$log")"
  grep -E "^(FAILED|ERROR)" "$log" | head -5
done
