"""The library's functions, one import for all families; importing this module builds (first time) and loads the
op library `torch.ops.kernels`."""

from kernels.attention.attention import attention
from kernels.causal_softmax.causal_softmax import causal_softmax
from kernels.gelu_tanh.gelu_tanh import gelu_tanh
from kernels.gemm.gemm import gemm_gelu, gemm_multiply_leaky_relu, linear
from kernels.layer_norm.layer_norm import add_layer_norm, layer_norm
from kernels.leaky_relu.leaky_relu import leaky_relu
from kernels.rms_norm.rms_norm import rms_norm
from kernels.rotary.rotary import rotary_embedding
from kernels.silu_mul.silu_mul import silu_mul

__all__ = ["add_layer_norm", "attention", "causal_softmax", "gelu_tanh", "gemm_gelu", "gemm_multiply_leaky_relu",
           "layer_norm", "leaky_relu", "linear", "rms_norm", "rotary_embedding", "silu_mul"]
