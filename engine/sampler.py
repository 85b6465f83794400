"""Pick the next token of every running sequence from the model's logits.

Order of operations (vLLM semantics), per row:

1. logprobs, if asked for, come from the RAW logits (``log_softmax`` before
   anything below touches them);
2. a structured-output constraint's bitmask: tokens it does not allow get ``-inf``;
   ``allowed_token_ids``: every other token gets ``-inf``; ``logit_bias`` is added;
3. penalties: repetition over prompt + output tokens (positive logits are
   divided by it, negative ones multiplied), then frequency/presence over
   output tokens (``logit -= frequency * count + presence * (count > 0)``);
   ``min_tokens``: until the row has that many output tokens, its eos ids
   (unless ``ignore_eos``) and ``stop_token_ids`` get ``-inf``;
4. greedy rows (``temperature < 1e-5``) take ``argmax`` (ties: lowest id);
   the others are divided by the temperature, then filtered by top-k,
   top-p (the smallest prefix of the sorted distribution whose mass reaches
   ``top_p``; the top token is always kept) and min-p (drop tokens whose
   probability is below ``min_p`` times the largest), then sampled.

Reproducibility across processes. pdserve samples a request's first token on
the prefill tier and the rest on the decode tier, resumes a migrated request's
stream on another decode server after a prefill of its prompt plus the tokens
already streamed, and must match one offline engine token for token. So the
randomness a seeded row uses at step ``k`` (``k = len(output_token_ids)``) is a
pure function of ``(seed, k)``, computed with integer hashing, identical on
every machine and independent of torch's generators: a key per (seed, k)
(splitmix64, in Python), and from it one exponential ``E_v`` per vocabulary
entry (``_race_noise``: a 32-bit hash, vectorised on the row's device). The row takes the winner of
an exponential race, ``argmax_v p_v / E_v``: an exact draw from the filtered
distribution, with no state carried between steps; batch companions, the row's
position in the batch and earlier calls cannot change it. Filtered tokens
(probability 0) can never win.

Why a race and not an inverse-CDF draw (one uniform against the cumulative
distribution in vocabulary order, what this module did first): the logits are
not bit-identical across paths. A token computed by a prefill (the first token;
the first one after a migration's seam, and every later one reading KV a prefill
wrote) differs from the same token computed by decode steps in the last few bits
(seen on CPU: ~5e-6 in logprob), since the GEMMs and attention reduce in another
order. Such a change moves every boundary of the cumulative distribution a
little, and with tens of thousands of tokens in it the uniform lands in a moved
stretch on a fraction of a percent of steps, more where the distribution is flat
(seen: a seeded stream at temperature 0.8 resumed after 7 of 32 tokens drew id
6478 where the uninterrupted one drew 6476; tests/engine/test_sampler.py moves
5 of 256 draws). The race's winner
changes only when the two best scores are that close, about as rare as a greedy
near-tie. It costs [R, V] noise a step for R seeded rows (~0.5 ms a row at
V = 49k on one CPU core). Unseeded rows, which nothing reproduces, keep the
cheap inverse-CDF draw on a uniform from torch's default CPU generator.

Guard. A row whose numbers are not finite (a NaN or infinite penalty or
temperature that got past validation, or NaN logits) has no distribution to
draw from; the inverse-CDF search would return an id outside the vocabulary.
Such a row gets ``SAMPLE_FAILED`` (-1) instead of a token, and the scheduler
ends that one request with a "sampling" error; its batch companions are not
affected. The check rides on the existing host copy (no extra sync).

Host synchronisation: one per call, when its result is read. ``sample_async``
queues the whole draw on the device and starts the ids' copy to the host;
``PendingSample.result()`` waits for that copy (``sample`` is the two in
one). Meanwhile the ids stay on the device, where the next decode step can
take them as inputs (the engine's overlapped steps). Small per-row tensors
(temperatures, penalty token lists, uniforms) go host -> device through
pinned memory with ``non_blocking=True``, which does not wait for the GPU.

A row may be sampled one step ahead of what the host knows of it
(``SamplingRow.pending``: tokens sampled but not yet read back). Its step
``k`` counts them, so seeded draws and ``min_tokens`` stay exact; penalties,
which read the output tokens themselves, need ``pending == 0``.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams

# The token id of a row that could not be sampled (see "Guard" above).
SAMPLE_FAILED = -1
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class SamplingRow:
    """One sequence to sample this step. The sampler does not modify it."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far and known on the host, before this step
    eos_token_ids: frozenset[int]  # suppressed (with stop_token_ids) until min_tokens
    pending: int = 0  # tokens sampled before this step whose ids the host has not read yet
    # A structured-output constraint's allowed tokens: [ceil(V / 32)] int32, bit v % 32 of word
    # v // 32 set for an allowed token v (engine/grammar.py); None: every token
    bitmask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.pending and self.params.has_penalties:
            raise ValueError("penalties read the output tokens: a row with pending tokens cannot have them")

    @property
    def step(self) -> int:
        return len(self.output_token_ids) + self.pending

    @property
    def suppressed_token_ids(self) -> frozenset[int]:
        """Token ids forbidden at this step by ``min_tokens`` (empty after it)."""
        if self.step >= self.params.min_tokens:
            return frozenset()
        ids = frozenset(self.params.stop_token_ids)
        return ids if self.params.ignore_eos else ids | self.eos_token_ids


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]  # None where params.logprobs is None


class PendingSample:
    """A draw queued on the device: ``token_ids`` [B] int64 stays there (SAMPLE_FAILED
    where a row failed); ``result()`` reads the ids (and logprobs) on the host, waiting
    for the copy started at creation and nothing else."""

    def __init__(self, token_ids: torch.Tensor, rows: Sequence[SamplingRow],
                 packed: torch.Tensor | None = None) -> None:
        self.token_ids, self._rows = token_ids, rows
        src = token_ids if packed is None else packed  # packed: see _pack_logprobs
        self._with_logprobs = packed is not None
        self._ready = None
        if src.device.type == "cuda":
            self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self._host.copy_(src, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = src
        self._result: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            host = self._host.tolist()
            self._result = (_unpack_logprobs(host, self._rows) if self._with_logprobs
                            else SamplerOutput(host, [None] * len(self._rows)))
        return self._result


class Sampler:
    """Stateless: every call depends only on its arguments (and, for unseeded
    rows, on the device's default generator)."""

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Pick one token per row. ``logits``: [B, V]; not modified."""
        return self.sample_async(logits, rows).result()

    def sample_async(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> PendingSample:
        """Queue the draw of one token per row on ``logits``' device, without waiting for it.
        ``logits`` [B, V] is read by work queued here: keep it unchanged until that ran
        (stream order does it for a buffer only this stream writes)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [{len(rows)}, V], got {tuple(logits.shape)}")
        if all(_is_plain_greedy(row) for row in rows):
            return PendingSample(logits.argmax(dim=-1), rows)

        logits = logits.float()  # [B, V]; every op below is out of place
        raw_logprobs = None
        if any(row.params.logprobs is not None for row in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = _apply_logit_controls(_apply_bitmasks(logits, rows), rows)
        logits = _apply_penalties(logits, rows)
        logits = _apply_min_tokens(logits, rows)

        token_ids = logits.argmax(dim=-1)  # [B]; final for greedy rows
        random_idx = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if random_idx:
            idx = to_device(torch.tensor(random_idx), logits.device)
            sampled = _sample_random(logits[idx], [rows[i] for i in random_idx])
            token_ids = token_ids.index_copy(0, idx, sampled)
        token_ids = _guard(token_ids, logits)

        if raw_logprobs is None:
            return PendingSample(token_ids, rows)
        return PendingSample(token_ids, rows, _pack_logprobs(token_ids, raw_logprobs, rows))


class PendingVerify:
    """A verification queued on the device: ``result()`` reads, per position, whether its
    proposal was accepted and the token the target drew there."""

    def __init__(self, packed: torch.Tensor) -> None:  # [P, 2] int64: accepted, token
        self._pending = PendingSample(packed, [])

    def result(self) -> list[tuple[bool, int]]:
        return [(bool(a), int(t)) for a, t in self._pending.result().token_ids]


def verify_async(logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[int]) -> PendingVerify:
    """Speculative verification, queued on ``logits``' device (engine/speculative.py).

    logits [P, V]: the target's logits at P positions; ``rows[j]`` samples position j (its
    output tokens include the proposals before it, so penalties, min_tokens and seeds see
    the sequence as it would be); ``drafts[j]`` is the proposal there, or -1 at the last
    position of a row (nothing proposed: its token is the bonus). Per position:

        greedy   accepted = (argmax == draft); token = argmax
        sampled  with p the row's filtered distribution: accepted with probability
                 p(draft) / sum(p) (a uniform of its own stream); token = a draw from p
                 with the draft removed (the residual of a one-hot proposal), or from p at
                 the bonus position

    The caller keeps the proposals up to the first rejection and the token there: the
    greedy output is plain decoding's, the sampled one has the target's distribution."""
    if logits.dim() != 2 or logits.shape[0] != len(rows) or len(drafts) != len(rows):
        raise ValueError(f"logits must be [{len(rows)}, V] with one draft per row, got {tuple(logits.shape)}")
    device, vocab = logits.device, logits.shape[1]
    logits = _apply_min_tokens(_apply_penalties(_apply_logit_controls(logits.float(), rows), rows), rows)
    draft = to_device(torch.tensor(list(drafts), dtype=torch.long), device)  # [P]
    has_draft = draft >= 0
    greedy_tok = logits.argmax(dim=-1)  # [P]
    accepted = has_draft & (greedy_tok == draft)
    token = greedy_tok
    random_idx = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if random_idx:
        idx = to_device(torch.tensor(random_idx), device)
        sub = [rows[i] for i in random_idx]
        probs = _filtered_probs(logits[idx], sub)  # [R, V]
        d = draft[idx]
        p_draft = probs.gather(1, d.clamp(min=0).unsqueeze(1)).squeeze(1).double() / probs.sum(-1).double()
        accept_r = (d >= 0) & (_uniforms(sub, device, stream=1) < p_draft)
        residual = probs.scatter(1, d.clamp(min=0).unsqueeze(1), 0.0)
        residual = torch.where((d >= 0).unsqueeze(1), residual, probs)
        accepted = accepted.index_copy(0, idx, accept_r)
        token = token.index_copy(0, idx, _draw(residual, sub))
    token = _guard(token, logits)
    return PendingVerify(torch.stack([accepted.long(), token], dim=1))


def _guard(token_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """[B] ids -> the same, with SAMPLE_FAILED where the id is outside the
    vocabulary or its (penalised, masked) logit is NaN or -inf (a row whose
    constraint allows no token has only -inf). No host sync."""
    vocab = logits.shape[1]
    inside = (token_ids >= 0) & (token_ids < vocab)
    chosen = logits.gather(1, token_ids.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1)  # [B]
    ok = inside & ~chosen.isnan() & (chosen > float("-inf"))
    return torch.where(ok, token_ids, torch.full_like(token_ids, SAMPLE_FAILED))


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (p.is_greedy and not p.has_penalties and p.logprobs is None and not p.has_logit_controls
            and not row.suppressed_token_ids and row.bitmask is None)


def _apply_bitmasks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """-inf where a constrained row's bitmask does not allow the token. [B, V] -> [B, V]."""
    idx = [i for i, row in enumerate(rows) if row.bitmask is not None]
    if not idx:
        return logits
    device, vocab = logits.device, logits.shape[1]
    words = to_device(torch.stack([rows[i].bitmask for i in idx]), device)  # [G, W] int32
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [G, V]
    rows_idx = to_device(torch.tensor(idx), device)
    return logits.index_copy(0, rows_idx, logits[rows_idx].masked_fill(~allowed, float("-inf")))


def _apply_logit_controls(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``allowed_token_ids`` (-inf on every other token), then ``logit_bias`` added, on the
    rows that have either. [B, V] -> [B, V]; ids outside the logits' width are skipped."""
    idx = [i for i, row in enumerate(rows) if row.params.has_logit_controls]
    if not idx:
        return logits
    device, vocab = logits.device, logits.shape[1]
    allowed_pairs = [(j, t) for j, i in enumerate(idx) for t in rows[i].params.allowed_token_ids or () if t < vocab]
    restricted = [j for j, i in enumerate(idx) if rows[i].params.allowed_token_ids is not None]
    bias = [(j, t, b) for j, i in enumerate(idx) for t, b in (rows[i].params.logit_bias or {}).items() if t < vocab]
    rows_idx = to_device(torch.tensor(idx), device)
    sub = logits[rows_idx]  # [C, V]
    if restricted:
        keep = torch.zeros(len(idx), vocab, dtype=torch.bool)
        keep[[j for j in range(len(idx)) if j not in restricted]] = True
        if allowed_pairs:
            pairs = torch.tensor(allowed_pairs, dtype=torch.long)
            keep[pairs[:, 0], pairs[:, 1]] = True
        sub = sub.masked_fill(~to_device(keep, device), float("-inf"))
    if bias:
        add = torch.zeros(len(idx), vocab, dtype=torch.float32)
        add[torch.tensor([j for j, _, _ in bias]), torch.tensor([t for _, t, _ in bias])] = torch.tensor(
            [float(b) for _, _, b in bias], dtype=torch.float32)
        sub = sub + to_device(add, device)
    return logits.index_copy(0, rows_idx, sub)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device copy that does not make the host wait for the GPU."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _padded(seqs: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """[len(seqs), max_len] int64, right-padded with ``pad`` (max_len >= 1)."""
    width = max(1, max(len(s) for s in seqs))
    return torch.tensor([list(s) + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties on the rows that have any."""
    pen_idx = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not pen_idx:
        return logits
    pen_rows = [rows[i] for i in pen_idx]
    device, vocab = logits.device, logits.shape[1]
    idx = to_device(torch.tensor(pen_idx), device)
    sub = logits[idx]  # [P, V]

    def column(values: list[float]) -> torch.Tensor:  # [P, 1]
        return to_device(torch.tensor(values, dtype=torch.float32), device).unsqueeze(1)

    # Token ids are scattered into V + 1 columns: the last one absorbs padding.
    out_ids = to_device(_padded([r.output_token_ids for r in pen_rows], vocab), device)
    counts = torch.zeros(len(pen_rows), vocab + 1, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
    counts = counts[:, :vocab]  # [P, V] occurrences in the output
    in_output = counts > 0

    if any(r.params.repetition_penalty != 1.0 for r in pen_rows):
        prompt_ids = to_device(_padded([r.prompt_token_ids for r in pen_rows], vocab), device)
        in_prompt = torch.zeros(len(pen_rows), vocab + 1, dtype=torch.bool, device=device)
        in_prompt.scatter_(1, prompt_ids, True)
        seen = in_prompt[:, :vocab] | in_output
        rep = column([r.params.repetition_penalty for r in pen_rows])
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)

    freq = column([r.params.frequency_penalty for r in pen_rows])
    pres = column([r.params.presence_penalty for r in pen_rows])
    sub = sub - freq * counts - pres * in_output.float()
    return logits.index_copy(0, idx, sub)


def _apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    vocab = logits.shape[1]
    pairs = [(i, t) for i, row in enumerate(rows)
             for t in sorted(row.suppressed_token_ids) if 0 <= t < vocab]
    if not pairs:
        return logits
    where = to_device(torch.tensor(pairs, dtype=torch.long), logits.device)  # [N, 2]
    # torch.full, not torch.tensor(-inf, device=...): no blocking host copy
    neg_inf = torch.full((len(pairs),), float("-inf"), device=logits.device)
    return logits.index_put((where[:, 0], where[:, 1]), neg_inf)


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row. [R, V] -> [R]."""
    return _draw(_filtered_probs(logits, rows), rows)


def _filtered_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p: each row's distribution [R, V], not renormalised
    after min-p (``_draw`` scales by the total)."""
    device, vocab = logits.device, logits.shape[1]

    def column(values: list[float]) -> torch.Tensor:  # [R, 1]
        return to_device(torch.tensor(values, dtype=torch.float32), device).unsqueeze(1)

    logits = logits / column([r.params.temperature for r in rows])
    use_top_k = any(0 < r.params.top_k < vocab for r in rows)
    use_top_p = any(r.params.top_p < 1.0 for r in rows)
    if use_top_k or use_top_p:
        # Stable sort: ties keep id order, so the cut is deterministic.
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [R, V]
        if use_top_k:
            k = column([r.params.top_k if r.params.top_k > 0 else vocab for r in rows])
            position = torch.arange(vocab, device=device).unsqueeze(0)  # [1, V]
            sorted_logits = sorted_logits.masked_fill(position >= k, float("-inf"))
        if use_top_p:
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # 0 for the top token
            top_p = column([r.params.top_p for r in rows])
            sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)

    probs = logits.softmax(dim=-1)  # [R, V]
    if any(r.params.min_p > 0.0 for r in rows):
        floor = column([r.params.min_p for r in rows]) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _draw(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One draw per row of ``probs`` [R, V] (not necessarily normalised): seeded rows by
    an exponential race on their (seed, step) noise, the others by inverse CDF. A row
    without a distribution gets V (out of range: ``_guard`` marks it failed)."""
    vocab, device = probs.shape[1], probs.device
    seeded = [i for i, row in enumerate(rows) if row.params.seed is not None]
    if len(seeded) == len(rows):
        picked = _race(probs, rows)
    else:
        picked = _inverse_cdf(probs, _uniforms(rows, device))
        if seeded:
            idx = to_device(torch.tensor(seeded), device)
            picked = picked.index_copy(0, idx, _race(probs[idx], [rows[i] for i in seeded]))
    total = probs.double().sum(dim=-1)  # [R]; NaN or 0 when the row has no distribution
    no_distribution = ~(total > 0) | total.isinf()
    return picked.masked_fill(no_distribution, vocab)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row of ``probs`` [R, V] with ``uniforms`` [R] in [0, 1).
    x is in (0, total], so the pick has cdf >= x > cdf of the previous token: a token
    of probability 0 can never be it."""
    cdf = probs.double().cumsum(dim=-1)  # [R, V], non-decreasing
    x = (1.0 - uniforms).unsqueeze(1) * cdf[:, -1:]  # [R, 1]
    return torch.searchsorted(cdf, x).squeeze(1)  # [R]


def _race(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The exponential race of seeded rows: ``argmax_v p_v / E_v`` [R], E from ``_race_noise``.
    A token of probability 0 scores 0 and never beats one above it (E is finite and > 0)."""
    keys = [_signed32(_step_key(row.params.seed, row.step)) for row in rows]
    noise = _race_noise(to_device(torch.tensor(keys, dtype=torch.int32), probs.device), probs.shape[1])
    return (probs.float() / noise).argmax(dim=-1)


def _race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [R, V] float32 > 0, entry (r, v) a function of ``keys[r]`` and v alone:
    ``_hash32(keys[r] ^ _hash32((v + 1) * golden))``, its top 23 bits through ``_exp_noise``.
    In int32 arithmetic on the row's device (products wrap), about 20 elementwise passes over
    [R, V]: float64 splitmix64 cost 3-4x as much on CPU."""
    bits = _hash32(keys.unsqueeze(1) ^ _vocab_hashes(vocab, keys.device))  # [R, V] int32
    return _exp_noise(_lsr32(bits, 9))


def _exp_noise(top23: torch.Tensor) -> torch.Tensor:
    """Exp(1) from 23 uniform bits b: u = (b + 1/2) 2^-23, exact in float32 and inside (0, 1)
    (at most 1 - 2^-24, below float32's last step under 1: 24 bits would round that to 1.0,
    giving -log u = -0 and a NaN score that wins every race), then -log u, finite and > 0."""
    return (top23.float() + 0.5).mul_(2.0**-23).log_().neg_()


@functools.lru_cache(maxsize=8)
def _vocab_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """[V] int32: ``_hash32((v + 1) * golden)``, the per-token half of the race's noise."""
    return _hash32(torch.arange(1, vocab + 1, dtype=torch.int32, device=device) * _signed32(0x9E3779B9))


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of int32 ``x``, elementwise."""
    x = (x ^ _lsr32(x, 16)) * 0x7FEB352D
    x = (x ^ _lsr32(x, 15)) * _signed32(0x846CA68B)
    return x ^ _lsr32(x, 16)


def _lsr32(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int32 bits (torch's ``>>`` is arithmetic)."""
    return (x >> shift) & ((1 << (32 - shift)) - 1)


def _signed32(x: int) -> int:
    """The low 32 bits of ``x`` as the int32 with the same bits."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x


def _uniforms(rows: Sequence[SamplingRow], device: torch.device, stream: int = 0) -> torch.Tensor:
    """[R] float64 in [0, 1); a seeded row's depends only on (seed, step, stream): stream 0
    draws tokens, others are independent draws of the same step (speculative acceptance)."""
    num_unseeded = sum(row.params.seed is None for row in rows)
    unseeded = iter(torch.rand(num_unseeded, dtype=torch.float64).tolist())  # CPU: no sync
    values = [next(unseeded) if row.params.seed is None
              else _seeded_uniform(row.params.seed if not stream else _mix64(row.params.seed ^ (stream * _GOLDEN64)),
                                   row.step) for row in rows]
    return to_device(torch.tensor(values, dtype=torch.float64), device)


def _mix64(x: int) -> int:
    """splitmix64 finaliser: every output bit depends on every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _step_key(seed: int, step: int) -> int:
    """The 64 random bits of ``step`` of a request seeded with ``seed`` (its race's noise key
    and its uniform both come from them)."""
    return _mix64((_mix64(seed & _MASK64) + (step + 1) * _GOLDEN64) & _MASK64)


def _seeded_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) of ``step`` of a request seeded with ``seed``."""
    return (_step_key(seed, step) >> 11) * 2.0**-53  # 53 bits: exact in a float64


def logprob_table(logprobs: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> torch.Tensor:
    """Per row of ``logprobs`` [K, V]: the logprob of ``token_ids`` [K], its rank (1: the most
    likely) and the top ``top_n`` ids and logprobs, as [K, 2 + 2 * top_n] float64 (which holds
    ids and ranks exactly, < 2**53): one tensor, one copy to the host (``table_logprobs``)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [K, 1]
    rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # [K, 1]
    top_lp, top_ids = logprobs.topk(top_n, dim=-1)  # [K, N]
    return torch.cat([chosen.double(), rank.double(), top_ids.double(), top_lp.double()], dim=1)


def table_logprobs(token_id: int, row: Sequence[float], top_n: int, n: int) -> Logprobs:
    """One row of ``logprob_table`` (its ``top_n`` columns) as ``Logprobs`` with the top ``n``."""
    return Logprobs(token_id=token_id, logprob=row[0], rank=int(row[1]),
                    top=[(int(row[2 + j]), row[2 + top_n + j]) for j in range(n)])


def _pack_logprobs(token_ids: torch.Tensor, raw_logprobs: torch.Tensor,
                   rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The sampled ids with their ``logprob_table`` in one tensor: [B, 3 + 2N] float64
    (failed rows gather token 0: dropped when unpacked)."""
    top_n = max(row.params.logprobs or 0 for row in rows)
    return torch.cat([token_ids.unsqueeze(1).double(),
                      logprob_table(raw_logprobs, token_ids.clamp(min=0), top_n)], dim=1)


def _unpack_logprobs(host: list[list[float]], rows: Sequence[SamplingRow]) -> SamplerOutput:
    top_n = max(row.params.logprobs or 0 for row in rows)
    ids = [int(r[0]) for r in host]
    logprobs: list[Logprobs | None] = [
        None if row.params.logprobs is None or int(r[0]) == SAMPLE_FAILED
        else table_logprobs(int(r[0]), r[1:], top_n, row.params.logprobs) for row, r in zip(rows, host)]
    return SamplerOutput(ids, logprobs)
