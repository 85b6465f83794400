"""Dense float32 GEMMs on CPU through oneDNN: ``linear(x, weight, bias)`` = F.linear.

PyTorch's CPU ``F.linear`` in float32 goes to MKL's sgemm. On the AMD EPYC
(AVX-512) machines this project runs on, MKL took 2.1-2.2x as long as oneDNN's
matmul on the same call (a 576 x 3072 weight: 134 against 277 GFLOP/s at 32
rows, 174 against 383 at 2,048; both on the machine's two threads), and the
GEMMs are most of a CPU step. ``linear`` runs oneDNN's (``mkldnn._linear_pointwise``,
the op torch's own CPU compiler emits) for float32 CPU tensors, and F.linear for
anything else or where oneDNN is missing or fails (one log line). The result is
F.linear's up to float32 rounding: the products are summed in another order.
"""
from __future__ import annotations

import logging
import threading

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
