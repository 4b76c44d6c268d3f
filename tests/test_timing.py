"""The timing helper (kernels/timing.py) that bench.py and the tools use: samples of every function taken in turn,
each round in a fresh order, so that no function always runs right after the same one."""

import collections

import pytest

from kernels.timing import time_each_ms


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_every_function_is_sampled_in_turn_and_follows_every_other(count):
    calls = []
    fns = [lambda k=k: calls.append(k) for k in range(count)]
    samples, calls_per_sample = 200, 2
    times = time_each_ms(fns, samples=samples, warmup=0, calls_per_sample=calls_per_sample, cpu=True)
    assert len(times) == count and all(t >= 0 for t in times)
    firsts = calls[::calls_per_sample]  # the function of each sample, in the order they ran
    assert calls == [k for k in firsts for _ in range(calls_per_sample)]
    rounds = [firsts[r:r + count] for r in range(0, len(firsts), count)]
    assert all(sorted(one_round) == list(range(count)) for one_round in rounds)  # one sample of each per round
    if count > 1:
        # Who ran just before each sample: every other function, each about equally often.
        predecessors = collections.Counter(zip(firsts, firsts[1:]))
        for after in range(count):
            before = [predecessors[(b, after)] for b in range(count) if b != after]
            assert min(before) > 0.5 * max(before), (after, before)
