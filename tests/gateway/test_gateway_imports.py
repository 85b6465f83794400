"""The gateway process needs no torch: importing every gateway module,
loading the model's tokenizer and tokenizing a chat request must not import
it (a CPU-only gateway image, and no second copy of torch in memory)."""
from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import pkgutil, sys, importlib, asyncio
import gateway
for m in pkgutil.iter_modules(gateway.__path__):
    importlib.import_module("gateway." + m.name)
from pdserve.cli import build_parser
from gateway.config import GatewayConfig
from gateway.server import load_input_processor
args = build_parser("gateway").parse_args(["gateway", "--model", sys.argv[1], "--decode", "127.0.0.1:1"])
inputs = load_input_processor(GatewayConfig.from_args(args))
ids = asyncio.run(inputs.encode_chat([{"role": "user", "content": "What is the capital of France?"}]))
assert len(ids) > 5, ids
print("torch" in sys.modules)
"""


def test_gateway_does_not_import_torch(default_model_dir):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(default_model_dir)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "the gateway imported torch"
