"""The grammar engines a structured-output server could use, on this project's tokenizers:
xgrammar (what pdserve uses) and llguidance, when it is installed (an optional extra:
``pip install '.[compare]'``; ``make test`` installs it).

For each tokenizer (the default model's, and any ``--tokenizer DIR``) and schema (a flat
object of N fields of mixed types, and a nested one), the time to compile the grammar
against the vocabulary (one compile, caches off) and the time to compute one next-token
mask, averaged over a whole valid output fed token by token.

    python -m bench.grammar_engines [--fields 10,50] [--tokenizer DIR ...] [--output-json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from bench.results import write_result


def flat_schema(n: int) -> dict:
    kinds = [{"type": "string", "maxLength": 16}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"enum": ["red", "green", "blue"]}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def nested_schema() -> dict:
    item = {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}
    return {"type": "object", "properties": {"customer": {"type": "object", "properties": {
        "name": {"type": "string"}, "email": {"type": "string", "format": "email"}}, "required": ["name", "email"]},
        "items": {"type": "array", "items": item, "minItems": 1, "maxItems": 8}},
        "required": ["customer", "items"], "additionalProperties": False}


def example(schema: dict) -> str:
    """A compact valid instance of the schemas above."""
    if "customer" in schema.get("properties", {}):
        return json.dumps({"customer": {"name": "Ada", "email": "ada@example.com"},
                           "items": [{"sku": "ABC-1234", "qty": 2}, {"sku": "XYZ-0001", "qty": 1}]})
    values = {"string": "hello", "integer": 42, "number": 3.5, "boolean": True}
    return json.dumps({k: (v["enum"][0] if "enum" in v else values[v["type"]]) for k, v in schema["properties"].items()})


def time_xgrammar(tokenizer, schema: dict, text: str) -> dict:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    ids, times = tokenizer.encode(text, add_special_tokens=False), []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - t0)
        if not matcher.accept_token(t):
            raise RuntimeError("xgrammar rejected a valid output")
    return {"compile_ms": 1e3 * compile_s, "mask_us": 1e6 * statistics.mean(times), "tokens": len(ids)}


def time_llguidance(tokenizer, schema: dict, text: str) -> dict | None:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        return None
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                            defaults={"whitespace_flexible": False,
                                                                      "item_separator": ", ", "key_separator": ": "})
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    if matcher.is_error():
        raise RuntimeError(matcher.get_error())
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    ids, times = tokenizer.encode(text, add_special_tokens=False), []
    for t in ids:
        t0 = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - t0)
        if not matcher.consume_token(t):
            raise RuntimeError("llguidance rejected a valid output")
    return {"compile_ms": 1e3 * compile_s, "mask_us": 1e6 * statistics.mean(times), "tokens": len(ids)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fields", default="10,50")
    p.add_argument("--tokenizer", action="append", default=[], help="a tokenizer directory (repeatable)")
    p.add_argument("--no-default-model", action="store_true", help="only the --tokenizer directories")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    from transformers import AutoTokenizer

    dirs = list(args.tokenizer)
    if not args.no_default_model:
        from engine.model_files import ensure_default_model

        dirs.insert(0, str(ensure_default_model()))
    schemas = {f"flat-{n}": flat_schema(int(n)) for n in args.fields.split(",")} | {"nested": nested_schema()}
    result: dict = {"cases": []}
    for d in dirs:
        tok = AutoTokenizer.from_pretrained(d)
        for name, schema in schemas.items():
            text = example(schema)
            row = {"tokenizer": d, "vocab": len(tok), "schema": name, "xgrammar": time_xgrammar(tok, schema, text),
                   "llguidance": time_llguidance(tok, schema, text)}
            result["cases"].append(row)
            for engine in ("xgrammar", "llguidance"):
                r = row[engine]
                if r is not None:
                    print(f"{engine:10s} {name:8s} vocab {row['vocab']:6d}: compile {r['compile_ms']:7.1f} ms, "
                          f"mask {r['mask_us']:6.1f} us/token over {r['tokens']} tokens", flush=True)
    write_result(result, "grammar-engines", args.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
