"""Dense float32 GEMMs on CPU through oneDNN: ``linear(x, weight, bias)`` = F.linear.

PyTorch's CPU ``F.linear`` in float32 goes to MKL's sgemm. On the AMD EPYC
(AVX-512) machines this project runs on, MKL took 2.1-2.2x as long as oneDNN's
matmul on the same call (a 576 x 3072 weight: 134 against 277 GFLOP/s at 32
rows, 174 against 383 at 2,048; both on the machine's two threads), and the
GEMMs are most of a CPU step. ``linear`` runs oneDNN's (``mkldnn._linear_pointwise``,
the op torch's own CPU compiler emits) for float32 CPU tensors, and F.linear for
anything else or where oneDNN is missing or fails (one log line). The result is
F.linear's up to float32 rounding: the products are summed in another order.

``gguf_linear`` is the GEMM of GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) read packed,
through the C++ extension ``cpu/gguf_gemm.cpp`` (see the section at the end).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict = {}  # "ok": whether oneDNN's op runs here (probed once)


def onednn_available() -> bool:
    """Whether ``linear`` runs oneDNN's GEMM for float32 here (probed once; F.linear if not)."""
    return _onednn_ok()


def _onednn_ok() -> bool:
    ok = _state.get("ok")
    if ok is not None:
        return ok
    with _lock:
        if "ok" not in _state:
            reason = None
            if not torch.backends.mkldnn.is_available():
                reason = "this torch build has no oneDNN"
            else:
                try:
                    x, w = torch.randn(3, 8), torch.randn(5, 8)
                    y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                    if not torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5):
                        reason = "its result differed from F.linear's"
                except Exception as e:  # noqa: BLE001 - any failure: F.linear serves
                    reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            if reason is not None:
                logger.info("oneDNN float32 GEMM unavailable (%s); CPU linear layers use F.linear", reason)
            _state["ok"] = reason is None
    return _state["ok"]


def linear_call(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``linear(x, weight)`` for x float32 [T, K] contiguous, as one direct call of oneDNN's GEMM
    (no checks a call), for a float32 CPU ``weight`` [N, K]; None where ``linear`` would not
    run oneDNN's for it. The same op ``linear`` runs: the same result."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or not weight.is_contiguous() or not _onednn_ok()):
        return None
    op = torch.ops.mkldnn._linear_pointwise.default
    return lambda x: op(x, weight, None, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K], weight [N, K]: oneDNN's GEMM for float32 CPU
    tensors (weight and x contiguous in K), else F.linear itself."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.is_contiguous() and x.dim() >= 1 and x.stride(-1) == 1
            and (bias is None or bias.dtype == torch.float32) and x.numel() > 0 and _onednn_ok()):
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), weight, bias, "none", [], "")
        return y.reshape(*shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


# ---- GGUF block-quantized weights (kernels/cpu/gguf_gemm.cpp) ----------------------------------------------
#
# ``gguf_linear(x, packed, qtype, bias)`` = ``kernels.gguf_reference.linear``: y = x W^T with W kept in its
# GGUF blocks (Q4_0, Q4_1, Q8_0; uint8 [N, K / 32 * block bytes]) and dequantized in registers, activations
# float32. The C++ extension is built and loaded like the compiled CPU attention (kernels/cpu_extension.py:
# torch's extension cache, one build at a time, a bounded wait: $PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT, default
# 900 s), built for this CPU (-march=native; its name hashes the CPU's feature flags). Where it cannot be built, or
# for tensors it does not take (not CPU, a K not a multiple of 32), the reference runs (one log line).

_GGUF_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu", "gguf_gemm.cpp")
GGUF_QTYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the extension's qtype codes
GGUF_CFLAGS = ("-O3", "-fopenmp", "-march=native", "-ffp-contract=off")  # also bench.gguf_token_gemms's builds
_gguf_state: dict = {}  # "module": the loaded extension or None; "reason": why None


def _gguf_name() -> str:
    from kernels import cpu_extension

    return cpu_extension.build_name("pdserve_cpu_gguf_gemm", [_GGUF_SOURCE], GGUF_CFLAGS)


def gguf_extension(build_timeout: float | None = None) -> Any:
    """The compiled GGUF GEMM, built or loaded on the first call; None where it cannot be
    (the reason is logged once: ``gguf_unavailable_reason()``)."""
    if "module" not in _gguf_state:
        with _lock:
            if "module" not in _gguf_state:
                from kernels import cpu_extension

                timeout = build_timeout or cpu_extension.DEFAULT_BUILD_TIMEOUT_S
                module, reason = cpu_extension.load_extension(
                    _gguf_name(), [_GGUF_SOURCE], timeout, what="compiled GGUF GEMM",
                    timeout_env="PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT", extra_cflags=GGUF_CFLAGS)
                _gguf_state["module"], _gguf_state["reason"] = module, reason
                if module is None:
                    logger.warning("compiled GGUF GEMM unavailable (%s); GGUF linear layers use the PyTorch "
                                   "reference (dequantize, then matmul)", reason)
    return _gguf_state["module"]


def gguf_unavailable_reason() -> str | None:
    """Why ``gguf_extension()`` is None (None while it is loaded or not yet tried)."""
    return _gguf_state.get("reason")


def _check_activations(activations: str) -> None:
    if activations not in ("float32", "q8_0"):
        raise ValueError(f"GGUF activations must be float32 or q8_0, got {activations!r}")


def _gguf_kernel(ext: Any, activations: str) -> Callable:
    _check_activations(activations)
    return ext.gguf_linear if activations == "float32" else ext.gguf_linear_q8


def gguf_linear_call(packed: torch.Tensor, qtype: str,
                     activations: str = "float32") -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``gguf_linear(x, packed, qtype, None, activations)`` for x float32 [T, K] contiguous, as one
    direct call of the compiled kernel (no checks a call); None where ``gguf_linear`` would run the
    reference."""
    code = GGUF_QTYPES.get(qtype)
    ext = gguf_extension() if packed.device.type == "cpu" else None
    if ext is None or code is None or packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous():
        return None
    run = _gguf_kernel(ext, activations)
    return lambda x: run(x, packed, code, None)


def gguf_linear(x: torch.Tensor, packed: torch.Tensor, qtype: str, bias: torch.Tensor | None = None,
                activations: str = "float32") -> torch.Tensor:
    """y = x W^T (+ bias), x [..., K], W the packed GGUF weight uint8 [N, row bytes] of type ``qtype``;
    float32 out. ``activations``: float32 (x as it is: ``kernels.gguf_reference.linear``'s numbers)
    or q8_0 (x's rows quantized to int8 blocks of 32 and the products summed as integers, as
    llama.cpp does: ``kernels.gguf_reference.linear_q8``'s). The compiled kernel on CPU, else the
    reference."""
    _check_activations(activations)
    code = GGUF_QTYPES.get(qtype)
    ext = gguf_extension() if x.device.type == "cpu" and packed.device.type == "cpu" else None
    if ext is None or code is None or x.shape[-1] % 32 or packed.dtype != torch.uint8 or packed.dim() != 2:
        from kernels import gguf_reference

        if activations == "float32":
            return gguf_reference.linear(x, packed, qtype, bias)
        shape = x.shape
        y = gguf_reference.linear_q8(x.reshape(-1, shape[-1]).float(), packed, qtype, bias)
        return y.reshape(*shape[:-1], packed.shape[0])
    run = _gguf_kernel(ext, activations)
    if bias is None and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return run(x, packed, code, None)  # a step's call: nothing to reshape or convert
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).to(torch.float32).contiguous()
    b = None if bias is None else bias.to(torch.float32).contiguous()
    y = run(x2, packed.contiguous(), code, b)
    return y.reshape(*shape[:-1], packed.shape[0])


if __name__ == "__main__":  # `python -m kernels.cpu_gemm`: build (or find) the GGUF GEMM ahead of use
    from kernels import cpu_extension

    cpu_extension.prebuild_main("compiled GGUF GEMM", gguf_extension, gguf_unavailable_reason)
