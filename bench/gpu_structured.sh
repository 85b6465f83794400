#!/usr/bin/env bash
# GPU figures for structured outputs (docs/benchmarks.md, "Structured outputs"):
#   bash bench/gpu_structured.sh wheels       # on the CPU machine: what the GPU machine lacks
#   bash bench/gpu_structured.sh SECTION...   # on the GPU machine (carry .gpucache/wheels and
#                                             # .gpucache/tokenizer)
# Sections:
#   wheels   download xgrammar and apache-tvm-ffi for Python 3.12 into .gpucache/wheels, and copy
#            the default model's tokenizer files into .gpucache/tokenizer
#   steps    decode step, Llama-3.1-8B shape with the default model's tokenizer (its vocabulary
#            padded to 128,256 rows, the extra ids always masked): batch 32 with 0 and 32
#            constrained rows, batch 256 with 0 and 64
#   compile  grammar compile and mask times (bench/grammar_engines.py: a 50-field schema)
# Results (JSON) go to $OUT (or ./gpu-out).
source "$(dirname "$0")/gpu_common.sh"
wheels=.gpucache/wheels
# The image lacks xgrammar and pydantic: installed from the carried wheels into /tmp/site.
need_xgrammar() { $py -c "import xgrammar" 2>/dev/null && return
                  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                    "$wheels"/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}; }
tok=.gpucache/tokenizer
for section in "$@"; do
  case $section in
    wheels) mkdir -p "$wheels"
            python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
              --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
              --platform manylinux2014_x86_64 -d "$wheels" xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 \
              pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
            mkdir -p "$tok"
            d=$(python3 -c "from engine.model_files import ensure_default_model as d; print(d())")
            cp "$d"/tokenizer.json "$d"/tokenizer_config.json "$tok"/
            ls -la "$wheels" "$tok" ;;
    steps) need_xgrammar
           run 200 $py -m pdserve.cli bench decode-step --model-shape llama-3.1-8b --tokenizer "$tok" \
             --batch-sizes 32,32,256,256 --structured-rows 0,32,0,64 --context-len 1024 --steps 10 \
             --max-model-len 2048 --max-num-batched-tokens 16384 --output-json "$out/decode-step-structured.json" ;;
    compile) need_xgrammar
             run 120 $py -m bench.grammar_engines --fields 10,50 --tokenizer "$tok" --no-default-model \
               --output-json "$out/grammar-engines.json" ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
done
