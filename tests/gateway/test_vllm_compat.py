"""What a vLLM user brings to the gateway, and the exact errors that say what to do:
vLLM's older ``guided_*`` fields (mapped onto structured_outputs, never ignored),
the model served under its ``--model`` string as well as the directory's name,
and runtime LoRA updates guarded as vLLM guards them (``--allow-runtime-lora-updating``
or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; an existing name only with ``load_inplace``).
The output of guided fields on a real cluster: tests/e2e/test_readme.py."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import httpx
import pytest

from engine.structured_outputs import StructuredOutputsParams
from gateway.config import GatewayConfig
from gateway.errors import ErrorKind, GatewayError
from gateway.grpc_servicer import GatewayServicer, add_gateway_servicer
from gateway.http_api import create_app
from gateway.instances import InstanceRegistry
from gateway.metrics import GatewayMetrics
from gateway.openai_protocol import ChatCompletionRequest, CompletionRequest
from gateway.server import load_input_processor
from gateway.service import GatewayService
from gateway.tokenization import InputProcessor
from pdserve.cli import build_parser
from pdserve.v1 import common_pb2, gateway_pb2_grpc
from tests.gateway.fake_engine import FakeEngine

MODEL = "SmolLM2-135M-Instruct"


def _constraint(**fields) -> StructuredOutputsParams | None:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields).output_constraint()


def _refused(**fields) -> GatewayError:
    with pytest.raises(GatewayError) as e:
        _constraint(**fields)
    assert e.value.kind is ErrorKind.INVALID_ARGUMENT
    return e.value


# --- guided_* ----------------------------------------------------------------------------------------

def test_guided_fields_are_structured_outputs_under_their_old_names():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    assert _constraint(guided_json=schema) == StructuredOutputsParams(json='{"type": "object", "properties": '
                                                                           '{"city": {"type": "string"}}}')
    assert _constraint(guided_json='{"type": "string"}') == StructuredOutputsParams(json='{"type": "string"}')
    assert _constraint(guided_regex="[0-9]+") == StructuredOutputsParams(regex="[0-9]+")
    assert _constraint(guided_choice=["yes", "no"]) == StructuredOutputsParams(choice=("yes", "no"))
    assert _constraint(guided_grammar='root ::= "a"') == StructuredOutputsParams(grammar='root ::= "a"')
    for backend in ("xgrammar", "auto"):
        assert _constraint(guided_choice=["a"], guided_decoding_backend=backend).choice == ("a",)
    completion = CompletionRequest(prompt="x", guided_regex="[a-z]").to_sampling_params()
    assert completion.structured_outputs == StructuredOutputsParams(regex="[a-z]")


@pytest.mark.parametrize("fields, param, message", [
    (dict(guided_json={"type": "object"}, response_format={"type": "json_object"}), "guided_json",
     "give guided_json or response_format, not both (guided_json is vLLM's older name for structured_outputs.json)"),
    (dict(guided_choice=["a"], structured_outputs={"choice": ["a"]}), "guided_choice",
     "give guided_choice or structured_outputs, not both (guided_choice is vLLM's older name for "
     "structured_outputs.choice)"),
    (dict(guided_regex="a", guided_grammar='root ::= "a"'), "guided_regex",
     "give one of guided_json, guided_regex, guided_choice, guided_grammar, got guided_regex and guided_grammar"),
    (dict(guided_choice=[]), "guided_choice", "guided_choice must list 1 to 1024 strings, got 0"),
    (dict(guided_regex="a", guided_decoding_backend="outlines"), "guided_decoding_backend",
     "guided_decoding_backend 'outlines' is not available: pdserve's engine servers compile every constraint "
     "with xgrammar (give xgrammar or auto, or leave it out)"),
    (dict(guided_json={"type": "object"}, guided_whitespace_pattern=r"[\n ]*"), "guided_whitespace_pattern",
     "guided_whitespace_pattern is not supported: JSON output is compact (no whitespace between tokens)"),
])
def test_guided_fields_are_refused_by_name(fields, param, message):
    error = _refused(**fields)
    assert (error.param, error.message) == (param, message)


# --- model names -------------------------------------------------------------------------------------

def _inputs(default_model_dir: Path, *flags: str) -> InputProcessor:
    args = build_parser("gateway").parse_args(["gateway", "--decode", "127.0.0.1:1", *flags])
    return load_input_processor(GatewayConfig.from_args(args))


def test_the_model_is_served_under_its_model_string_and_its_name(default_model_dir):
    given = str(default_model_dir) + "/"
    inputs = _inputs(default_model_dir, "--model", given)
    try:
        for name in (MODEL, given, str(default_model_dir), None):
            assert inputs.check_model(name, {"sql": None}) is None, name
        with pytest.raises(GatewayError) as e:
            inputs.check_model("Qwen/Qwen3-8B", {"sql": None})
        assert (e.value.kind, e.value.code) == (ErrorKind.NOT_FOUND, "model_not_found")
        assert e.value.message == (f"The model `Qwen/Qwen3-8B` does not exist. This server serves `{MODEL}` (also as "
                                   f"`{given}`, `{default_model_dir}`, its --model) and the LoRA adapters `sql`.")
    finally:
        inputs.close()
    inputs = _inputs(default_model_dir, "--model", given, "--served-model-name", "smol")  # that name only, as vLLM
    try:
        assert inputs.check_model("smol") is None
        with pytest.raises(GatewayError) as e:
            inputs.check_model(MODEL)
        assert e.value.message == f"The model `{MODEL}` does not exist. This server serves `smol`."
    finally:
        inputs.close()


# --- runtime LoRA updates ----------------------------------------------------------------------------

def test_runtime_lora_updating_comes_from_the_flag_or_vllms_variable(monkeypatch):
    def allowed(*flags: str) -> bool:
        args = build_parser("gateway").parse_args(["gateway", "--decode", "127.0.0.1:1", *flags])
        return GatewayConfig.from_args(args).allow_runtime_lora_updating

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert not allowed() and allowed("--allow-runtime-lora-updating")
    for value, on in (("True", True), ("1", True), ("true", True), ("False", False), ("0", False), ("", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert allowed() is on, value
    from pdserve.cli.up import Cluster  # pdserve up hands the flag to its gateway

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    up = build_parser("up").parse_args(["up", "--allow-runtime-lora-updating"])
    assert "--allow-runtime-lora-updating" in Cluster(up).gateway_argv()
    assert "--allow-runtime-lora-updating" not in Cluster(build_parser("up").parse_args(["up"])).gateway_argv()


OFF = ("{method} is off: loading and unloading LoRA adapters at run time needs the gateway (or pdserve up) "
       "started with --allow-runtime-lora-updating, or with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its "
       "environment, as vLLM")
ALREADY = ("The lora adapter 'sql' has already been loaded. If you want to load the adapter in place, set "
           "'load_inplace' to True.")


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine().start()
    for lora in engine.state.lora.values():
        lora.max_loras = 2  # --enable-lora --max-loras 2
    yield engine
    engine.stop()


def _run(fake: FakeEngine, tokenizer, allow: bool, body):
    """``body(http, grpc_stub)`` against a gateway service in front of ``fake`` (in-process),
    whose servers start with no adapter and no call recorded."""
    for lora in fake.state.lora.values():
        lora.adapters.clear()
        lora.calls.clear()

    async def go():
        reg = InstanceRegistry([fake.prefill_address], [fake.decode_address], poll_timeout=0.5)
        await reg.poll_once()
        inputs = InputProcessor(tokenizer, MODEL, max_model_len=2048, vocab_size=49152)
        service = GatewayService(inputs, reg, GatewayMetrics(MODEL), request_timeout=10, log_requests=False,
                                 allow_runtime_lora_updating=allow)
        server = grpc.aio.server()
        add_gateway_servicer(GatewayServicer(service), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)),
                                         base_url="http://gw", timeout=10) as http, \
                    grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await body(http, gateway_pb2_grpc.GatewayStub(channel))
        finally:
            await server.stop(0)
            await reg.close()
            inputs.close()
    return asyncio.run(go())


def test_runtime_lora_updates_are_off_unless_allowed(fake, tokenizer):
    async def body(http, stub):
        load = await http.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/adapters/sql"})
        unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(lora_name="sql", lora_path="/adapters/sql"))
        return load, unload, e.value
    load, unload, rpc_error = _run(fake, tokenizer, False, body)
    for r, method in ((load, "load_lora_adapter"), (unload, "unload_lora_adapter")):
        assert (r.status_code, r.json()) == (404, {"error": {
            "message": OFF.format(method=method), "type": "invalid_request_error", "param": None,
            "code": "runtime_lora_updating_disabled"}})
    assert (rpc_error.code(), rpc_error.details()) == (grpc.StatusCode.NOT_FOUND,
                                                       OFF.format(method="load_lora_adapter"))
    assert fake.state.lora["decode"].calls == [] and fake.state.lora["prefill"].calls == []


def test_a_load_counts_at_once_though_the_poll_after_it_is_late(fake, tokenizer):
    """A busy server answers the poll that follows a load past its deadline: the
    load's own answer already lists the adapter, and the unload's removes it."""
    async def body(http, stub):
        fake.state.knobs.get_load_delay = 1.0  # above the registry's 0.5 s poll timeout
        try:
            sql = {"lora_name": "sql", "lora_path": "/adapters/sql"}
            first = await http.post("/v1/load_lora_adapter", json=sql)
            again = await http.post("/v1/load_lora_adapter", json=sql)
            models = await http.get("/v1/models")
            unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            after = await http.get("/v1/models")
        finally:
            fake.state.knobs.get_load_delay = 0.0
        return first, again, models, unload, after
    first, again, models, unload, after = _run(fake, tokenizer, True, body)
    assert first.status_code == 200, first.text
    assert (again.status_code, again.json()["error"]["code"]) == (400, "lora_adapter_already_loaded")
    assert "sql" in [m["id"] for m in models.json()["data"]]
    assert unload.status_code == 200, unload.text
    assert "sql" not in [m["id"] for m in after.json()["data"]]


def test_loading_a_loaded_name_needs_load_inplace(fake, tokenizer):
    async def body(http, stub):
        sql = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        first = await http.post("/v1/load_lora_adapter", json=sql)
        again = await http.post("/v1/load_lora_adapter", json={**sql, "lora_path": "/adapters/sql-v2"})
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(lora_name="sql", lora_path="/adapters/x"))
        inplace = await http.post("/v1/load_lora_adapter", json={**sql, "lora_path": "/adapters/sql-v2",
                                                                 "load_inplace": True})
        over_grpc = await stub.LoadLoRAAdapter(common_pb2.LoadLoRAAdapterRequest(
            lora_name="sql", lora_path="/adapters/sql-v3", load_inplace=True))
        unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        return first, again, e.value, inplace, over_grpc, unload
    first, again, rpc_error, inplace, over_grpc, unload = _run(fake, tokenizer, True, body)
    assert first.status_code == 200, first.text
    assert (again.status_code, again.json()) == (400, {"error": {
        "message": ALREADY, "type": "invalid_request_error", "param": "lora_name",
        "code": "lora_adapter_already_loaded"}})
    assert (rpc_error.code(), rpc_error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, ALREADY)
    assert inplace.status_code == 200 and all(s.ok for s in over_grpc.servers), inplace.text
    assert unload.status_code == 200, unload.text
    for role in ("prefill", "decode"):  # the refused ones never reached a server
        assert fake.state.lora[role].calls == ["load sql /adapters/sql", "load sql /adapters/sql-v2",
                                               "load sql /adapters/sql-v3", "unload sql"], role
