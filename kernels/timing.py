"""The one timing helper of the project (bench.py and the tools). Pure torch: it imports without building the op
library."""

import random
import statistics
import time

import torch

HAS_CUDA = torch.cuda.is_available()


_l2_flush_buffer = None


def _shuffled(items, rng):
    items = list(items)
    rng.shuffle(items)
    return items


def time_each_ms(fns, *, samples=30, warmup=3, calls_per_sample=1, flush_l2=True, cpu=False):
    """Median milliseconds per call of each function in fns, sampled round-robin in a seeded fresh order per round
    (drift and cache state hit every function alike). GPU: CUDA events on the current stream, L2 flushed before each
    sample if flush_l2; without a GPU or with cpu=True, wall-clock time."""
    global _l2_flush_buffer
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    order = random.Random(0)
    if cpu or not HAS_CUDA:
        for _ in range(samples):
            for fn, fn_times in _shuffled(zip(fns, times), order):
                start = time.perf_counter()
                for _ in range(calls_per_sample):
                    fn()
                fn_times.append((time.perf_counter() - start) * 1e3 / calls_per_sample)
        return [statistics.median(fn_times) for fn_times in times]
    if flush_l2 and _l2_flush_buffer is None:
        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
        _l2_flush_buffer = torch.empty(2 * l2_bytes // 4, dtype=torch.float32, device="cuda")
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
              for _ in fns]
    torch.cuda.synchronize()
    for i in range(samples):
        for fn, fn_events in _shuffled(zip(fns, events), order):
            start, end = fn_events[i]
            if flush_l2:
                _l2_flush_buffer.zero_()
            start.record()
            for _ in range(calls_per_sample):
                fn()
            end.record()
    torch.cuda.synchronize()
    return [statistics.median(start.elapsed_time(end) / calls_per_sample for start, end in fn_events)
            for fn_events in events]


def time_ms(fn, **options):
    """Median milliseconds per call of fn(); options as time_each_ms's."""
    return time_each_ms([fn], **options)[0]


def kernelbench_ms(fn, calls=100, warmup=3, cpu=False):
    """KernelBench's way: after warm-up, `calls` timed calls, each after a device sync and an L2 flush, timed with
    CUDA events on the current stream; the mean. (Without a GPU or with cpu=True: the mean of wall-clock calls.)"""
    global _l2_flush_buffer
    for _ in range(warmup):
        fn()
    if cpu or not HAS_CUDA:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) * 1e3 / calls
    if _l2_flush_buffer is None:
        time_each_ms([fn], samples=1, warmup=0)  # allocates the flush buffer
    total = 0.0
    for _ in range(calls):
        torch.cuda.synchronize()
        _l2_flush_buffer.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        total += start.elapsed_time(end)
    return total / calls
