"""The reference problems, exactly as KernelBench defines them (current sizes), addressable by short name.

Each problem is a Model class, get_inputs() (CPU tensors, as the harness draws them) and get_init_inputs().
KernelBench's inputs come from torch.rand, which is never negative; tests and bench.py also draw randn.
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class LeakyReLUModel(nn.Module):
    """KernelBench level 1, problem 20: a LeakyReLU activation."""

    def __init__(self, negative_slope: float = 0.01):
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.leaky_relu(x, negative_slope=self.negative_slope)


class GemmMultiplyLeakyReLUModel(nn.Module):
    """KernelBench level 2, problem 12: Linear, then a multiply by a scalar, then LeakyReLU."""

    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.leaky_relu = nn.LeakyReLU(negative_slope)

    def forward(self, x):
        x = self.gemm(x)
        x = x * self.multiplier
        x = self.leaky_relu(x)
        return x


class MLPModel(nn.Module):
    """KernelBench level 3, problems 1 (MLP) and 2 (ShallowWideMLP): Linear layers with a ReLU after each hidden one."""

    def __init__(self, input_size, layer_sizes, output_size):
        super().__init__()
        layers = []
        current_input_size = input_size
        for layer_size in layer_sizes:
            layers.append(nn.Linear(current_input_size, layer_size))
            layers.append(nn.ReLU())
            current_input_size = layer_size
        layers.append(nn.Linear(current_input_size, output_size))
        self.network = nn.Sequential(*layers)

    def forward(self, x):
        return self.network(x)


class NewGELU(nn.Module):
    """GELU with the tanh approximation, written out as minGPT (and OpenAI GPT) does."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class CausalSelfAttention(nn.Module):
    """minGPT's masked multi-head self-attention: qkv in one Linear, the scores written with @, a causal mask from a
    buffer, softmax, then an output projection."""

    def __init__(self, n_embd, n_head, attn_pdrop, resid_pdrop, max_seqlen):
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(attn_pdrop)
        self.resid_dropout = nn.Dropout(resid_pdrop)
        self.register_buffer("bias", torch.tril(torch.ones(max_seqlen, max_seqlen)).view(1, 1, max_seqlen, max_seqlen))
        self.n_head = n_head
        self.n_embd = n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class MiniGPTBlockModel(nn.Module):
    """KernelBench level 3, problem 44: minGPT's transformer block (pre-LayerNorm attention and NewGELU MLP, each
    with a residual). `mlpf` is a lambda over the block's own `mlp`, as in the problem file."""

    def __init__(self, n_embd, n_head, attn_pdrop, resid_pdrop, max_seqlen):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, attn_pdrop, resid_pdrop, max_seqlen)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(n_embd, 4 * n_embd),
            c_proj=nn.Linear(4 * n_embd, n_embd),
            act=NewGELU(),
            dropout=nn.Dropout(resid_pdrop),
        ))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x


LEAKY_RELU_BATCH_SIZE = 4096
LEAKY_RELU_DIM = 393216  # 4096 x 393216 = 1,610,612,736 elements, 6.44 GB in float32

GEMM_BATCH_SIZE = 1024
GEMM_IN_FEATURES = 8192
GEMM_OUT_FEATURES = 8192
GEMM_MULTIPLIER = 2.0
GEMM_NEGATIVE_SLOPE = 0.1

MLP_BATCH_SIZE = 128
MLP_INPUT_SIZE = 16384
MLP_LAYER_SIZES = [16384, 16384]
MLP_OUTPUT_SIZE = 8192  # 2.5 GB of float32 weights

SHALLOW_WIDE_MLP_BATCH_SIZE = 128
SHALLOW_WIDE_MLP_INPUT_SIZE = 16384
SHALLOW_WIDE_MLP_LAYER_SIZES = [32768, 32768]
SHALLOW_WIDE_MLP_OUTPUT_SIZE = 16384  # 8.6 GB of float32 weights

MINI_GPT_BATCH_SIZE = 128
MINI_GPT_MAX_SEQLEN = 1024
MINI_GPT_SEQ_LEN = 512
MINI_GPT_N_EMBD = 768
MINI_GPT_N_HEAD = 8
MINI_GPT_ATTN_PDROP = 0.0
MINI_GPT_RESID_PDROP = 0.0


def leaky_relu_get_inputs():
    return [torch.rand(LEAKY_RELU_BATCH_SIZE, LEAKY_RELU_DIM)]


def leaky_relu_get_init_inputs():
    return []


def gemm_multiply_leaky_relu_get_inputs():
    return [torch.rand(GEMM_BATCH_SIZE, GEMM_IN_FEATURES)]


def gemm_multiply_leaky_relu_get_init_inputs():
    return [GEMM_IN_FEATURES, GEMM_OUT_FEATURES, GEMM_MULTIPLIER, GEMM_NEGATIVE_SLOPE]


def mlp_get_inputs():
    return [torch.rand(MLP_BATCH_SIZE, MLP_INPUT_SIZE)]


def mlp_get_init_inputs():
    return [MLP_INPUT_SIZE, MLP_LAYER_SIZES, MLP_OUTPUT_SIZE]


def shallow_wide_mlp_get_inputs():
    return [torch.rand(SHALLOW_WIDE_MLP_BATCH_SIZE, SHALLOW_WIDE_MLP_INPUT_SIZE)]


def shallow_wide_mlp_get_init_inputs():
    return [SHALLOW_WIDE_MLP_INPUT_SIZE, SHALLOW_WIDE_MLP_LAYER_SIZES, SHALLOW_WIDE_MLP_OUTPUT_SIZE]


def mini_gpt_block_get_inputs():
    return [torch.rand(MINI_GPT_BATCH_SIZE, MINI_GPT_SEQ_LEN, MINI_GPT_N_EMBD)]


def mini_gpt_block_get_init_inputs():
    return [MINI_GPT_N_EMBD, MINI_GPT_N_HEAD, MINI_GPT_ATTN_PDROP, MINI_GPT_RESID_PDROP, MINI_GPT_MAX_SEQLEN]


@dataclass(frozen=True)
class Problem:
    name: str
    kernelbench: str  # KernelBench's level and problem file, e.g. "level3/1_MLP"
    model: type
    get_inputs: Callable[[], list]
    get_init_inputs: Callable[[], list]


PROBLEMS = {problem.name: problem for problem in (
    Problem("leaky_relu", "level1/20_LeakyReLU", LeakyReLUModel, leaky_relu_get_inputs, leaky_relu_get_init_inputs),
    Problem("gemm_multiply_leaky_relu", "level2/12_Gemm_Multiply_LeakyReLU", GemmMultiplyLeakyReLUModel,
            gemm_multiply_leaky_relu_get_inputs, gemm_multiply_leaky_relu_get_init_inputs),
    Problem("mlp", "level3/1_MLP", MLPModel, mlp_get_inputs, mlp_get_init_inputs),
    Problem("shallow_wide_mlp", "level3/2_ShallowWideMLP", MLPModel, shallow_wide_mlp_get_inputs,
            shallow_wide_mlp_get_init_inputs),
    Problem("mini_gpt_block", "level3/44_MiniGPTBlock", MiniGPTBlockModel, mini_gpt_block_get_inputs,
            mini_gpt_block_get_init_inputs),
)}
