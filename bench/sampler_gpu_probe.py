import time, torch
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
V = 151936
s = Sampler()
for B, kind in [(1, "seeded"), (32, "seeded"), (128, "seeded"), (128, "unseeded"), (128, "greedy")]:
    logits = torch.randn(B, V, device="cuda") * 3
    if kind == "seeded":
        rows = [SamplingRow(SamplingParams(temperature=0.8, seed=i), [1], list(range(5)), frozenset()) for i in range(B)]
    elif kind == "unseeded":
        rows = [SamplingRow(SamplingParams(temperature=0.8), [1], list(range(5)), frozenset()) for i in range(B)]
    else:
        rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=1), [1], list(range(5)), frozenset()) for i in range(B)]
    for _ in range(3):
        s.sample(logits, rows)
    torch.cuda.synchronize(); t = time.perf_counter(); n = 20
    for _ in range(n):
        s.sample(logits, rows)
    torch.cuda.synchronize()
    print(f"sampler {kind:8s} batch {B:4d} V {V}: {(time.perf_counter() - t) / n * 1e3:.2f} ms per call")
