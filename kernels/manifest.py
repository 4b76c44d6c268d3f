"""The op library's sources: one entry per kernel family, in build and load order. Data only (no torch import).

A family is a folder, kernels/<name>/, with one stem per layer: <name>.cu (kernels, no torch headers), <name>.h (host
launchers), <name>_cpu_loops.cpp/.h (plain CPU loops over raw pointers), <name>.cpp (schemas, checks, dispatch),
<name>_autograd.cpp, <name>_op.h (dispatcher handles for C++ callers), <name>.py (fakes, Python functions), NOTES.md,
tests/test_<name>.py. A family's C++ files are joined into one translation unit (CPU loops, then the torch side, then
autograd), its .cu files into another: with CUDA one library a family; CPU-only the families with CPU loops make one
library and the others another (kernels/loader.py). Project headers are inlined by the loader, so only these files
are named.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    cpp_sources: tuple  # paths under kernels/: the torch side, in the C++ unit's join order
    cuda_sources: tuple  # paths under kernels/, joined into its CUDA translation unit (built where a GPU is)
    python_module: str  # registers fakes and batching rules; imported once the family's library is loaded
    requires: tuple = ()  # the families whose ops this one's C++ calls (listed before it here)
    autograd_sources: tuple = ()  # paths under kernels/, joined after cpp_sources
    cpu_loop_sources: tuple = ()  # paths under kernels/, joined before cpp_sources; their unit builds at -O3

    @property
    def cpp_unit(self):
        """The paths of the family's C++ translation unit, in join order."""
        return (*self.cpu_loop_sources, *self.cpp_sources, *self.autograd_sources)


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
        name="gelu_tanh",
        cpp_sources=("gelu_tanh/gelu_tanh.cpp",),  # its CPU loop too: a plain loop over gelu_tanh_math.h's formula
        cuda_sources=("gelu_tanh/gelu_tanh.cu",),
        python_module="kernels.gelu_tanh.gelu_tanh",
        autograd_sources=("gelu_tanh/gelu_tanh_autograd.cpp",),
    ),
    Family(
        name="gemm",
        cpp_sources=("gemm/gemm_cublas_bf16x9.cpp", "gemm/gemm_path.cpp", "gemm/gemm_products.cpp",
                     "gemm/gemm_weight_split.cpp", "gemm/gemm.cpp"),
        cuda_sources=("gemm/gemm_split.cu", "gemm/gemm_sm90.cu", "gemm/gemm_sm80.cu"),
        python_module="kernels.gemm.gemm",
        # its cuBLAS path's epilogue and its backward are LeakyReLU ops; gemm_gelu's activation off the split paths
        requires=("leaky_relu", "gelu_tanh"),
        autograd_sources=("gemm/gemm_autograd.cpp",),
    ),
    Family(
        name="causal_softmax",
        cpp_sources=("causal_softmax/causal_softmax.cpp",),
        cuda_sources=("causal_softmax/causal_softmax.cu",),
        python_module="kernels.causal_softmax.causal_softmax",
        autograd_sources=("causal_softmax/causal_softmax_autograd.cpp",),
    ),
    Family(
        name="rms_norm",
        cpp_sources=("rms_norm/rms_norm.cpp",),  # its CPU path too: ATen's ops on rms_norm_op.h's formulas
        cuda_sources=("rms_norm/rms_norm.cu",),
        python_module="kernels.rms_norm.rms_norm",
        autograd_sources=("rms_norm/rms_norm_autograd.cpp",),
    ),
    Family(
        name="layer_norm",
        cpp_sources=("layer_norm/layer_norm.cpp",),  # its CPU path too: ATen's ops on layer_norm_op.h's formulas
        cuda_sources=("layer_norm/layer_norm.cu",),
        python_module="kernels.layer_norm.layer_norm",
        requires=("gemm",),  # the leaving ops hand y's row split to gemm's _gemm_leave_row_split
        autograd_sources=("layer_norm/layer_norm_autograd.cpp",),
    ),
    Family(
        name="silu_mul",
        cpp_sources=("silu_mul/silu_mul.cpp",),  # its CPU path too: ATen's ops on silu_mul_op.h's formulas
        cuda_sources=("silu_mul/silu_mul.cu",),
        python_module="kernels.silu_mul.silu_mul",
        autograd_sources=("silu_mul/silu_mul_autograd.cpp",),
    ),
    Family(
        name="rotary",
        cpp_sources=("rotary/rotary.cpp",),  # its CPU path too: ATen's ops on rotary_op.h's formulas
        cuda_sources=("rotary/rotary.cu",),
        python_module="kernels.rotary.rotary",
        autograd_sources=("rotary/rotary_autograd.cpp",),
    ),
    Family(
        name="attention",
        cpp_sources=("attention/attention.cpp",),  # its autograd is Python (attention.py): one formula, first order
        cuda_sources=("attention/attention.cu",),
        python_module="kernels.attention.attention",
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
