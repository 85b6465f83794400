"""What a CPU engine costs in memory: its weights the checkpoint file's pages where stored whole,
its KV cache sized for the model's context (not a fixed 1 GiB), resident only as it is written
(4 KiB pages, not 2 MiB huge pages), and no Triton loaded for a CPU step."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine import LLM, SamplingParams
from engine import memory_profile
from engine.cache_spec import zeroed
from tests.conftest import make_tiny_model
from tests.processes import REPO


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("cpu-memory") / "tiny", seed=1, max_position_embeddings=16384)


def _blocks(llm: LLM) -> int:
    return llm.engine.runner.num_blocks


def test_the_default_cpu_kv_cache_holds_the_context_and_a_few_sequences(tiny, monkeypatch):
    short = LLM(str(tiny), device="cpu", max_model_len=256)
    assert _blocks(short) == memory_profile.CPU_KV_TOKENS // short.engine.config.cache.block_size  # 8,192 tokens
    long = LLM(str(tiny), device="cpu", max_model_len=16384)
    assert _blocks(long) == 16384 // long.engine.config.cache.block_size
    # at most CPU_KV_MAX_BYTES, for a model whose context would need more
    per_block = long.engine.runner.block_bytes
    monkeypatch.setattr(memory_profile, "CPU_KV_MAX_BYTES", 100 * per_block + 5)
    capped = LLM(str(tiny), device="cpu", max_model_len=16384)
    assert _blocks(capped) == 100
    # --kv-cache-memory still decides when given
    assert _blocks(LLM(str(tiny), device="cpu", kv_cache_memory=str(40 * per_block))) == 40


def _mappings(keep) -> tuple[list[tuple[int, int]], int]:
    """The address ranges of this process's mappings that ``keep(start, end, first line)`` picks,
    and their resident bytes (/proc/self/smaps: theirs alone, whatever else the process
    allocates meanwhile; a mapping may be split in parts)."""
    ranges, resident, inside = [], 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                start, end = (int(x, 16) for x in head.split("-"))
                inside = keep(start, end, line.rstrip())
                if inside:
                    ranges.append((start, end))
            elif inside and head == "Rss:":
                resident += int(line.split()[1]) * 1024
    return ranges, resident


def _resident(t: torch.Tensor) -> int:
    """Resident bytes of the memory mappings that hold ``t``'s storage."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()
    return _mappings(lambda start, end, _: start < hi and lo < end)[1]


def test_a_written_block_makes_only_its_own_pages_resident():
    """One block written in each of 30 layers' parts of a 512-block cache: about 30 x 12 KiB
    become resident (2 MiB huge pages would make 60 MiB of it resident)."""
    cache = zeroed((30, 512, 2, 16, 2, 64), torch.float32, "cpu")  # 240 MiB
    assert _resident(cache) < 2**20  # nothing written yet
    cache[:, 7] = 1.0
    grown = _resident(cache)
    assert grown < 8 * 2**20, f"{grown / 2**20:.1f} MiB resident for 30 blocks of 16 KiB"
    assert float(cache[:, 7].sum()) == cache[:, 7].numel() and float(cache[:, 8].abs().sum()) == 0.0


def test_a_cpu_step_imports_no_triton(tiny):
    """Triton (about 60 MiB resident, 0.15 s to import) serves CUDA steps only."""
    code = ("import json, sys\n"
            "from engine import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny)!r}, device='cpu', max_model_len=256)\n"
            "llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))\n"
            "print(json.dumps('triton' in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) is False


def _mapping_of(path) -> tuple[list[tuple[int, int]], int]:
    """The address ranges at which this process maps ``path``, and their resident bytes."""
    return _mappings(lambda _start, _end, line: line.endswith(str(path)))


def test_cpu_weights_are_the_checkpoint_files_pages(tmp_path):
    """On CPU a parameter stored whole in the checkpoint is a view of the file mapped private (no
    anonymous copy; its pages the page cache's, shared by every process mapping the file); the
    stacked ones (q|k|v, gate|up) are copies, and the pages they were copied from are given back.
    A write into a mapped parameter never reaches the file."""
    model = make_tiny_model(tmp_path / "m", seed=3, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2)
    file = model / "model.safetensors"
    before = file.read_bytes()
    llm = LLM(str(model), device="cpu", max_model_len=256)
    outputs = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    ranges, resident = _mapping_of(file)
    assert ranges, "the checkpoint file is not mapped"

    def mapped(p: torch.Tensor) -> bool:
        return any(lo <= p.data_ptr() < hi for lo, hi in ranges)

    params = dict(llm.engine.runner.model.named_parameters())
    taken = {n for n, p in params.items() if mapped(p)}
    stacked = {n for n in params if "qkv_proj" in n or "gate_up_proj" in n}
    assert stacked and not taken & stacked
    assert taken == set(params) - stacked, sorted(set(params) - stacked - taken)
    # resident: the mapped parameters' pages (read by the steps), not the stacked parts' sources
    taken_bytes = sum(params[n].numel() * params[n].element_size() for n in taken)
    stacked_bytes = sum(params[n].numel() * params[n].element_size() for n in stacked)
    slack = 2 * 4096 * (len(params) + 8)  # the pages at each tensor's ends
    assert resident <= taken_bytes + slack, (resident, taken_bytes, stacked_bytes)

    o_proj = params["model.layers.0.self_attn.o_proj.weight"]
    o_proj.data.add_(1.0)  # copy-on-write: this process's pages only
    assert file.read_bytes() == before
    again = LLM(str(model), device="cpu", max_model_len=256)  # reads the file's values, not the written ones
    assert again.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0] \
        .outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_a_quantized_checkpoints_converted_tensors_leave_the_mapping(tmp_path):
    """An int4 (AWQ) checkpoint on CPU: its packed tensors are converted to the kernel's layout
    after loading, and the pages of the originals are given back; what stays resident in the
    mapping is what the model still holds (norms, embedding, head)."""
    from tests.engine.quant_checkpoints import write_int4_checkpoint

    model = make_tiny_model(tmp_path / "f", seed=4, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2)
    quant, _ = write_int4_checkpoint(model, tmp_path / "q", "awq", 128)
    llm = LLM(str(quant), device="cpu", max_model_len=256)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    ranges, resident = _mapping_of(quant / "model.safetensors")
    m = llm.engine.runner.model
    held = [t for t in [*m.parameters(), *m.buffers()] if any(lo <= t.data_ptr() < hi for lo, hi in ranges)]
    assert held  # the norms and the vocabulary tables are the file's pages
    held_bytes = sum(t.numel() * t.element_size() for t in held)
    slack = 2 * 4096 * (len(held) + 8)
    converted = sum(t.numel() * t.element_size() for n, t in m.named_buffers() if n.endswith("int4_qweight"))
    assert converted > 2 * slack and resident <= held_bytes + slack, (resident, held_bytes, converted)
