"""Token embedding and LM head, split over the vocabulary under tensor parallelism:
rank r holds rows [r * n, (r + 1) * n) with n = cdiv(vocab, ranks); the last
rank's rows past the vocabulary are zero. The embedding all-reduces (each id's row
comes from the one rank holding it); the head gathers every rank's logit columns."""
from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Part, attach_loader
from engine.parallel import Shard, TPGroup
from kernels import cpu_gemm


def _vocab_loader(param: nn.Parameter, vocab: int, hidden: int, lo: int, hi: int) -> None:
    part = Part(vocab, lo, min(hi, vocab))
    attach_loader(param, (vocab, hidden), [part], 0)
    load = param.weight_loader

    def weight_loader(p: nn.Parameter, src: torch.Tensor, shard_id=None) -> None:
        p.data.zero_()  # rows past the vocabulary stay zero
        load(p.data[:part.size], src, shard_id)

    param.weight_loader = weight_loader


class VocabEmbedding(nn.Module):
    """The embedding's rows of this rank's share of the vocabulary; other ids give zeros
    here and their rows come from the all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard, tp: TPGroup | None) -> None:
        super().__init__()
        self.lo, self.hi = shard.vocab
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, hidden_size))
        _vocab_loader(self.weight, vocab_size, hidden_size, self.lo, self.hi)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return nn.functional.embedding(ids, self.weight)
        mine = (ids >= self.lo) & (ids < self.hi)
        h = nn.functional.embedding((ids - self.lo).clamp(0, self.hi - self.lo - 1), self.weight)
        return self.tp.all_reduce(h * mine[:, None].to(h.dtype))


class LMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered to [n, vocab] float32 on every rank.
    ``softcap``: logits = softcap * tanh(logits / softcap) (Gemma's final soft-capping)."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard, tp: TPGroup | None,
                 tied: VocabEmbedding | None = None, softcap: float | None = None) -> None:
        super().__init__()
        lo, hi = shard.vocab
        self.vocab_size, self.tp, self.softcap = vocab_size, tp, softcap
        if tied is not None:
            self.weight = tied.weight
        else:
            self.weight = nn.Parameter(torch.empty(hi - lo, hidden_size))
            _vocab_loader(self.weight, vocab_size, hidden_size, lo, hi)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = cpu_gemm.linear(hidden, self.weight).float()  # F.linear; oneDNN's for float32 on CPU
        if self.tp is not None:
            logits = self.tp.all_gather_last(logits)[:, :self.vocab_size]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
