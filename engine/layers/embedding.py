"""Token embedding and LM head, split over the vocabulary under tensor parallelism:
rank r holds rows [r * n, (r + 1) * n) with n = cdiv(vocab, ranks); the last
rank's rows past the vocabulary are zero. The embedding all-reduces (each id's row
comes from the one rank holding it); the head gathers every rank's logit columns.

``qtype`` (a GGUF block type, engine/quantization/gguf.py): the rows stay packed as the file
ships them (uint8 [rows, row bytes]); the embedding dequantizes only the rows it looks up,
and the head runs the packed GEMM (kernels/cpu/gguf_gemm.cpp on CPU), as the packed linear
layers do: a tied Q8_0 table is read at 8.5 bits a weight instead of 32."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Part, attach_loader
from engine.parallel import Shard, TPGroup
from kernels import cpu_gemm, gguf_reference


def _vocab_loader(param: nn.Parameter, vocab: int, hidden: int, lo: int, hi: int) -> None:
    part = Part(vocab, lo, min(hi, vocab))
    attach_loader(param, (vocab, hidden), [part], 0)
    load = param.weight_loader

    def weight_loader(p: nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
        if part.size == p.shape[0]:  # no rows past the vocabulary: the parameter whole
            load(p, src, shard_id)
            return
        p.data.zero_()  # rows past the vocabulary stay zero
        load(p.data[:part.size], src, shard_id)

    param.weight_loader = weight_loader


def _vocab_param(vocab: int, hidden: int, lo: int, hi: int, qtype: str | None) -> nn.Parameter:
    """This rank's rows [lo, hi) of a [vocab, hidden] table: float, or packed GGUF blocks
    (uint8, never cast to the model dtype)."""
    if qtype is None:
        param = nn.Parameter(torch.empty(hi - lo, hidden))
        _vocab_loader(param, vocab, hidden, lo, hi)
        return param
    nbytes = gguf_reference.row_bytes(qtype, hidden)
    param = nn.Parameter(torch.empty(hi - lo, nbytes, dtype=torch.uint8), requires_grad=False)
    _vocab_loader(param, vocab, nbytes, lo, hi)
    param.keep_dtype = True
    return param


class VocabEmbedding(nn.Module):
    """The embedding's rows of this rank's share of the vocabulary; other ids give zeros
    here and their rows come from the all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard, tp: TPGroup | None,
                 qtype: str | None = None) -> None:
        super().__init__()
        self.lo, self.hi = shard.vocab
        self.hidden_size, self.qtype = hidden_size, qtype
        self.weight = _vocab_param(vocab_size, hidden_size, self.lo, self.hi, qtype)
        self.tp = tp

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (this rank's indices), float (dequantized when packed)."""
        if self.qtype is None:
            return nn.functional.embedding(ids, self.weight)
        return gguf_reference.dequantize(self.weight[ids.reshape(-1)], self.qtype, self.hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.rows(ids)
        mine = (ids >= self.lo) & (ids < self.hi)
        h = self.rows((ids - self.lo).clamp(0, self.hi - self.lo - 1))
        return self.tp.all_reduce(h * mine[:, None].to(h.dtype))


class LMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered to [n, vocab] float32 on every rank.
    ``softcap``: logits = softcap * tanh(logits / softcap) (Gemma's final soft-capping)."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard, tp: TPGroup | None,
                 tied: VocabEmbedding | None = None, softcap: float | None = None, qtype: str | None = None,
                 activations: str = "float32") -> None:
        """``qtype``: an untied head's GGUF type (a tied head takes its embedding's);
        ``activations``: a packed head's (``kernels.cpu_gemm.gguf_linear``)."""
        super().__init__()
        lo, hi = shard.vocab
        self.vocab_size, self.tp, self.softcap, self.activations = vocab_size, tp, softcap, activations
        if tied is not None:
            self.weight, self.qtype = tied.weight, tied.qtype
        else:
            self.weight, self.qtype = _vocab_param(vocab_size, hidden_size, lo, hi, qtype), qtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.qtype is not None:
            logits = cpu_gemm.gguf_linear(hidden.float(), self.weight, self.qtype, None, self.activations)
        else:
            logits = cpu_gemm.linear(hidden, self.weight).float()  # F.linear; oneDNN's for float32 on CPU
        if self.tp is not None:
            logits = self.tp.all_gather_last(logits)[:, :self.vocab_size]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
