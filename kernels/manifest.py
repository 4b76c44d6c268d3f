"""The op library's sources: one entry per kernel family, in build and load order.

A family is one folder, kernels/<name>/, and the same stem in every layer: <name>.cu (kernels, no torch headers),
<name>.h (their plain host launchers), <name>_cpu_loops.cpp and .h where the family has CPU loops of its own (plain
functions over raw pointers, with ATen's vector and parallel headers only), <name>.cpp (the torch side: schemas,
checks, the dispatch to the CPU loops and the CUDA launchers),
<name>_autograd.cpp (the ops' Autograd kernels and graph nodes), <name>_op.h (the ops' dispatcher handles, where C++
code of this or another family calls them), <name>.py (fake implementations, the Python functions), NOTES.md, and
tests/test_<name>.py. Project headers included with #include "x.h" are inlined by the loader (kernels/loader.py), so
only the files listed here are named; the order of each list is the order in which the files are joined into one
translation unit.

Where the machine has a CPU for each unit (kernels/loader.py, library_builds), a family builds as up to three
libraries: its ops (the C++ and CUDA units), its autograd (a C++ unit of its own, which reaches the ops through the
dispatcher only) and its CPU loops (a C++ unit of plain functions, whose table the loader hands to the op library),
whose units compile at the same time: parsing the autograd headers costs as much as a unit's own code, the loops'
code generation about a third of the op unit's time, and a cold build takes as long as its slowest unit. Elsewhere its
CPU loop files are joined before its C++ files, and its autograd files after them.

This is data only (no torch import), so tools that read the sources need not build anything.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    cpp_sources: tuple  # paths under kernels/, joined into the family's C++ translation unit
    cuda_sources: tuple  # paths under kernels/, joined into its CUDA translation unit (built where a GPU is)
    python_module: str  # registers fakes and batching rules; imported once the family's libraries are loaded
    requires: tuple = ()  # the families whose ops this one's C++ calls (listed before it here)
    autograd_sources: tuple = ()  # paths under kernels/, joined into the C++ unit of the family's autograd library
    # Paths under kernels/: the family's CPU loops, joined into the C++ unit of a library of their own, which exports
    # kernels_<name>_cpu_loops() (their table) for the op library's kernels_<name>_bind_cpu_loops().
    cpu_loop_sources: tuple = ()


FAMILIES = (
    Family(
        name="leaky_relu",
        cpp_sources=("leaky_relu/leaky_relu.cpp",),
        cuda_sources=("leaky_relu/leaky_relu.cu",),
        python_module="kernels.leaky_relu.leaky_relu",
        autograd_sources=("leaky_relu/leaky_relu_autograd.cpp",),
        cpu_loop_sources=("leaky_relu/leaky_relu_cpu_loops.cpp",),
    ),
    Family(
        name="gemm",
        cpp_sources=("gemm/gemm_cublas_bf16x9.cpp", "gemm/gemm.cpp"),
        cuda_sources=("gemm/gemm_split.cu", "gemm/gemm_sm90.cu", "gemm/gemm_sm80.cu"),
        python_module="kernels.gemm.gemm",
        requires=("leaky_relu",),  # its cuBLAS path's epilogue and its backward are LeakyReLU ops
        autograd_sources=("gemm/gemm_autograd.cpp",),
    ),
    Family(
        name="gelu_tanh",
        cpp_sources=("gelu_tanh/gelu_tanh.cpp",),  # its CPU loop too: a plain loop over gelu_tanh_math.h's formula
        cuda_sources=("gelu_tanh/gelu_tanh.cu",),
        python_module="kernels.gelu_tanh.gelu_tanh",
        autograd_sources=("gelu_tanh/gelu_tanh_autograd.cpp",),
    ),
    Family(
        name="causal_softmax",
        cpp_sources=("causal_softmax/causal_softmax.cpp",),
        cuda_sources=("causal_softmax/causal_softmax.cu",),
        python_module="kernels.causal_softmax.causal_softmax",
        autograd_sources=("causal_softmax/causal_softmax_autograd.cpp",),
    ),
)


def with_requirements(*names):
    """The families that the families `names` need, themselves included, in the manifest's order."""
    by_name = {family.name: family for family in FAMILIES}
    needed, pending = set(), list(names)
    while pending:
        family = by_name[pending.pop()]
        if family.name not in needed:
            needed.add(family.name)
            pending.extend(family.requires)
    return tuple(family for family in FAMILIES if family.name in needed)
