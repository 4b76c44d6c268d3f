"""Fused CUDA kernels for PyTorch, compiled just in time: the op library `torch.ops.kernels`, one kernel family per
folder (kernels/manifest.py lists them).

    import kernels
    kernels.patch(model)                 # nn.Linear / Conv1D on the fp32-accurate fast GEMM; NewGELU in one kernel
    with kernels.fp32_gemm(): ...        # functional products (F.linear, matmul, @, mm, addmm, einsum) too
    from kernels.functional import leaky_relu, gemm_multiply_leaky_relu

Importing this package alone builds nothing (pure-Python helpers such as kernels.precision import without a
compiler); the first use of anything above builds the library (kernels/loader.py) and loads it.
"""

_LAZY = {"patch": "kernels.patching", "unpatch": "kernels.patching", "is_patched": "kernels.patching",
         "split_layer_names": "kernels.patching", "fused_layer_names": "kernels.patching",
         "fp32_gemm": "kernels.patching", "nn": "kernels.nn", "functional": "kernels.functional",
         "kept_split_budget": "kernels.gemm.gemm", "set_kept_split_budget": "kernels.gemm.gemm",
         "kept_split_bytes": "kernels.gemm.gemm", "clear_kept_splits": "kernels.gemm.gemm"}


def __getattr__(name):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(module_name)
    return module if module_name == f"kernels.{name}" else getattr(module, name)


__all__ = sorted(_LAZY)
