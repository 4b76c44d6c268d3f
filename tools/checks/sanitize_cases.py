"""Every CUDA kernel of the library once on small shapes, checked against eager: the sanitizer's cases, the smoke test.

Tails, views at an offset (the unaligned paths), every dtype, both GEMM paths, odd shapes; a kernel that the sanitizer
passes but that computes garbage still fails here. `python tools/device_check.py cases` runs it, `sanitize` under
compute-sanitizer, `build` as the smoke test.
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F

from kernels.functional import (add_layer_norm, attention, causal_softmax, gelu_tanh, gemm_gelu,
                                gemm_multiply_leaky_relu, layer_norm, leaky_relu, rms_norm, rotary_embedding,
                                silu_mul)
from kernels.gemm.gemm import STREAM_K, forced_gemm_path, forced_k_slices, gemm_paths


def check(name, got, expected, tol=1e-4):
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol, equal_nan=True,
                               msg=lambda message: f"{name}: {message}")


def elementwise_cases():
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        base = torch.randn(4099, device="cuda", dtype=dtype)
        for name, x in {"aligned": base[:4096], "tail": base, "offset": base[1:]}.items():
            check(f"leaky_relu {dtype} {name}", leaky_relu(x, -0.3), F.leaky_relu(x, -0.3))
            grad = torch.randn_like(x)
            check(f"leaky_relu_backward {dtype} {name}",
                  torch.ops.kernels.leaky_relu_backward(grad, x, -0.3, 2.0),
                  torch.where(x > 0, grad, grad * -0.3) * 2.0, tol=1e-2)
            y = x.clone()
            mask = torch.ops.kernels.multiply_leaky_relu_(y, -1.5, 0.2, True)
            check(f"multiply_leaky_relu_ {dtype} {name}", y, F.leaky_relu(x * -1.5, 0.2), tol=1e-2)
            assert torch.equal(mask, (x.float() * -1.5) > 0)
            # GELU (tanh): against F.gelu in float64, rounded to the dtype.
            x64 = x.double()
            check(f"gelu_tanh {dtype} {name}", gelu_tanh(x), F.gelu(x64, approximate="tanh").to(dtype), tol=1e-2)
            check(f"gelu_tanh_backward {dtype} {name}", torch.ops.kernels.gelu_tanh_backward(grad, x),
                  torch.ops.aten.gelu_backward(grad.double(), x64, approximate="tanh").to(dtype), tol=1e-2)


def gemm_cases():
    for path in gemm_paths("cuda"):
        # (300, 136, 20): tall and narrow, computed transposed on split_fp16 (the transposed epilogue's kernel).
        for m, k, n in [(1, 8, 7), (70, 136, 200), (129, 264, 136), (5, 1032, 9), (33, 72, 40), (300, 136, 20)]:
            x = torch.randn(m, k, device="cuda")
            if (m, k, n) in ((33, 72, 40), (300, 136, 20)):  # non-finite rows: the fix-up kernel
                x[3, 5], x[4, :], x[5, 9] = float("inf"), float("-inf"), float("nan")
            weight, bias = torch.randn(n, k, device="cuda") / k ** 0.5, torch.randn(n, device="cuda")
            with forced_gemm_path(path):
                y, mask = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, -2.0, -0.1, True)
                # The weight's split made ahead (gemm_weight_split; [] where the path takes none): the kernels
                # that read it.
                split = torch.ops.kernels.gemm_weight_split(x, weight)
                y_split, _ = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, -2.0, -0.1, True, split)
                # The GELUs in the epilogue (w's split made ahead on split_fp16; the transposed epilogue's at
                # 300 x 136 -> 20; plain stores where n % 4 != 0).
                y_gelu = {a: torch.ops.kernels.gemm_gelu(x, weight, bias, a) for a in ("none", "tanh")}
            for approximate, got in y_gelu.items():
                check(f"gemm_gelu {approximate} {path} {m}x{k}->{n}", got,
                      F.gelu(F.linear(x, weight, bias), approximate=approximate))
            pre = F.linear(x, weight, bias) * -2.0
            check(f"gemm {path} {m}x{k}->{n}", y, F.leaky_relu(pre, -0.1))
            assert torch.equal(y_split.view(torch.int32), y.view(torch.int32)), f"gemm {path} with the weight's split"
            assert bool(((mask == (pre > 0)) | (pre.abs() < 1e-4)).all()), f"gemm {path} mask"
        # A GELU where K is split (the sum applies it), and on a transposed weight view.
        x = torch.randn(64, 3072, device="cuda")
        weight, bias = torch.randn(136, 3072, device="cuda") / 3072 ** 0.5, torch.randn(136, device="cuda")
        stored = torch.randn(136, 200, device="cuda") / 136 ** 0.5
        with forced_gemm_path(path):
            with forced_k_slices(3):
                y = torch.ops.kernels.gemm_gelu(x, weight, bias, "none")
            y_view = torch.ops.kernels.gemm_gelu(x[:, :136], stored.t(), None, "tanh")
        check(f"gemm_gelu {path} K split", y, F.gelu(F.linear(x, weight, bias)))
        # Stream-K (forced): 4 tiles over 48 chunks, each tile in a head part and block-1 shares of 1-2 chunks.
        x_wide = torch.randn(256, 3072, device="cuda")
        weight_wide = torch.randn(256, 3072, device="cuda") / 3072 ** 0.5
        with forced_gemm_path(path), forced_k_slices(STREAM_K):
            y_stream = torch.ops.kernels.gemm_gelu(x_wide, weight_wide, None, "none")
        check(f"gemm_gelu {path} stream-K", y_stream, F.gelu(F.linear(x_wide, weight_wide)))
        check(f"gemm_gelu {path} transposed weight", y_view, F.gelu(x[:, :136] @ stored, approximate="tanh"))
        # The backward's products (on the split path: w and x read transposed by the kernel), slope 1 so that no
        # branch flip can move a gradient.
        m, k, n = 132, 264, 72
        x = torch.randn(m, k, device="cuda", requires_grad=True)
        weight = (torch.randn(n, k, device="cuda") / k ** 0.5).requires_grad_(True)
        bias = torch.randn(n, device="cuda", requires_grad=True)
        grad = torch.randn(m, n, device="cuda")
        with forced_gemm_path(path):
            ours = torch.autograd.grad(gemm_multiply_leaky_relu(x, weight, bias, -2.0, 1.0), (x, weight, bias), grad)
        eager = torch.autograd.grad(F.linear(x, weight, bias) * -2.0, (x, weight, bias), grad)
        for name, got, expected in zip(("x", "weight", "bias"), ours, eager):
            check(f"gemm backward {path} grad {name}", got, expected)
        # gemm_gelu while training, both forms: the GELU's gradient made by grad_x's row split; at 300 x 136 -> 200
        # (not computed transposed) the Hopper kernel writes the GELU's input beside y from its epilogue.
        m, k, n = 300, 136, 200
        x_gelu = torch.randn(m, k, device="cuda", requires_grad=True)
        weight_gelu = (torch.randn(n, k, device="cuda") / k ** 0.5).requires_grad_(True)
        bias_gelu = torch.randn(n, device="cuda", requires_grad=True)
        grad_gelu = torch.randn(m, n, device="cuda")
        for approximate in ("none", "tanh"):
            for inputs, g in (((x, weight, bias), grad), ((x_gelu, weight_gelu, bias_gelu), grad_gelu)):
                with forced_gemm_path(path):
                    ours = torch.autograd.grad(gemm_gelu(*inputs, approximate), inputs, g)
                eager = torch.autograd.grad(F.gelu(F.linear(*inputs), approximate=approximate), inputs, g)
                for name, got, expected in zip(("x", "weight", "bias"), ours, eager):
                    check(f"gemm_gelu backward {approximate} {path} {inputs[0].shape[0]} rows grad {name}", got,
                          expected)
        # Plain products (the identity epilogue), forward and backward: grad_W over a long reduction (split into
        # slices of K), a reduction of odd length (grad_y's rows not 16-byte aligned), a transposed weight view.
        for m, k, n, transposed in ((2048, 256, 256, False), (136, 96, 1001, False), (136, 128, 200, True)):
            x = torch.randn(m, k, device="cuda", requires_grad=True)
            stored = (torch.randn(k, n, device="cuda") if transposed else torch.randn(n, k, device="cuda")) / k ** 0.5
            stored.requires_grad_(True)
            weight = stored.t() if transposed else stored
            grad = torch.randn(m, n, device="cuda")
            with forced_gemm_path(path):
                y = gemm_multiply_leaky_relu(x, weight, None, 1.0, 1.0)
                ours = (y, *torch.autograd.grad(y, (x, stored), grad))
            y_eager = F.linear(x, weight)
            eager = (y_eager, *torch.autograd.grad(y_eager, (x, stored), grad))
            for name, got, expected in zip(("y", "grad x", "grad weight"), ours, eager):
                check(f"gemm plain {path} {m}x{k}->{n}{' transposed' if transposed else ''} {name}", got, expected,
                      tol=1e-3)
    # grad_W's column split where the staged kernel takes it (a round of items of its resident grid at least: 4096 x
    # 640 on a GPU of up to 160 multiprocessors), with a non-finite value: the kernel that reads twice, bit for bit.
    src = torch.randn(4096, 640, device="cuda")
    src[100, 7] = float("inf")
    staged = torch.ops.kernels._gemm_split_sweep(src, "columns")
    for name, got, expected in zip(("hi", "lo", "exponent", "sums"), staged,
                                   torch.ops.kernels._gemm_split_sweep(src, "columns_read_twice")):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), f"column split staged: {name}"


def causal_softmax_cases():
    # Every configuration: a warp per row (packs, single elements), a block per row, streamed long rows; more keys
    # than queries, more queries than keys (all-masked rows: NaN), a view at an offset (single elements).
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape in [(3, 1, 1), (2, 37, 37), (2, 16, 64), (2, 40, 17), (1, 5, 1500), (1, 5, 1501), (1, 3, 9000),
                      (1, 3, 9001)]:
            base = torch.randn(math.prod(shape) + 1, device="cuda", dtype=dtype)
            for name, scores in {"aligned": base[:-1].view(shape), "offset": base[1:].view(shape)}.items():
                rows, columns = shape[-2:]
                masked = torch.ones(rows, columns, dtype=torch.bool, device="cuda").triu(columns - rows + 1)
                eager = torch.softmax((scores.float() * 0.3).masked_fill(masked, float("-inf")), dim=-1)
                y = causal_softmax(scores, 0.3)
                check(f"causal_softmax {dtype} {shape} {name}", y, eager, tol=1e-2)
                grad = torch.randn_like(scores)
                g32, y32 = grad.float().masked_fill(masked, 0), y.float().masked_fill(masked, 0)
                expected = 0.3 * y32 * (g32 - (g32 * y32).sum(-1, keepdim=True))
                check(f"causal_softmax_backward {dtype} {shape} {name}",
                      torch.ops.kernels.causal_softmax_backward(grad, y, 0.3), expected, tol=1e-2)


def row_norm_cases():
    # LayerNorm and RMSNorm, forward and backward: rows to a group of threads (256 columns) and to the block (4096),
    # more rows than the backward's blocks take at once (its staged next rows), 16-byte packs and single elements (13
    # columns, a view at an offset), each dtype; against eager's formulas in float64.
    for dtype in (torch.float32, torch.bfloat16):
        for rows, columns in [(1200, 256), (300, 4096), (50, 13)]:
            base = torch.randn(rows * columns + 1, device="cuda", dtype=dtype)
            weight = torch.randn(columns, device="cuda", dtype=dtype) * 0.5 + 1
            bias = torch.randn(columns, device="cuda", dtype=dtype) * 0.5
            grad = torch.randn(rows, columns, device="cuda", dtype=dtype)
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            for name, x in {"aligned": base[:-1].view(rows, columns), "offset": base[1:].view(rows, columns)}.items():
                label = f"{dtype} {rows}x{columns} {name}"
                x64, w64, b64 = (t.double().requires_grad_(True) for t in (x, weight, bias))
                y64 = F.layer_norm(x64, (columns,), w64, b64, 1e-5)
                check(f"layer_norm {label}", layer_norm(x, weight, bias, 1e-5), y64, tol=tol)
                ours = torch.ops.kernels.layer_norm_backward(grad, x, weight, 1e-5)
                eager = torch.autograd.grad(y64, (x64, w64, b64), grad.double())
                for part, got, expected in zip(("grad x", "grad weight", "grad bias"), ours, eager):
                    check(f"layer_norm_backward {label} {part}", got, expected, tol=tol * max(1, rows / 100))
                # The residual forms: add_layer_norm (x plus a residual, then the norm) and the backward that adds
                # the sum's own gradient to grad_x (its third staged row).
                residual = grad.flip(0)
                total, y = add_layer_norm(x, residual, weight, bias, 1e-5)
                check(f"add_layer_norm {label} sum", total, x.double() + residual.double(), tol=tol)
                check(f"add_layer_norm {label}", y, F.layer_norm(total.double(), (columns,), w64, b64, 1e-5), tol=tol)
                ours = torch.ops.kernels.layer_norm_backward(grad, x, weight, 1e-5, residual)
                check(f"layer_norm_backward {label} grad x + residual", ours[0], eager[0] + residual.double(),
                      tol=tol * max(1, rows / 100))
                x64, w64 = (t.double().requires_grad_(True) for t in (x, weight))
                y64 = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
                check(f"rms_norm {label}", rms_norm(x, weight, 1e-6), y64, tol=tol)
                ours = torch.ops.kernels.rms_norm_backward(grad, x, weight, 1e-6)
                eager = torch.autograd.grad(y64, (x64, w64), grad.double())
                for part, got, expected in zip(("grad x", "grad weight"), ours, eager):
                    check(f"rms_norm_backward {label} {part}", got, expected, tol=tol * max(1, rows / 100))


def silu_mul_cases():
    # The SwiGLU gate, forward and backward: whole packs, a tail, a view at an offset (single elements), each dtype.
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        base = torch.randn(2, 4099, device="cuda", dtype=dtype) * 3
        for name, (gate, up) in {"aligned": (base[0, :4096], base[1, :4096]), "tail": (base[0], base[1]),
                                 "offset": (base[0, 1:], base[1, 1:])}.items():
            tol = 1e-4 if dtype == torch.float32 else 1e-2
            gate64, up64 = (t.double().requires_grad_(True) for t in (gate, up))
            y64 = F.silu(gate64) * up64
            check(f"silu_mul {dtype} {name}", silu_mul(gate, up), y64, tol=tol)
            grad = torch.randn_like(gate)
            eager = torch.autograd.grad(y64, (gate64, up64), grad.double())
            for part, got, expected in zip(("grad gate", "grad up"), torch.ops.kernels.silu_mul_backward(grad, gate, up),
                                           eager):
                check(f"silu_mul_backward {dtype} {name} {part}", got, expected, tol=tol)


def rotary_cases():
    # The rotary embedding, forward and backward, on the packed kernel and the generic one forced: q as the projections'
    # transposed view, fewer kv heads, angles of one batch, each dtype; a head dim of 80 (idle lanes in the packed
    # kernel's passes) in float32. Against the formula in float64.
    previous = torch.ops.kernels._rotary_force_generic(False)
    try:
        for generic in (False, True):
            torch.ops.kernels._rotary_force_generic(generic)
            kernel = "generic" if generic else "packed"
            for dtype, dim in ((torch.float32, 64), (torch.float16, 64), (torch.bfloat16, 64), (torch.float32, 80)):
                half = dim // 2
                q = torch.randn(2, 33, 4, dim, device="cuda", dtype=dtype).transpose(1, 2)
                k = torch.randn(2, 2, 33, dim, device="cuda", dtype=dtype)
                cos, sin = (torch.randn(1, 33, dim, device="cuda", dtype=dtype) for _ in range(2))
                tol = 1e-4 if dtype == torch.float32 else 1e-2
                leaves = [t.double().requires_grad_(True) for t in (q, k)]
                c64, s64 = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
                exact = [x * c64 + torch.cat((-x[..., half:], x[..., :half]), -1) * s64 for x in leaves]
                label = f"{kernel} {dtype} head dim {dim}"
                for part, got, expected in zip(("q", "k"), rotary_embedding(q, k, cos, sin), exact):
                    check(f"rotary_embedding {label} {part}", got, expected, tol=tol)
                grads = [torch.randn(t.shape, device="cuda", dtype=dtype) for t in (q, k)]
                ours = torch.ops.kernels.rotary_embedding_backward(*grads, cos, sin)
                for part, got, expected in zip(("grad q", "grad k"), ours,
                                               torch.autograd.grad(exact, leaves, [g.double() for g in grads])):
                    check(f"rotary_embedding_backward {label} {part}", got, expected, tol=tol)
    finally:
        torch.ops.kernels._rotary_force_generic(previous)


def attention_cases():
    # The split attention (head dim 64, float32): rows and keys off the tile (padding), causal or not, fewer key and
    # value heads than query heads, and the plain kernel forced; its gradients through autograd. Against float64.
    previous = torch.ops.kernels._attention_force_plain(False)
    for plain in (False, True):
        torch.ops.kernels._attention_force_plain(plain)
        for heads, kv_heads, rows, keys, causal in [(4, 4, 100, 100, True), (4, 2, 70, 130, False), (2, 1, 64, 64, True)]:
            query = torch.randn(2, heads, rows, 64, device="cuda", requires_grad=True)
            key, value = (torch.randn(2, kv_heads, keys, 64, device="cuda", requires_grad=True) for _ in range(2))
            y = attention(query, key, value, is_causal=causal)
            expanded = [t.double().repeat_interleave(heads // kv_heads, dim=1) for t in (key, value)]
            y64 = F.scaled_dot_product_attention(query.double(), *expanded, is_causal=causal)
            label = f"attention {'plain' if plain else 'split'} {heads}/{kv_heads} heads {rows}x{keys}"
            check(label, y, y64)
            grad = torch.randn_like(y)
            ours = torch.autograd.grad(y, (query, key, value), grad)
            exact = torch.autograd.grad(y64, (query, key, value), grad.double())
            for part, got, expected in zip(("grad query", "grad key", "grad value"), ours, exact):
                check(f"{label} {part}", got, expected, tol=1e-3)
    torch.ops.kernels._attention_force_plain(previous)


CASES = {"elementwise": elementwise_cases, "gemm": gemm_cases, "causal_softmax": causal_softmax_cases,
         "row_norm": row_norm_cases, "silu_mul": silu_mul_cases, "rotary": rotary_cases, "attention": attention_cases}


if __name__ == "__main__":
    # Arguments: the groups of cases to run (default: all).
    unknown = [name for name in sys.argv[1:] if name not in CASES]
    if unknown:
        sys.exit(f"sanitize_cases: unknown case groups {unknown}; the groups: {', '.join(CASES)}")
    for name in sys.argv[1:] or CASES:
        CASES[name]()
    torch.cuda.synchronize()
    print(f"sanitize_cases: {', '.join(sys.argv[1:]) or 'every kernel'} ran and matched eager "
          f"(GEMM paths: {', '.join(gemm_paths('cuda'))})")
