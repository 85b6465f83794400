from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, SamplingRow, _apply_penalties
from engine.sampling_params import SamplingParams

EOS = 2


def row(prompt: list[int] | None = None, output: list[int] | None = None,
        eos: frozenset[int] = frozenset({EOS}), **params: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), prompt or [0], output or [], eos)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return Sampler().sample(logits, rows).token_ids


def logits_for(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


@pytest.fixture(autouse=True)
def _fixed_default_generator() -> None:
    torch.manual_seed(0)


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    logits = torch.randn(6, 100)
    logits[5, 7] = logits[5, 40] = 50.0  # tie: argmax takes the lower id
    out = Sampler().sample(logits, [row(temperature=0.0)] * 6)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[5] == 7
    assert out.logprobs == [None] * 6


def test_sample_does_not_modify_logits() -> None:
    logits = torch.randn(3, 20)
    before = logits.clone()
    rows = [row(temperature=0.0, repetition_penalty=1.5, output=[1, 2]),
            row(seed=1, top_p=0.5, top_k=3, min_p=0.1),
            row(temperature=0.0, min_tokens=2, logprobs=2)]
    Sampler().sample(logits, rows)
    assert torch.equal(logits, before)


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(16, 64)
    rows = [row(temperature=1.3, top_k=1, seed=i) for i in range(16)]
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()


# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 scattered over ids 5, 1, 7, 0, 3
_PERM = [5, 1, 7, 0, 3]
_KEEP_TOP2 = {5, 1}


def _shuffled_logits() -> torch.Tensor:
    probs = torch.full((8,), 1e-9)
    probs[_PERM] = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    return probs.log()


@pytest.mark.parametrize("params", [
    {"top_k": 2},
    {"top_p": 0.6},  # mass before id 7 is 0.7 >= 0.6
    {"min_p": 0.5},  # 0.15 < 0.5 * 0.4
    # top-p applies to the top-k renormalised distribution: with the top 3
    # kept, the mass before id 7 is 0.7 / 0.85 = 0.82 >= 0.8, so it goes.
    {"top_k": 3, "top_p": 0.8},
    {"temperature": 0.5, "top_p": 0.7},  # sharpened: 0.56 + 0.32 >= 0.7
])
def test_filters_never_pick_excluded_tokens(params: dict[str, float]) -> None:
    n = 4000
    logits = _shuffled_logits().expand(n, -1)
    picked = set(sample(logits, [row(**params)] * n))
    assert picked == _KEEP_TOP2


def test_top_p_keeps_top_token_even_when_it_alone_exceeds_top_p() -> None:
    logits = _shuffled_logits().expand(500, -1)
    assert set(sample(logits, [row(top_p=0.01)] * 500)) == {5}


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(seeded: bool) -> None:
    n = 20000 if not seeded else 5000
    logits = torch.tensor([1.0, 0.2, -0.5, 1.5, 0.0])
    temperature = 0.8
    rows = [row(temperature=temperature, seed=i if seeded else None) for i in range(n)]
    counts = torch.bincount(torch.tensor(sample(logits.expand(n, -1), rows)), minlength=5)
    expected = (logits / temperature).softmax(dim=-1)
    # ~4 standard deviations of a binomial frequency
    tolerance = 4 * math.sqrt(0.25 / n)
    assert torch.allclose(counts / n, expected, atol=tolerance)


def _seeded_row(seed: int, step: int, **params: object) -> SamplingRow:
    return row(output=list(range(step)), seed=seed, **params)


def test_same_seed_same_token_regardless_of_batch() -> None:
    vocab = 1000
    target_logits = torch.randn(vocab)
    for step in range(20):
        target = _seeded_row(1234, step, top_p=0.95)
        alone = sample(target_logits.unsqueeze(0), [target])
        companions = [row(), row(temperature=0.0), _seeded_row(99, step),
                      row(repetition_penalty=1.2, output=[3, 4], seed=5)]
        for position in range(len(companions) + 1):
            rows = companions[:position] + [target] + companions[position:]
            logits = torch.randn(len(rows), vocab)
            logits[position] = target_logits
            assert sample(logits, rows)[position] == alone[0]


def test_different_seeds_and_steps_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: any collision is pure chance

    def run(seed: int) -> list[int]:
        return [sample(logits, [_seeded_row(seed, step)])[0] for step in range(20)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert len(set(run(1))) > 15  # steps do not reuse one stream


def test_step_randomness_does_not_depend_on_earlier_calls() -> None:
    logits = torch.randn(1, 500)
    fresh = Sampler().sample(logits, [_seeded_row(7, 5)]).token_ids

    sampler = Sampler()
    torch.manual_seed(12345)
    for step in range(5):  # what a decode tier would have done before step 5
        sampler.sample(torch.randn(3, 500), [_seeded_row(7, step), row(), row(seed=1)])
    assert sampler.sample(logits, [_seeded_row(7, 5)]).token_ids == fresh


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0],
                           [2.0, -1.0, 0.5, 1.0, -2.0]])
    penalised = row(prompt=[0, 0], output=[1, 1, 3], repetition_penalty=2.0,
                    frequency_penalty=0.5, presence_penalty=0.25)
    untouched = row(prompt=[0], output=[1])
    out = _apply_penalties(logits, [penalised, untouched])
    # id 0: prompt only -> 2 / 2
    # id 1: output x2   -> -1 * 2 - 0.5 * 2 - 0.25
    # id 3: output x1   -> 1 / 2 - 0.5 * 1 - 0.25
    expected = torch.tensor([1.0, -3.25, 0.5, -0.25, -2.0])
    assert torch.allclose(out[0], expected)
    assert torch.equal(out[1], logits[1])


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    assert sample(logits, [row(temperature=0.0, output=[0], frequency_penalty=0.2)]) == [1]
    assert sample(logits, [row(temperature=0.0, prompt=[0], repetition_penalty=1.1)]) == [1]
    # presence/frequency look at output tokens only
    assert sample(logits, [row(temperature=0.0, prompt=[0], presence_penalty=2.0)]) == [0]


def test_min_tokens_suppresses_eos_and_stop_token_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 8.0]])  # EOS = 2, stop id 4

    def greedy(step: int, **params: object) -> int:
        return sample(logits, [row(output=[1] * step, temperature=0.0, min_tokens=3,
                                   stop_token_ids=[4], **params)])[0]

    assert greedy(2) == 3
    assert greedy(3) == EOS
    assert greedy(2, ignore_eos=True) == EOS  # eos is not a stop when ignored
    random_picks = sample(logits.expand(200, -1), [row(min_tokens=1, stop_token_ids=[4])] * 200)
    assert EOS not in random_picks and 4 not in random_picks


def test_logprobs_are_from_raw_logits() -> None:
    logits = torch.randn(3, 50)
    rows = [row(seed=3, logprobs=5, repetition_penalty=1.5, output=[1, 2], temperature=0.5),
            row(temperature=0.0, logprobs=0),
            row(temperature=0.0)]
    out = Sampler().sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for i in (0, 1):
        lp = out.logprobs[i]
        assert lp is not None
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(raw[i, tok].item(), abs=1e-6)
        assert lp.rank == 1 + int((raw[i] > raw[i, tok]).sum())
    assert out.logprobs[1].rank == 1 and out.logprobs[1].top == []
    assert out.logprobs[2] is None
    top = out.logprobs[0].top
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    assert [v for _, v in top] == pytest.approx(raw[0].topk(5).values.tolist(), abs=1e-6)
    assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


def test_mixed_batch_matches_each_row_alone() -> None:
    vocab = 300
    rows = [row(temperature=0.0),
            _seeded_row(11, 4, top_k=20, top_p=0.9, min_p=0.05),
            _seeded_row(12, 2, repetition_penalty=1.3, frequency_penalty=0.4, temperature=0.7),
            row(temperature=0.0, presence_penalty=1.0, output=[5, 6]),
            row(temperature=0.0, min_tokens=4, output=[1], logprobs=3),
            _seeded_row(13, 0, logprobs=2)]
    logits = torch.randn(len(rows), vocab)
    batch = Sampler().sample(logits, rows)
    for i, r in enumerate(rows):
        alone = Sampler().sample(logits[i:i + 1], [r])
        assert batch.token_ids[i] == alone.token_ids[0]
        assert batch.logprobs[i] == alone.logprobs[0]


def _controlled(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The reference: allowed_token_ids and logit_bias applied by hand to one row's logits."""
    out = logits.clone()
    if params.allowed_token_ids is not None:
        keep = torch.zeros_like(out, dtype=torch.bool)
        keep[params.allowed_token_ids] = True
        out[~keep] = float("-inf")
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    return out


@pytest.mark.parametrize("seed", range(6))
def test_logit_bias_and_allowed_token_ids_equal_their_reference(seed: int) -> None:
    """Fresh random logits and controls: each controlled row (greedy, seeded with filters, with
    logprobs, beside uncontrolled companions) samples what an uncontrolled row samples from the
    logits changed by hand; logprobs stay those of the raw logits."""
    g = torch.Generator().manual_seed(seed)
    vocab = 300
    logits = torch.randn(4, vocab, generator=g) * 3
    picks = torch.randperm(vocab, generator=g).tolist()
    bias = {t: float(torch.empty(1).uniform_(-100, 100, generator=g)) for t in picks[:5]}
    allowed = picks[5:25]
    controls = [dict(logit_bias=bias), dict(allowed_token_ids=allowed), dict(logit_bias=bias, allowed_token_ids=allowed)]
    for kind in (dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=seed), dict(temperature=0.0, logprobs=2)):
        for control in controls:
            params = SamplingParams(**kind, **control)
            rows = [row(), SamplingRow(params, [0], [1, 2], frozenset({EOS})), row(temperature=0.0), row(seed=3)]
            got = Sampler().sample(logits, rows)
            plain = SamplingRow(SamplingParams(**kind), [0], [1, 2], frozenset({EOS}))
            want = Sampler().sample(_controlled(logits[1], params).unsqueeze(0), [plain])
            assert got.token_ids[1] == want.token_ids[0], (kind, control)
            if "allowed_token_ids" in control:
                assert got.token_ids[1] in allowed
            if kind.get("logprobs"):
                assert got.logprobs[1].top == Sampler().sample(logits[1:2], [plain]).logprobs[0].top


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = torch.randn(1, 50)
    top = int(logits.argmax())
    assert sample(logits, [row(temperature=0.0, logit_bias={7: 100.0})]) == [7]
    assert sample(logits, [row(temperature=0.0, logit_bias={top: -100.0})]) != [top]
    assert sample(logits, [row(temperature=0.0, allowed_token_ids=[3, 9])])[0] in (3, 9)


@pytest.mark.parametrize("change, message", [
    (dict(logit_bias={1: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, 50]), "allowed_token_ids"), (dict(logit_bias={50: 1.0}), "logit_bias"),
])
def test_logit_controls_out_of_range_are_refused(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**change).validate(vocab_size=50)


def test_seeded_draws_survive_a_last_bits_change_of_the_logits() -> None:
    """A resumed (migrated) stream's logits come from a prefill where the uninterrupted one's
    came from decode steps: equal but for the last bits (~5e-6 in logprob on CPU). A seeded
    draw must not move with them. An inverse-CDF draw over a vocabulary this size moves on
    some 2% of steps here (every cumulative boundary shifts; 5 of these 256); the exponential
    race only on a near-tie of its two best scores."""
    g = torch.Generator().manual_seed(0)
    vocab, steps, hidden = 49152, 256, 64
    h = torch.randn(steps, hidden, generator=g)
    head = torch.randn(hidden, vocab, generator=g) * 0.3  # logits' std ~2.4: thousands of tokens in play
    nudged = h + torch.randn(steps, hidden, generator=g) * 1e-5  # logits move by ~1e-5
    rows = [_seeded_row(1234, step, temperature=0.8) for step in range(steps)]
    assert sample(h @ head, rows) == sample(nudged @ head, rows)


def test_race_noise_is_the_same_integer_hash_on_every_machine() -> None:
    """The seeded noise is integer arithmetic with wrapping products: its bits equal a
    plain-Python lowbias32 of (key, v) (no dependence on torch's generators or build)."""
    from engine.sampler import _hash32, _lsr32, _signed32, _vocab_hashes

    def lowbias32(x: int) -> int:
        x &= 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    vocab, keys = 5000, [0x12345678, 0xDEADBEEF, 0]
    bits = _lsr32(_hash32(torch.tensor([_signed32(k) for k in keys], dtype=torch.int32).unsqueeze(1)
                          ^ _vocab_hashes(vocab, torch.device("cpu"))), 9)
    for r, key in enumerate(keys):
        for v in (0, 1, 4242, vocab - 1):
            assert int(bits[r, v]) == lowbias32(lowbias32((v + 1) * 0x9E3779B9) ^ key) >> 9


def test_race_noise_is_finite_and_positive_at_its_extremes() -> None:
    """Every value of the 23 bits gives Exp(1) noise in (0, inf): the largest one too (with 24
    bits it rounded to u = 1.0, noise -0.0, and the NaN score of p / -0.0 won the race)."""
    from engine.sampler import _exp_noise

    e = _exp_noise(torch.tensor([0, 1, 2**22, 2**23 - 2, 2**23 - 1], dtype=torch.int32))
    assert torch.isfinite(e).all() and (e > 0).all(), e


def test_a_seeded_row_under_a_two_token_mask_always_draws_one_of_them() -> None:
    """Thousands of seeded draws over a 49k vocabulary with two tokens allowed (a constraint's
    mask): each is one of the two (the noise's extremes never pick a token of probability 0)."""
    vocab, allowed = 49152, (18, 1799)
    logits = torch.full((64, vocab), float("-inf"))
    logits[:, allowed[0]], logits[:, allowed[1]] = 1.0, 0.0
    for batch in range(40):
        rows = [_seeded_row(batch, step, temperature=1.0) for step in range(64)]
        assert set(sample(logits, rows)) <= set(allowed), batch
