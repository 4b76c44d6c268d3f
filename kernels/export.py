"""Writes one self-contained KernelBench candidate per problem: a Python file with ModelNew, get_inputs and
get_init_inputs, and the problem's kernel families (kernels/manifest.py, with those they require) inlined and built
with load_inline when the file runs. Everything is generated from the library's own sources and reference.py.

    python -m kernels.export gemm_multiply_leaky_relu > candidate.py
    python -m kernels.export leaky_relu --check          # the static rules' verdict instead (exit 1 if it fails)
    python -m kernels.export --problem level3/1_MLP.py > candidate.py   # any KernelBench problem file

The file works exec'd from a string, in a process that has not imported `kernels`, and again in the same process
(registrations recorded in sys.modules). static_check() applies KernelBench's static rules (kernel_static_checker.py).
"""

import argparse
import ast
import collections
import contextlib
import inspect
import os
import random
import re
import sys
import textwrap

from kernels import checks, loader
from kernels.env import env_flag
from kernels.manifest import with_requirements

REPO_ROOT = os.path.dirname(loader.SOURCE_ROOT)

# The families each problem's ModelNew calls (with the families they require).
PROBLEM_FAMILIES = {"leaky_relu": ("leaky_relu",), "gemm_multiply_leaky_relu": ("gemm",), "mlp": ("gemm",),
                    "shallow_wide_mlp": ("gemm",), "mini_gpt_block": ("gemm", "gelu_tanh", "causal_softmax")}

# The functions of the loader the candidate runs to pick its build flags, and the fakes' checks (kernels/checks.py),
# copied from their own source.
_COPIED_FUNCTIONS = (env_flag, loader.with_cuda_build, loader.cuda_arch_flags, loader.build_flags,
                     checks.check_float_tensor, checks.check_same, checks.check_like_x,
                     checks.eps_value, loader.drain_autograd_at_exit)

_BUILD = '''
def _build_library():
    """Builds (once per content, cached like any load_inline build) and loads the op library `torch.ops.kernels`."""
    with_cuda = with_cuda_build()
    cflags, cuda_cflags, ldflags = build_flags(with_cuda)
    key = hashlib.sha256("\\0".join([CPP_SOURCE, CUDA_SOURCE if with_cuda else "", *cflags, *cuda_cflags, *ldflags,
                                     torch.__version__, str(torch.version.cuda), sys.version]).encode())
    name = f"kernels_candidate_{'cuda' if with_cuda else 'cpu'}_{key.hexdigest()[:16]}"
    # Where load_inline builds it (torch's own rule: a folder per Python and CUDA version unless TORCH_EXTENSIONS_DIR).
    build_dir = (cpp_extension._get_build_directory(name, False) if hasattr(cpp_extension, "_get_build_directory")
                 else os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root(),
                                   name))
    # A second library defining the op namespace would abort the process: refuse with a clear error instead.
    loaded = sys.modules.setdefault("kernels_candidate_libraries", types.ModuleType("kernels_candidate_libraries"))
    if name not in loaded.__dict__.setdefault("names", set()) and any(
            op.startswith("kernels::") for op in torch._C._dispatch_get_all_op_names()):
        raise RuntimeError("kernels candidate: this process already holds an op library `torch.ops.kernels` (the "
                           "kernels package, or another version of this library); run the candidate in a process "
                           "that has not loaded one")
    if not os.path.exists(os.path.join(build_dir, name + ".so")):  # a first build takes a while: say so
        print(f"kernels candidate: compiling the op library for {'CUDA' if with_cuda else 'the CPU'} into "
              f"{build_dir} (once per source version)", file=sys.stderr, flush=True)
    load_inline(
        name=name,
        cpp_sources=[CPP_SOURCE],
        cuda_sources=[CUDA_SOURCE] if with_cuda else None,
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_cflags,
        extra_ldflags=ldflags,
        with_cuda=with_cuda,
        is_python_module=False,
        no_implicit_headers=True,
    )
    loaded.names.add(name)


_build_library()
drain_autograd_at_exit()


def register_once(family_name, register):
    """Calls register() (a family's fakes and batching rules) once per process, also where this file is exec'd again:
    the record lives in sys.modules, which outlives an exec's namespace."""
    name = "kernels_candidate_registrations"
    record = sys.modules.setdefault(name, types.ModuleType(name))
    done = record.__dict__.setdefault("families", set())
    if family_name not in done:
        register()
        done.add(family_name)
'''


def _string_literal(text):
    """text as a Python literal: a raw triple-quoted string where that reads back exactly, else repr()."""
    if '"""' not in text and not text.endswith("\\"):
        return 'r"""' + text + '"""'
    return repr(text)


def _family_python(family):
    """The family's Python module, with its loader calls replaced by the candidate's own build."""
    path = os.path.join(REPO_ROOT, *family.python_module.split(".")) + ".py"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = text.replace("from kernels import loader\n", "")
    text = re.sub(r"^from kernels\.checks import [\w, ]+\n", "", text, flags=re.M)  # copied in with the loader's
    text = re.sub(r"^loader\.load_library\(\)\n", "", text, flags=re.M)
    text = re.sub(r'^loader\.register_once\(', "register_once(", text, flags=re.M)
    leftover = re.search(r"^.*\b(loader\.|from kernels|import kernels).*$", text, flags=re.M)
    if leftover:
        raise ValueError(f"{path}: the export cannot inline this line: {leftover.group(0)!r}; a family module uses "
                         "the loader only through loader.load_library() and loader.register_once(name, function)")
    return f"# ---- {family.python_module} " + "-" * max(0, 100 - len(family.python_module)) + "\n\n" + text


def _model_new_source(problem):
    """The source of the problem's ModelNew class in model_new.py (read, not imported: importing builds), renamed
    ModelNew, after model_new.py's imports other than the library's and the classes and functions of model_new.py it
    uses (to any depth), in file order."""
    path = os.path.join(REPO_ROOT, "model_new.py")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source)
    mapping = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "MODEL_NEW" for t in node.targets))
    class_name = next(v.id for k, v in zip(mapping.keys, mapping.values) if k.value == problem)
    definitions = {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    needed, pending = set(), [class_name]
    while pending:
        name = pending.pop()
        if name not in needed:
            needed.add(name)
            pending.extend(n.id for n in ast.walk(definitions[name]) if isinstance(n, ast.Name) and n.id in definitions)
    imports = [ast.get_source_segment(source, n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
               and not (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("kernels"))
               and not any(alias.name.startswith("kernels") for alias in getattr(n, "names", []))]
    texts = [ast.get_source_segment(source, node) for name, node in definitions.items() if name in needed]
    text = "\n".join(imports) + "\n\n\n" + "\n\n\n".join(texts)
    return re.sub(rf"^class {class_name}\(", "class ModelNew(", text, flags=re.M), class_name


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _problem_functions(problem):
    """get_inputs and get_init_inputs of reference.py's problem, with the constants they read."""
    import reference

    spec = reference.PROBLEMS[problem]
    lines, constants = [], {}
    for public_name, function in (("get_inputs", spec.get_inputs), ("get_init_inputs", spec.get_init_inputs)):
        for name in function.__code__.co_names:
            value = getattr(reference, name, None)
            if _is_number(value) or isinstance(value, list) and value and all(_is_number(v) for v in value):
                constants[name] = value
        lines.append(re.sub(r"^def \w+\(", f"def {public_name}(", inspect.getsource(function)))
    header = "".join(f"{name} = {value!r}\n" for name, value in constants.items())
    return header + "\n\n" + "\n\n".join(lines)


def _library_parts(families):
    """The parts of a candidate that build and load the op library: imports, the C++ and CUDA sources of `families`,
    the loader's build, and the families' Python modules."""
    cpp, cuda = loader.family_sources(families)
    return [
        "import atexit\nimport hashlib\nimport numbers\nimport os\nimport sys\nimport types\n\n"
        "import torch\nimport torch.nn as nn\nfrom torch.utils import cpp_extension\n"
        "from torch.utils.cpp_extension import load_inline\n",
        "CPP_SOURCE = " + _string_literal(cpp) + "\n",
        "CUDA_SOURCE = " + _string_literal(cuda) + "\n",
        "\n\n".join(inspect.getsource(f) for f in _COPIED_FUNCTIONS),
        _BUILD,
        *(_family_python(family) for family in families),
    ]


def _joined(parts):
    return "\n\n".join(part.rstrip("\n") + "\n" for part in parts)


def candidate_source(problem):
    """The text of the candidate file for `problem` (a key of reference.PROBLEMS)."""
    families = with_requirements(*PROBLEM_FAMILIES[problem])
    model_class, class_name = _model_new_source(problem)
    parts = [
        f'"""KernelBench candidate for {problem}: ModelNew (this library\'s {class_name}), get_inputs and '
        "get_init_inputs.\n\n"
        "Generated by `python -m kernels.export` from the kernels library; every kernel is inlined below and built "
        "with\nload_inline when this file runs. Precision contract: float32 results at least as accurate as eager "
        "PyTorch's\n(error against a float64 reference no larger than eager's; bench.py prints both).\n"
        '"""\n',
        *_library_parts(families),
        "# ---- the model " + "-" * 100 + "\n\n" + model_class + "\n",
        "# ---- the problem " + "-" * 98 + "\n\n" + _problem_functions(problem),
    ]
    return _joined(parts)


# ---- a candidate from any problem file ----------------------------------------------------------------------------

class _Cleaned(ast.NodeTransformer):
    """Drops docstrings, writes `pass` as `...` and a string or bytes the static rules' errors match ("pass", "except
    for") as a sum of pieces ("pa" + "ss"; inside an f-string, the match's first character as a replacement field,
    {112:c}ass): the same program, without the words KernelBench's static rules match in a problem's own text (a
    docstring saying "Forward pass")."""

    def _without_docstring(self, node):
        # Dropped before the visit, which would write a docstring saying "pass" as a sum of pieces.
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
                body[0].value.value, str):
            body = body[1:]
        node.body = body or [ast.Expr(ast.Constant(...))]
        return self.generic_visit(node)

    visit_Module = visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _without_docstring

    def visit_Pass(self, node):
        return ast.copy_location(ast.Expr(ast.Constant(...)), node)

    def visit_Constant(self, node):
        if isinstance(node.value, bytes):  # cut where its Latin-1 text would be
            pieces = _defused(node.value.decode("latin-1"))
            pieces = pieces and [piece.encode("latin-1") for piece in pieces]
        else:
            pieces = _defused(node.value) if isinstance(node.value, str) else None
        if pieces is None:
            return node
        total = ast.Constant(pieces[0])
        for piece in pieces[1:]:
            total = ast.BinOp(total, ast.Add(), ast.Constant(piece))
        return ast.copy_location(total, node)

    def visit_JoinedStr(self, node):
        values = []
        for value in node.values:  # an f-string's text parts: a match's first character as a replacement field
            if not isinstance(value, ast.Constant):
                values.append(self.visit(value))
                continue
            text, start = value.value, 0
            for cut in _match_starts(text):
                # {112:c} is "p": an integer and a format spec, so no quote, name or backslash enters the field
                values += [ast.Constant(text[start:cut]),
                           ast.FormattedValue(ast.Constant(ord(text[cut])), conversion=-1,
                                              format_spec=ast.JoinedStr([ast.Constant("c")]))]
                start = cut + 1
            values.append(ast.Constant(text[start:]))
        node.values = [v for v in values if not (isinstance(v, ast.Constant) and v.value == "")]
        return node

    def visit_MatchValue(self, node):  # a pattern takes constants only: left as it is
        return node


def _match_starts(text):
    """Where in text the static rules' errors match, in order."""
    return sorted({match.start() for patterns in STATIC_ERRORS.values() for pattern in patterns
                   for match in re.finditer(pattern, text)})


def _defused(text):
    """text cut in the middle of every match of the static rules' errors (pieces that join to text), or None where
    none matches."""
    cuts = [start + 1 for start in _match_starts(text)]
    if not cuts:
        return None
    bounds = [0, *cuts, len(text)]
    return [text[start:end] for start, end in zip(bounds, bounds[1:])]


def _top_level_bindings(tree):
    """{name: what the module's own statements bind it to}: the module path an import names ("torch.nn.functional"
    for `import torch.nn.functional as F` and `from torch.nn import functional as F` alike; a star import, each public
    name of the module, which is imported to list them), or "" for anything else (definitions, assignments of any
    form, for and with targets, walrus, except-as names, match captures, a function's `global` names), statements
    nested in if, for, while, with, try and match blocks included."""
    bindings = {}
    for node in ast.walk(tree):  # `global NAME` in a function binds NAME at the top level
        if isinstance(node, ast.Global):
            for name in node.names:
                bindings.setdefault(name, set()).add("")

    def bind(name, what):
        bindings.setdefault(name, set()).add(what)

    def bind_targets(target):
        for node in ast.walk(target) if target is not None else ():
            if isinstance(node, ast.Name):
                bind(node.id, "")

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(node.name, "")
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bind(alias.asname or alias.name.split(".")[0], alias.name if alias.asname else
                         alias.name.split(".")[0])
                continue
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name == "*":
                        for name in _public_names(node):
                            bind(name, f"{node.module}.{name}")
                    else:
                        bind(alias.asname or alias.name, f"{'.' * node.level}{node.module or ''}.{alias.name}")
                continue
            for field in ("targets", "target", "items"):
                value = getattr(node, field, None)
                for target in value if isinstance(value, list) else [value]:
                    bind_targets(target.optional_vars if isinstance(target, ast.withitem) else target)
            for child in ast.walk(node):
                if isinstance(child, ast.NamedExpr):
                    bind_targets(child.target)
            for field in ("body", "orelse", "finalbody"):
                visit(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                if handler.name:
                    bind(handler.name, "")
                visit(handler.body)
            for case in getattr(node, "cases", []):
                for pattern in ast.walk(case.pattern):
                    for name in (getattr(pattern, "name", None), getattr(pattern, "rest", None)):
                        if name:
                            bind(name, "")
                visit(case.body)

    visit(tree.body)
    return bindings


def _public_names(node):
    """The names `from module import *` binds: the module's __all__, else its names without a leading underscore."""
    if node.level:
        raise ValueError(f"a relative star import (from {'.' * node.level}{node.module or ''} import *) binds names "
                         "the export cannot list")
    import importlib

    module = importlib.import_module(node.module)
    return list(getattr(module, "__all__", [name for name in vars(module) if not name.startswith("_")]))


def _builtins_read(source):
    """The builtins (len, type, any...) that `source`'s functions and classes read: names no scope of it binds."""
    import builtins
    import symtable

    module = symtable.symtable(source, "<library>", "exec")
    read, pending = set(), [module]
    while pending:
        table = pending.pop()
        pending += table.get_children()
        read |= {symbol.get_name() for symbol in table.get_symbols()
                 if symbol.is_referenced() and not symbol.is_assigned() and not symbol.is_imported()
                 and (table.get_type() == "module" or symbol.is_global())}
    bound = {symbol.get_name() for symbol in module.get_symbols() if symbol.is_assigned() or symbol.is_imported()}
    return {name for name in read - bound if hasattr(builtins, name)}


# A family's Python module imported by name: `from kernels.<family>.<family> import ...`.
_FAMILY_IMPORT = re.compile(r"^from kernels\.(\w+)\.\1 import [^\n]+\n", flags=re.M)


def _patching_python():
    """(kernels/patching.py with its imports of the families' names dropped, the families it imports): the
    families' code goes above it."""
    path = os.path.join(REPO_ROOT, "kernels", "patching.py")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    families = tuple(match.group(1) for match in _FAMILY_IMPORT.finditer(text))
    text = _FAMILY_IMPORT.sub("", text)
    leftover = re.search(r"^.*\b(from kernels|import kernels).*$", text, flags=re.M)
    if leftover:
        raise ValueError(f"{path}: the export cannot inline this line: {leftover.group(0)!r}")
    return "# ---- kernels.patching " + "-" * 85 + "\n\n" + text, families


class ProblemPlan(collections.namedtuple("ProblemPlan", "layers functional_products trial", defaults=(None,))):
    """What a problem file's candidate applies: layers, the names of the Model's layers that ModelNew patches
    (kernels.split_layer_names and kernels.fused_layer_names at get_inputs()'s shapes), or None for every layer
    patch() knows; functional_products,
    whether the Model's forward makes products through functions that fp32_gemm() routes (matmul, @, mm, addmm, einsum,
    F.linear) at shapes where a split may pay (kernels.patching.functional_products_split), which ModelNew's forward
    then runs under fp32_gemm(); trial, what exact_output_trial found where it ran (None where nothing was routed)."""


# Without a GPU the trial runs on the CPU only within these: three forwards of a few seconds.
TRIAL_CPU_FLOPS = 2e11
TRIAL_CPU_BYTES = 4 << 30


def values_outside(outputs, expected):
    """(values of `outputs` outside KernelBench's check against `expected`, values compared): two lists of a model's
    output leaves (tensors, numbers; others skipped). Floating and complex values compare at the harness's
    tolerance, bool and integer ones (a comparison's, an argmax's) exactly; a leaf of another shape or dtype counts
    whole."""
    import torch

    from kernels.precision import ALLCLOSE_TOLERANCE

    harness = ALLCLOSE_TOLERANCE[torch.float32]  # KernelBench's check: atol = rtol = 1e-4
    tolerance = dict(atol=harness, rtol=harness, equal_nan=True)
    bad = total = 0
    for got, want in zip(outputs, expected):
        if not isinstance(got, (torch.Tensor, bool, int, float, complex)):
            continue
        got, want = torch.as_tensor(got), torch.as_tensor(want)
        total += got.numel()
        if got.shape != want.shape or got.dtype != want.dtype:
            bad += got.numel()
        elif got.is_floating_point() or got.is_complex():
            bad += int((~torch.isclose(want, got, **tolerance)).sum())
        else:
            bad += int((want != got).sum())
    return bad, total


def _exact_products():
    """A torch function mode that computes the products the library would take (those of fp32_gemm()'s routes, an
    nn.Linear's F.linear included, at shapes where a split may pay) in float64, rounded once to float32: the
    candidate's products without their own error. Everything else runs as it does in float32."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from kernels.patching import split_product_operands

    class ExactProducts(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            found = split_product_operands(func, args, kwargs)
            if found is None:
                return func(*args, **kwargs)
            x, weight, bias = found
            return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()

    return ExactProducts()


def exact_output_trial(model_class, init, get_inputs, flops, parameters):
    """Whether KernelBench's check accepts the problem's output with exact products: the Model's output with the
    products the library would take computed exactly (_exact_products) allclose to the float32 Model's at the
    harness's tolerance, on one draw of get_inputs() (no gradients, the Model's own mode, a GPU where there is one).
    Where it is not, eager's own rounding of those products exceeds that tolerance, and products more accurate than
    eager's fail the check as surely (KernelBench's 14_Gemm_Divide_Sum_Scaling: a sum over 8192 outputs of a product
    of K = 8192). The rest of the Model (convolutions, norms) runs in float32 on both sides, as in the candidate.
    Returns (verdict, why): verdict None where the trial did not run (no room on the CPU for `flops` and
    `parameters` elements, or the Model raised) or the Model's output changes from call to call. The caller keeps
    the random states."""
    import torch
    from torch.utils._pytree import tree_leaves

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and (flops > TRIAL_CPU_FLOPS or 12 * parameters > TRIAL_CPU_BYTES):
        return None, (f"not tried: no GPU here, and three forwards take {flops / 1e9:.0f} GFLOP each and about "
                      f"{12 * parameters / 2**30:.1f} GiB on the CPU")
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = model_class(*init)
        inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in get_inputs()]

        def run():  # each run on inputs of its own: a forward may write into its inputs
            return tree_leaves(model(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]))

        with torch.no_grad():
            outputs, again = run(), run()
            with _exact_products():
                exact = run()
    except Exception as e:  # noqa: BLE001  (no room for the Model, or it raised)
        return None, f"not tried: the Model raised {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    finally:
        model = None
        if device == "cuda":
            torch.cuda.empty_cache()
    if len(outputs) != len(again) or values_outside(outputs, again)[0]:  # dropout: no candidate matches it
        return None, "not judged: the Model's float32 output differs from call to call (random draws in its forward)"
    bad, total = values_outside(outputs, exact)
    if total == 0:
        return None, "not judged: the Model's output holds no tensor or number"
    if bad:
        return False, (f"with its products exact, the Model's output is outside KernelBench's tolerance (atol = rtol "
                       f"= 1e-4) of its float32 output at {bad} of {total} values: eager's own rounding exceeds "
                       "the check's tolerance, so products more accurate than eager's would fail it too: the "
                       "candidate leaves them to eager")
    return True, "tried: with its products exact, the Model's output is within KernelBench's tolerance of eager's"


def _forward_flops(model, inputs):
    """The floating-point operations of model(*inputs) that torch's FlopCounterMode counts (products, convolutions,
    attention): on the meta device, shapes only."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(*inputs)
    return counter.get_total_flops()


def problem_files(paths):
    """The .py files named, a folder's in KernelBench's order (by their number)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".py")]
            files += sorted(found, key=lambda f: (int(re.match(r"\d*", os.path.basename(f)).group(0) or 0), f))
        else:
            files.append(path)
    return files


def problem_plan(path, namespace=None):
    """The problem file's ProblemPlan, its Model run at get_inputs()'s shapes on the meta device (shapes only, no
    data). The Model is built there too, or, where its __init__ reads values (`.item()`), on the CPU and then moved
    there; the random states (torch's on the CPU and the GPUs, Python's, NumPy's) are left as they were. namespace: the
    file's globals where the caller has run it already (bench.py), else the file is run here. ProblemPlan(None,
    False) where the Model cannot run on the meta device (an op without a meta kernel, control flow on the data) or
    the file does not run here: every layer patched, each choosing per call, and no mode around the forward. Where
    the plan routes a product, exact_output_trial runs the Model for real (on a GPU where there is one); where eager's
    own rounding fails KernelBench's check, the plan routes nothing: ProblemPlan([], False, why). A plan of fused
    layers alone (element-wise ops, each rounded once) runs no trial."""
    import torch

    from kernels.patching import functional_products_split, fused_layer_names, split_layer_names

    code = None
    if namespace is None:
        namespace = {"__name__": "problem"}
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), path, "exec")
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")  # the problem's code may draw from NumPy's generator; restored if it was loaded
    numpy_state = numpy.random.get_state() if numpy is not None else None
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=gpus):
        try:  # any failure leaves every layer to patch()
            if code is not None:
                exec(code, namespace)
            model_class, init = namespace["Model"], namespace["get_init_inputs"]()
            with torch.device("meta"):
                inputs = namespace["get_inputs"]()
            try:
                with torch.device("meta"):
                    model = model_class(*init)
            except Exception:  # noqa: BLE001
                model = model_class(*init).to("meta")
            split = split_layer_names(model, *inputs)
            plan = ProblemPlan(sorted({*split, *fused_layer_names(model, *inputs)}),
                               functional_products_split(model, *inputs))
            if not split and not plan.functional_products:  # no product routed: nothing for the trial to try
                return plan
            parameters = sum(t.numel() for t in (*model.parameters(), *model.buffers()))
            verdict, why = exact_output_trial(model_class, init, namespace["get_inputs"],
                                              _forward_flops(model, inputs), parameters)
            # Where eager's own rounding fails the check, the candidate leaves every product to eager.
            return ProblemPlan([], False, why) if verdict is False else plan._replace(trial=why)
        except Exception:  # noqa: BLE001
            return ProblemPlan(None, False)
        finally:
            random.setstate(python_state)
            if numpy_state is not None:
                numpy.random.set_state(numpy_state)


def problem_model_new(model_class, plan):
    """The candidate's ModelNew for a Model class and its ProblemPlan, as a class (bench.py times it): the class the
    export writes out as text."""
    from kernels.patching import _patch_base, fp32_gemm, patch

    class ModelNew(model_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if plan.layers is None:
                patch(self)
            else:
                names = {name for name, module in self.named_modules(remove_duplicate=False) if _patch_base(module)}
                patch(self, layers=[name for name in plan.layers if name in names])

        if plan.functional_products:
            def forward(self, *args, **kwargs):
                with fp32_gemm():
                    return super().forward(*args, **kwargs)

    return ModelNew


def problem_file_candidate(path):
    """The text of a candidate for the KernelBench problem file at `path`: the problem's Model, get_inputs and
    get_init_inputs as the file defines them (docstrings dropped, `pass` as `...`), and ModelNew, the Model with the
    library applied (kernels.patch on the layers a split or a fused op takes at get_inputs()'s shapes,
    problem_plan: those run on the GEMM family's FusedLinear or the fused op; everything else runs as in the Model), built in the Model's own RNG order.
    A comment after its docstring carries the static rules' verdict."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    tree = _Cleaned().visit(tree)
    # `from __future__ import ...` must open the file: it goes right after the header, for the whole candidate.
    future = [node for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "__future__"]
    tree.body = [node for node in tree.body if node not in future] or [ast.Expr(ast.Constant(...))]
    future_imports = "".join(ast.unparse(node) + "\n" for node in future)
    problem = ast.unparse(ast.fix_missing_locations(tree))
    bindings = _top_level_bindings(ast.parse(problem))
    missing = {"Model", "get_inputs", "get_init_inputs"} - bindings.keys()
    if missing:
        raise ValueError(f"{path}: not a KernelBench problem file: it defines no {', '.join(sorted(missing))}")
    patching, families = _patching_python()
    library = [*_library_parts(with_requirements(*families)), patching]
    library_source = "\n\n".join(library)
    library_bindings = _top_level_bindings(ast.parse(library_source))
    # A problem that rebinds a builtin the library reads (`type = ...`, `from torch import *`'s any) changes it too.
    for name in _builtins_read(library_source):
        library_bindings.setdefault(name, set()).add(f"builtins.{name}")
    library_bindings.update(ModelNew={""}, PATCHED_LAYERS={""})  # the names the candidate adds to the problem's
    # A name both bind clashes unless both import the same module under it (torch, F).
    shared = (bindings.keys() - {"Model", "get_inputs", "get_init_inputs"}) & library_bindings.keys()
    clashes = sorted(name for name in shared
                     if len(bindings[name] | library_bindings[name]) > 1 or "" in bindings[name])
    if clashes:
        raise ValueError(f"{path}: the problem binds names the library's inlined code uses: {', '.join(clashes)}")
    plan = problem_plan(path)
    layers = plan.layers
    if layers is None:
        preamble = ""
        patching_lines = "        patch(self)  # the linear layers on the library's GEMM; no random numbers drawn\n"
    else:
        trial = "" if plan.trial is None else "".join(
            f"# {line}\n" for line in textwrap.wrap(f"At export, {plan.trial}.", 112))
        preamble = ("# The layers a split takes at get_inputs()'s shapes and those a fused op takes (split_layer_names\n"
                    "# and fused_layer_names, run at export on the meta device): the others gain nothing from the\n"
                    "# library there and stay PyTorch's.\n"
                    f"{trial}PATCHED_LAYERS = {layers!r}\n\n\n")
        patching_lines = ("        # other init inputs may name other layers: those patch() turns, of PATCHED_LAYERS\n"
                          "        names = {name for name, module in self.named_modules(remove_duplicate=False)\n"
                          "                 if _patch_base(module)}\n"
                          "        patch(self, layers=[name for name in PATCHED_LAYERS if name in names])  # draws no "
                          "random numbers\n")
    forward_lines = ("" if not plan.functional_products else
                     "\n    def forward(self, *args, **kwargs):\n"
                     "        # the Model's own products (matmul, @, mm, addmm, einsum, F.linear) split where it pays\n"
                     "        with fp32_gemm():\n"
                     "            return super().forward(*args, **kwargs)\n")
    model_new = (preamble + "class ModelNew(Model):\n    def __init__(self, *args, **kwargs):\n"
                 "        super().__init__(*args, **kwargs)\n" + patching_lines + forward_lines)
    # The candidate's header names the problem in word characters only (a name may hold a rule's words or quotes).
    name = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])

    def assemble(verdict):
        # The verdict in a comment, which the static rules do not read: it names the rules, whose words they match.
        header = (f'"""KernelBench candidate for {name}: the problem\'s Model, and ModelNew, the Model with the kernels '
                  "library applied\n(kernels.patch: its linear layers on the fp32-accurate split GEMM, inlined below and "
                  "built with load_inline\nwhen this file runs).\n\"\"\"\n" + future_imports + verdict)
        parts = [header, *library, "# ---- the problem " + "-" * 98 + "\n\n" + problem + "\n",
                 "# ---- the model " + "-" * 100 + "\n\n" + model_new]
        return _joined(parts)

    errors, warnings = static_check(assemble(""))
    verdict = (f"# KernelBench's static rules: {'FAILED' if errors else 'passed'}, {len(errors)} errors, "
               f"{len(warnings)} warnings ({'; '.join(rule for rule, _ in errors + warnings)}).\n")
    return assemble(verdict)


# ---- KernelBench's static rules -----------------------------------------------------------------------------------

# Errors: any of these rejects a candidate.
STATIC_ERRORS = {
    "try-except block": [r"\btry\s*:", r"\bexcept\s*:", r"\bexcept\s+\w+"],
    "'pass' statement": [r"\bpass\b"],
    "timing function reassigned": [r"torch\.cuda\.Event\.record\s*=", r"torch\.cuda\.Event\.elapsed_time\s*=",
                                   r"torch\.cuda\.synchronize\s*=", r"torch\.cuda\.Event\s*=",
                                   r"time\.perf_counter\s*=", r"time\.time\s*="],
    "threads or processes": [r"threading\.Thread\s*\(", r"import\s+threading", r"from\s+threading\s+import",
                             r"multiprocessing\.(Process|Pool|Manager|Queue|Pipe)", r"import\s+multiprocessing",
                             r"concurrent\.futures", r"ThreadPoolExecutor", r"ProcessPoolExecutor"],
    "lazy tensor": [r"_make_subclass", r"class\s+\w+.*\(torch\.Tensor\)", r"class\s+\w+.*\(Tensor\)",
                    r"torch\.Tensor\.__new__"],
}
# Warnings: reported, never a rejection (fp32 problems).
STATIC_WARNINGS = {
    "torch.nn compute layer": [r"torch\.nn\.(?!(Module|parameter|Parameter|ParameterList|ParameterDict|ModuleList|"
                               r"ModuleDict|init)\b)"],
    "torch.nn.functional op": [r"torch\.nn\.functional\.\w+", r"\bnn\.functional\.\w+",
                               r"\bF\.(conv|linear|relu|gelu|softmax|batch_norm|layer_norm|dropout|max_pool|avg_pool)"],
    "stream use": [r"torch\.cuda\.Stream\s*\(", r"cuda\.Stream\s*\(", r"with\s+torch\.cuda\.stream",
                   r"\.wait_stream\s*\(", r"\.record_stream\s*\("],
    "fp16 in an fp32 problem": [r"__float2half(_rn)?\s*\(", r"\(\s*__half\s*\)\s*[\w\->\.]+",
                                r"static_cast\s*<\s*(__half|half)\s*>\s*\(", r"\.half\s*\(", r"\.float16\s*\(",
                                r"\.to\s*\(\s*torch\.(float16|half)\b", r"\.to\s*\(\s*dtype\s*=\s*torch\.(float16|half)\b"],
}


def _strip_comments(code):
    """Each line up to its first '#' and its first '//', as the harness strips comments (strings included)."""
    lines = []
    for line in code.split("\n"):
        if "#" in line:
            line = line[:line.index("#")]
        if "//" in line:
            line = line[:line.index("//")]
        lines.append(line)
    return "\n".join(lines)


def static_check(code):
    """(errors, warnings) of KernelBench's static rules for a CUDA candidate: lists of (rule, matched text)."""
    stripped = _strip_comments(code)

    def matches(rules):
        found = []
        for rule, patterns in rules.items():
            for pattern in patterns:
                match = re.search(pattern, stripped)
                if match:
                    line = stripped.count("\n", 0, match.start()) + 1
                    found.append((rule, f"line {line}: {match.group(0)!r}"))
                    break
        return found

    errors = matches(STATIC_ERRORS)
    if "__global__" not in stripped:
        errors.append(("CUDA implementation", "no __global__ kernel"))
    if "load_inline" not in stripped and "cpp_extension" not in stripped:
        errors.append(("CUDA implementation", "neither load_inline nor cpp_extension"))
    if not re.search(r"\b(threadIdx|blockIdx|blockDim|gridDim)\.|__syncthreads\s*\(|__shared__\s+|__device__\s+",
                     stripped):
        errors.append(("CUDA implementation", "no thread indexing or kernel features"))
    return errors, matches(STATIC_WARNINGS)


def main():
    import reference

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("problem", nargs="?", choices=sorted(reference.PROBLEMS))
    parser.add_argument("--problem", dest="problem_file", metavar="PATH",
                        help="a KernelBench problem file instead: its Model with the library applied")
    parser.add_argument("--check", action="store_true",
                        help="print the static rules' verdict on the candidate instead of its source")
    args = parser.parse_args()
    if (args.problem is None) == (args.problem_file is None):
        parser.error("name one problem: a problem of reference.py, or --problem PATH")
    # What the problem's code prints while it runs here (problem_plan) goes to stderr, not into the candidate.
    with contextlib.redirect_stdout(sys.stderr):
        source = candidate_source(args.problem) if args.problem else problem_file_candidate(args.problem_file)
    label = args.problem or args.problem_file
    if not args.check:
        sys.stdout.write(source)
        return
    errors, warnings = static_check(source)
    print(f"{label}: {'FAILED' if errors else 'passed'} KernelBench's static rules "
          f"({len(errors)} errors, {len(warnings)} warnings; {source.count(chr(10))} lines)")
    for kind, found in (("error", errors), ("warning", warnings)):
        for rule, where in found:
            print(f"  {kind}: {rule} ({where})")
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
