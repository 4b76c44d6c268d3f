"""bench.py's KernelBench rows (level 3 and --problem-file) on the CPU, at small sizes: the harness's trials, the rows
and their table and legend. The GPU runs themselves are bench.py's job; this keeps their code running in CI."""

import types

import pytest

import bench

PROBLEM = '''
import torch
import torch.nn as nn

class Model(nn.Module):
    """An MLP whose docstring says "Forward pass"."""
    def __init__(self, features, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, features))

    def forward(self, x):
        return self.net(x)

def get_inputs():
    return [torch.rand(8, 32)]

def get_init_inputs():
    return [32, 48]
'''

BROKEN = PROBLEM.replace("return self.net(x)", "return self.net(x.unsqueeze(0).t())")
UNREADABLE = PROBLEM.replace("import torch.nn as nn", "import a_module_no_one_has")  # fails when the file runs


def options():
    return bench.Options(types.SimpleNamespace(variant=None, dtype=None, size=None, quick=True))


def test_problem_files_give_eager_and_model_new_rows_with_the_trials(tmp_path):
    (tmp_path / "2_small_mlp.py").write_text(PROBLEM)
    (tmp_path / "10_broken.py").write_text(BROKEN)  # raises in forward: a row saying so, the others still run
    (tmp_path / "11_unreadable.py").write_text(UNREADABLE)  # raises when the file runs: the same
    rows = []
    bench.bench_problem_files(rows, options(), [str(tmp_path)])
    by_case = {}
    for row in rows:
        by_case.setdefault(row["case"], {})[row["variant"]] = row
    assert list(by_case) == ["2_small_mlp", "10_broken", "11_unreadable"]  # KernelBench's order: by number
    assert by_case["11_unreadable"]["ModelNew"]["verdict"] == "ModuleNotFoundError"
    small = by_case["2_small_mlp"]
    assert set(small) == {"eager", "ModelNew"}
    assert small["ModelNew"]["verdict"] == f"{bench.KERNELBENCH_TRIALS}/{bench.KERNELBENCH_TRIALS}"
    assert small["ModelNew"]["error"] is not None and small["ModelNew"]["error"] < 1e-6
    assert small["eager"]["speedup"] == pytest.approx(1.0)
    assert by_case["10_broken"]["ModelNew"]["verdict"] == "RuntimeError"
    text = bench.tables_text(rows)
    assert "2_small_mlp" in text and "5/5" in text
    assert any(line.startswith("KernelBench rows") for line in bench.legend(rows))


def test_level3_problem_rows_include_torch_compile_where_asked(monkeypatch):
    """The rows of a reference.py problem (at a small size here): eager, torch.compile where --variant asks for it
    (the default asks for all), and ModelNew."""
    import reference

    spec = reference.PROBLEMS["mlp"]
    small = reference.Problem("mlp", spec.kernelbench, spec.model, lambda: [__import__("torch").rand(4, 32)],
                              lambda: [32, [48], 16])
    monkeypatch.setitem(reference.PROBLEMS, "mlp", small)
    rows = []
    opts = bench.Options(types.SimpleNamespace(variant=["ModelNew"], dtype=None, size=None, quick=True))
    bench.bench_level3_problem("mlp")(rows, opts)
    assert [row["variant"] for row in rows] == ["eager", "ModelNew"]
    assert rows[1]["verdict"] == f"{bench.KERNELBENCH_TRIALS}/{bench.KERNELBENCH_TRIALS}"


def test_model_gemm_shapes_are_the_linear_layers_and_patchify_convolutions():
    # Patched norms, MLPs and attention layers are no GEMM of their own: only nn.Linear, Conv1D, the patchify
    # convolution (a row per output position) and sibling projections' one product give shapes, each once, in call
    # order.
    transformers = pytest.importorskip("transformers")
    import torch

    import kernels

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=100)
    torch.manual_seed(0)
    llama = kernels.patch(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 100, (2, 8))
    # q_proj (and k_proj, v_proj, o_proj: the same shape), then the three projections' one product while training
    assert bench._model_gemm_shapes(llama, {"input_ids": ids}) == [(16, 64, 64), (16, 64, 192), (16, 64, 96),
                                                                   (16, 96, 64), (16, 64, 100)]

    class Patches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Conv2d(3, 8, 4, stride=4)
            self.norm = torch.nn.LayerNorm(8)
            self.head = torch.nn.Linear(8, 5)

        def forward(self, x):
            return self.head(self.norm(self.proj(x).flatten(2).transpose(1, 2)))

    model = kernels.patch(Patches())
    assert bench._model_gemm_shapes(model, torch.randn(2, 3, 16, 12)) == [(24, 48, 8), (24, 8, 5)]

    # GPT-2's Conv1D layers (weights stored (in, out)): c_attn, c_proj, c_fc, the MLP's c_proj; the tied head.
    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=100, n_positions=16)
    gpt2 = kernels.patch(transformers.GPT2LMHeadModel(config))
    assert bench._model_gemm_shapes(gpt2, {"input_ids": ids}) == [(16, 64, 192), (16, 64, 64), (16, 64, 256),
                                                                  (16, 256, 64), (16, 64, 100)]
