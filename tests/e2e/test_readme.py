"""The README's first sections as a user meets them after `make run`: their code
blocks, read out of README.md (so this breaks when the README drifts), run from
a fresh shell in the clone against a `pdserve up` this module starts on free
ports (the README's ports rewritten to them), and what the README shows checked
against what they print.

    After `make run`      activating .venv gives pdserve, python with openai and grpc;
                          `make run ARGS=...` hands the flags to pdserve up (make -n)
    (the banner)          pdserve up's ready banner, line for line
    Talk to it            curl, the openai client and the gRPC example answer
    Structured outputs    .parse() gives a City, the tool call a GetWeather (the
    and tool calls        cluster runs the README's own tool-calling `pdserve up`)
    tracing               `pdserve trace capital-1` shows the curl request with the
                          README's spans and time-to-first-token rows

Model text is the model's: where the README shows some, it says so, and the
check here is its shape. Beside them, on the same cluster: vLLM's older
guided_* fields constrain the output, and clash with response_format and
structured_outputs by name; the start-up logs say "waiting for ... to load"
once per engine server and name the kernels that serve a step."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_cluster_up import UpProcess
from tests.processes import REPO, free_ports, wait_every_instance_healthy

pytestmark = pytest.mark.slow

README = REPO / "README.md"
README_PORTS = {"http": 8000, "grpc": 50051, "prefill": 50061, "decode": 50071}
SHELL_TIMEOUT_S = 120


def readme_blocks(text: str) -> dict[str, list[str]]:
    """Each ``## `` section's fenced code blocks, in order ("" for the text above the first)."""
    sections: dict[str, list[str]] = {"": []}
    section, block = "", None
    for line in text.splitlines():
        if block is None and line.startswith("## "):
            section = line[3:].strip()
            sections[section] = []
        elif line.startswith("```"):
            if block is None:
                block = []
            else:
                sections[section].append("\n".join(block))
                block = None
        elif block is not None:
            block.append(line)
    return sections


@pytest.fixture(scope="module")
def readme() -> dict[str, list[str]]:
    return readme_blocks(README.read_text())


def _fresh_env(**extra: str) -> dict[str, str]:
    """A login shell's environment: no virtual environment on PATH, nothing of pytest's."""
    venv = str(REPO / ".venv")
    path = ":".join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(":") if not p.startswith(venv))
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8", "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    return {**env, **extra}


def shell(script: str, **env: str) -> subprocess.CompletedProcess:
    """``script`` in a new bash in the clone (stops at the first failing command)."""
    return subprocess.run(["bash", "--noprofile", "--norc", "-e", "-c", script], cwd=REPO, env=_fresh_env(**env),
                          capture_output=True, text=True, timeout=SHELL_TIMEOUT_S)


def _activate(readme) -> str:
    """The README's line that puts the environment on PATH (its setup block without the install)."""
    (line,) = [ln for ln in readme["After `make run`"][0].splitlines() if ln.startswith("source ")]
    return line


def _on_ports(text: str, ports: dict[str, int]) -> str:
    for name, port in README_PORTS.items():
        text = text.replace(f":{port}", f":{ports[name]}")
    return text


def _python(readme, code: str, ports: dict[str, int]) -> subprocess.CompletedProcess:
    """A README Python example, on the cluster's ports, by the environment's python from a fresh shell."""
    return shell(f"{_activate(readme)}\npython - <<'PDSERVE_README_EOF'\n{_on_ports(code, ports)}\n"
                 "PDSERVE_README_EOF")


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def cluster(readme, tmp_path_factory):
    """The README's tool-calling `pdserve up` (its chat template and parser) on free ports,
    writing spans to a traces file of its own (PDSERVE_TRACES_FILE, which `pdserve trace`
    reads too)."""
    (command,) = [b for b in readme["Structured outputs and tool calls"] if b.startswith("pdserve up ")]
    base = free_ports(6)
    ports = dict(http=base, grpc=base + 1, prefill=base + 2, decode=base + 4)
    traces = tmp_path_factory.mktemp("readme") / "traces.jsonl"
    argv = [*shlex.split(command)[1:], "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
            "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]),
            "--kv-cache-memory", "64MiB", "--max-model-len", "2048"]
    up = UpProcess("readme-up", "pdserve.cli", argv, "pdserve ready",
                   env={"OMP_NUM_THREADS": "1", "PDSERVE_TRACES_FILE": str(traces)})
    try:
        up.wait_ready()
        wait_every_instance_healthy(f"http://127.0.0.1:{ports['http']}")
        yield up, ports, traces
    finally:
        if up.proc.poll() is None:
            assert up.stop() == 0, up.logs()


@pytest.fixture(scope="module")
def curl_answer(readme, cluster) -> dict:
    """The README's curl request (its X-Request-Id names it capital-1), sent once."""
    _, ports, _ = cluster
    (curl,) = [b for b in readme["Talk to it"] if b.startswith("curl ")]
    return json.loads(_ok(shell(_on_ports(curl, ports))))


# --- After `make run` ------------------------------------------------------------------------------

def test_the_setup_commands_give_pdserve_python_openai_and_grpc(readme):
    setup = readme["After `make run`"][0]
    assert "pip install openai" in setup
    out = _ok(shell(f"{setup}\ncommand -v pdserve python\npython -c 'import grpc, openai; print(\"imports ok\")'"))
    assert out.splitlines()[-3:] == [f"{REPO}/.venv/bin/pdserve", f"{REPO}/.venv/bin/python", "imports ok"], out


def test_make_run_hands_args_to_pdserve_up(readme):
    from pdserve.cli import build_parser

    lines = [ln for ln in readme["After `make run`"][1].splitlines() if ln.startswith("make run ")]
    assert len(lines) == 2, lines
    parsed = []
    for line in lines:  # make -n: the commands make would run, none of them run
        printed = _ok(shell("make -n " + line[len("make "):])).splitlines()
        (command,) = [ln for ln in printed if ln.startswith(".venv/bin/pdserve up")]
        parsed.append(build_parser("up").parse_args(shlex.split(command)[1:]))
    assert (parsed[0].decode, parsed[0].http_port) == (2, 8080)
    assert json.loads(parsed[1].speculative_config) == {"method": "ngram", "num_speculative_tokens": 4}


# --- the cluster -----------------------------------------------------------------------------------

def test_the_ready_banner_is_the_readmes(readme, cluster):
    up, ports, traces = cluster
    (banner,) = [b for b in readme[""] if b.startswith("pdserve is up:")]
    expected = _on_ports(banner, ports).replace("~/.cache/pdserve/traces.jsonl", str(traces)).splitlines()
    start = up.stdout_lines.index("pdserve is up:")
    assert up.stdout_lines[start:] == expected


def test_talk_to_it(readme, cluster, curl_answer):
    _, ports, _ = cluster
    assert curl_answer["id"] == "capital-1" and curl_answer["object"] == "chat.completion"
    message = curl_answer["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].strip(), curl_answer
    client, grpc_example = [b for b in readme["Talk to it"] if b.startswith(("from openai", "import grpc"))]
    assert _ok(_python(readme, client, ports)).strip()  # the model's answer
    assert _ok(_python(readme, grpc_example, ports)).strip()


def test_structured_outputs_and_tool_calls(readme, cluster):
    _, ports, _ = cluster
    (client,) = [b for b in readme["Talk to it"] if b.startswith("from openai")]
    parse, tools = [b for b in readme["Structured outputs and tool calls"] if "client.chat.completions.parse" in b]
    out = _ok(_python(readme, "\n".join([client, parse, tools]), ports)).splitlines()
    assert len(out) == 3, out  # the client's answer, the City, the tool call
    assert re.fullmatch(r"name='[^'\n]*' country='[^'\n]*'", out[1]), out
    assert re.fullmatch(r"get_weather city='[^'\n]*'", out[2]), out


def test_pdserve_trace_of_the_curl_request(readme, cluster, curl_answer):
    _, ports, traces = cluster
    (example,) = [b for b in readme["Where did the time go: tracing"] if b.startswith("$ pdserve trace ")]
    command, *shown = example.splitlines()
    deadline = time.monotonic() + 20
    while True:  # a server's last span may land a moment after the answer (the README says so)
        out = _ok(shell(f"{_activate(readme)}\n{command[2:]}", PDSERVE_TRACES_FILE=str(traces))).splitlines()
        if not any("incomplete" in line for line in out) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    head = r"trace [0-9a-f]{32}  request capital-1"
    assert re.fullmatch(head, out[0]) and re.fullmatch(head, shown[0]), (out, shown)
    count = r"(\d+) spans from 3 services \(pdserve-decode, pdserve-gateway, pdserve-prefill\), [\d.]+ ms"
    assert re.fullmatch(count, out[1]).group(1) == re.fullmatch(count, shown[1]).group(1), (out[1], shown[1])

    def rows(lines: list[str]) -> list[tuple[str, str]]:
        """The waterfall's (service, indented span name) and the breakdown's (label, "")."""
        spans = []
        for line in lines:
            if line.startswith("pdserve-") and "|" in line:
                left = line.split("|")[0]
                spans.append((left[:17].strip(), left[17:][:-22].rstrip()))
        start = next(i for i, line in enumerate(lines) if line.startswith("time to first token:"))
        labels = [(m.group(1), "") for line in lines[start + 1:]
                  if (m := re.fullmatch(r"\s+(\S.*?)\s+[\d.]+ ms\s+[\d.]+%", line))]
        assert labels, lines[start:]
        return spans + labels

    header = next(i for i, line in enumerate(shown) if line.startswith("service "))
    assert out[header:header + 2] == shown[header:header + 2]  # column heads and the rule
    assert sorted(rows(out)) == sorted(rows(shown)), "\n".join(out)


# --- beside the README, on the same cluster --------------------------------------------------------

def _chat(ports: dict[str, int], **extra) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}], **extra}
    return httpx.post(f"http://127.0.0.1:{ports['http']}/v1/chat/completions", json=body, timeout=120)


def test_vllm_guided_fields_constrain_the_output(cluster):
    _, ports, _ = cluster
    r = _chat(ports, guided_choice=["yes", "no"])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text
    r = _chat(ports, guided_regex="[0-9]{3}-[0-9]{4}")
    assert r.status_code == 200 and re.fullmatch("[0-9]{3}-[0-9]{4}", r.json()["choices"][0]["message"]["content"])
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
              "additionalProperties": False}
    r = _chat(ports, guided_json=schema, guided_decoding_backend="xgrammar", max_tokens=32)
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["answer"], bool), r.text


def test_vllm_guided_fields_clash_by_name(cluster):
    _, ports, _ = cluster
    r = _chat(ports, guided_json={"type": "object"}, response_format={"type": "json_object"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "give guided_json or response_format, not both (guided_json is vLLM's older name for "
                   "structured_outputs.json)", "type": "invalid_request_error", "param": "guided_json", "code": None}
    r = _chat(ports, guided_choice=["yes", "no"], structured_outputs={"choice": ["yes", "no"]})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "give guided_choice or structured_outputs, not both (guided_choice is vLLM's older name for "
        "structured_outputs.choice)")


def test_start_up_logs_wait_quietly_and_name_the_kernels(cluster):
    up, ports, _ = cluster
    from kernels import cpu_attention, cpu_gemm

    log = up.log_text()
    for role in ("prefill", "decode"):
        address = f"127.0.0.1:{ports[role]}"
        assert log.count(f"INFO gateway.instances: waiting for {role} server {address} to load") == 1, log
        assert f"{role} server {address} is unhealthy" not in log
    attention = ("compiled (kernels/cpu_attention.py)" if cpu_attention.extension() is not None
                 else f"PyTorch reference ({cpu_attention.unavailable_reason()})")
    gemms = "oneDNN's" if cpu_gemm.onednn_available() else "torch's F.linear"
    glue = ("norms, RoPE and SiLU-and-mul compiled (kernels/cpu_ops.py)" if cpu_attention.extension() is not None
            else "norms, RoPE and activations PyTorch (kernels.reference)")
    line = f"kernels: attention {attention}, GEMMs {gemms}, {glue}"
    assert log.count(line) == 2, log  # the prefill and the decode server
