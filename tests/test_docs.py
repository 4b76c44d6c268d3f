"""The docs quote measured figures only from the generated bench files (issue 41).

Every measured figure in README.md and docs/*.md (a speedup `3.65x`, a time `9.31 ms`, a rate `3015.4 GB/s`, a
share of a ceiling `92.6%`, an error `5.84e-7`) must be found in docs/bench.md, docs/bench_level3.md,
docs/bench_level1_2.md or docs/bench_h200.md (all written by `bench.py --markdown`), up to the doc's rounding of it.
Plain file reading and regexes: nothing is built or run.
"""
import functools
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH_FILES = ("docs/bench.md", "docs/bench_level3.md", "docs/bench_level1_2.md", "docs/bench_h200.md")

# Text around a figure that is not a bench figure. Each entry is a snippet of a doc line; a figure inside it is not
# checked. Kept as short as possible: a measured figure from elsewhere belongs in kernels/*/NOTES.md, linked.
ALLOWLIST = {
    "floor near 2.5e-7": "the split method's error floor, a property of the method (kernels/gemm/NOTES.md)",
    "targets 4.0x and 3.7x": "the level-3 MLPs' speedup targets, goals rather than measurements",
}

NUM = r"\d+(?:\.\d+)?"
# A figure's number stands alone: not the tail of a word or of another number (bf16x9, 1024x8192, v1.5).
START = r"(?<![\w.^])"
# kind -> (pattern of a run of figures sharing a unit, power of ten to the bench file's unit). A run such as
# `0.59 / 0.74 ms` or `4.3-4.9x` gives each of its numbers. Sizes (1024x8192, 8x512), powers (2^20), versions, counts
# and seconds (build and test times, which bench.py does not measure) have none of these forms.
FORMS = {
    "speedup": (rf"{START}{NUM}(?:-{NUM})?x(?![\w^])", 0),
    "time": (rf"{START}{NUM}(?:\s*(?:/|-|and)\s*{NUM})*\s?ms\b", 0),
    "time_us": (rf"{START}{NUM}(?:\s*(?:/|-|and)\s*{NUM})*\s?(?:us|µs|μs)\b", -3),
    "bytes_rate": (rf"{START}{NUM}(?:\s*/\s*{NUM})*\s?GB/s", 0),
    "bytes_rate_tb": (rf"{START}{NUM}(?:\s*/\s*{NUM})*\s?TB/s", 3),
    "flop_rate": (rf"{START}{NUM}(?:\s*/\s*{NUM})*\s?TFLOP/s", 0),
    "flop_rate_g": (rf"{START}{NUM}(?:\s*/\s*{NUM})*\s?GFLOP/s", -3),
    "percent": (rf"{START}{NUM}%", 0),
    "error": (rf"{START}\d\.\d+e[+-]?\d+(?![\w.])", 0),
}
# The bench file's kind each doc kind is looked up in.
BENCH_KIND = {"time_us": "time", "bytes_rate_tb": "bytes_rate", "flop_rate_g": "flop_rate"}


def figures(kind, text):
    """(number as written, value in the bench file's unit) for each figure of this kind in text, with its span."""
    pattern, power = FORMS[kind]
    for run in re.finditer(pattern, text):
        if kind == "error":
            written = run.group()
            # An error is relative (below 1): e+NN is a magnitude (2.5e30), and a bare mantissa (1e-4) a constant.
            if Decimal(written).adjusted() > 0:
                continue
            yield written, Decimal(written), run.span()
            continue
        for number in re.finditer(NUM, run.group()):
            written = number.group()
            # A speedup written without decimals (2x eager's, 16x fp32) is a contract or a spec's ratio: bench.py
            # prints three decimals, and a doc that quotes one keeps at least one.
            if kind == "speedup" and "." not in written:
                continue
            span = (run.start() + number.start(), run.start() + number.end())
            # scaleb keeps the doc's digits: 4.8 TB/s is 4.8E+3 GB/s, to the nearest 100 GB/s.
            yield written, Decimal(written).scaleb(power), span


@functools.lru_cache(maxsize=None)
def bench_values():
    """kind -> the bench files' figures of that kind, as Decimals with the digits they were printed with."""
    values = {kind: set() for kind in FORMS if kind not in BENCH_KIND}
    for name in BENCH_FILES:
        for line in (ROOT / name).read_text().splitlines():
            for kind in FORMS:
                values[BENCH_KIND.get(kind, kind)].update(value for _, value, _ in figures(kind, line))
            # Times are the table cells that are plain decimals (median ms, KB ms, train step ms ...).
            if line.startswith("|"):
                values["time"].update(Decimal(c.strip()) for c in line.split("|") if re.fullmatch(r"\s*\d+\.\d+\s*", c))
    return values


@functools.lru_cache(maxsize=None)
def bench_rounded(kind, exponent):
    """The bench figures of a kind rounded half-up to 10**exponent, from those printed with at least that many
    digits (a doc may round a bench figure, never add digits to it). Decimal, so 3.645 rounds to 3.65."""
    step = Decimal(1).scaleb(exponent)
    return {
        value.quantize(step, rounding=ROUND_HALF_UP)
        for value in bench_values()[kind]
        if value.as_tuple().exponent <= exponent
    }


def in_bench(kind, value):
    return value in bench_rounded(BENCH_KIND.get(kind, kind), value.as_tuple().exponent)


def unfound_figures(name, text):
    """'file:line: figure (kind)' for each measured figure of text that no bench file holds."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        allowed = [
            (m.start(), m.end()) for snippet in ALLOWLIST for m in re.finditer(re.escape(snippet), line)
        ]
        for kind in FORMS:
            for written, value, (start, end) in figures(kind, line):
                if any(a <= start and end <= b for a, b in allowed):
                    continue
                if not in_bench(kind, value):
                    problems.append(f"{name}:{number}: {written} ({kind}) is in neither {' nor '.join(BENCH_FILES)}")
    return problems


def doc_files():
    bench = {ROOT / name for name in BENCH_FILES}
    return [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").glob("*.md")) if p not in bench]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_figures_are_bench_figures(path):
    problems = unfound_figures(str(path.relative_to(ROOT)), path.read_text())
    assert not problems, "figures not from the bench files (quote bench.md's, or link to it):\n" + "\n".join(problems)


def test_allowlist_entries_are_used():
    # An entry whose text left the docs would silently allow that text back.
    text = "\n".join(p.read_text() for p in doc_files())
    assert [s for s in ALLOWLIST if s not in text] == []


# The checker itself: a made-up figure is reported with its file and line, a rounded bench figure is not, and
# numbers that are not measurements are not figures.
@pytest.mark.parametrize(
    "line, reported",
    [
        ("runs at 9.87x eager", "9.87"),
        ("an fp32 training step in 9.31 ms", "9.31"),
        ("takes 0.5807 / 0.7353 ms", "0.7353"),
        ("about 1 us more per call", "1"),
        ("error 5.85e-7 against eager's", "5.85e-7"),
        ("at 92.7% of three products", "92.7%"),
        ("on the H200 (4.9 TB/s)", "4.9"),
        ("4.39x: bench_level1_2.md's 4.395x rounds half-up to 4.40, not as round(4.395, 2) does", "4.39"),
        ("an error of 6.1e-7", "6.1e-7"),
        ("a floor near 2.5e-7 whatever K is (allowlisted)", None),
        ("7.1660e-5 (more digits than the bench prints)", "7.1660e-5"),
        ("3.88x (1.00x), 3.77x, 5.50e-7 (3.29e-6), 92.5%, 0.5807 ms, 100% of a copy, 3014.9 GB/s", None),
        ("3.0 TB/s, 0.69 TFLOP/s, 9 us a call, 0.58 / 0.73 ms", None),
        ("4.3-4.9x from 256 to 8192 rows, 3.7x at 16384 x 4096 -> 1024", None),
        ("1024x8192 -> 8192, K >= 512, 2^20 outputs, atol 1e-4, 2.5e30, torch 2.11.0, 723 passed, 2x eager's", None),
    ],
)
def test_checker(line, reported):
    problems = unfound_figures("docs/x.md", "first line\n" + line)
    if reported is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(f"docs/x.md:2: {reported.rstrip('%')}"), problems
