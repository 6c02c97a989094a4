"""The house rules of the source tree, checked: files under 600 lines, functions under 60 (Triton
kernels aside), imports inside functions only for heavy or optional dependencies (and a
command's own modules in the CLI), and no import cycles between pagedlab's modules."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60
# Third-party modules a function may import where it runs: heavy ones (start-up time) and the
# optional extras (lab, server, eval), which the engine and `pagedlab bench` must run without.
LAZY_THIRD_PARTY = {
    "torch", "triton", "transformers", "tokenizers", "safetensors", "gguf", "accelerate", "huggingface_hub",
    "numpy", "pandas", "matplotlib", "seaborn", "yaml", "sqlalchemy", "pynvml", "sacrebleu", "rich", "tqdm",
    "psutil", "pyarrow", "fastapi", "uvicorn", "starlette", "pydantic", "httpx", "prometheus_client",
    "openai", "lm_eval", "jinja2", "ray", "scipy",
}
# pagedlab modules imported lazily outside the CLI, and why.
LAZY_INTERNAL = {
    "pagedlab.lab.bench": "LLM.benchmark: the engine must not import the lab when it loads",
    "pagedlab.kernels.paged_attention": "the Triton backend: triton is optional on the CPU",
    "pagedlab.kernels.kv_write": "the Triton backend: triton is optional on the CPU",
    "pagedlab.kernels.triton_kernels": "the Triton kernels themselves: triton is optional on the CPU",
    "pagedlab.kernels.kv_write_kernels": "the KV-write Triton kernels: triton is optional on the CPU",
    "pagedlab.kernels.fused_moe_kernels": "the fused MoE Triton kernels: triton is optional on the CPU, "
                                          "and the interpreter must be settled before they are decorated",
    "pagedlab.kernels.all_reduce": "the one-shot all-reduce on CUDA: triton is optional on the CPU",
    "pagedlab.kernels.gemv": "dense GEMV on CUDA: triton is optional on the CPU, and the interpreter must be "
                             "settled before its kernels are decorated",
    "pagedlab.kernels.fp8_linear": "FP8 activation quantization and GEMV on CUDA: triton is optional "
                                   "on the CPU",
    "pagedlab.quantization.formats": "config resolves the weight format: config loads without torch, "
                                     "so the command line answers --help at once",
    "pagedlab.kernels.batch_invariant": "batch-invariant matmul, norms and softmax on CUDA: triton is "
                                        "optional on the CPU, and the interpreter must be settled before its "
                                        "kernels are decorated",
    "pagedlab.kernels.w4a16": "AWQ linears on CUDA: triton is optional on the CPU, and the interpreter "
                              "must be settled before its kernels are decorated",
    "pagedlab.kernels.sampling_kernels": "Gumbel-max sampling on CUDA: triton is optional on the CPU, whose "
                                         "engine samples through the torch reference",
    "pagedlab.kernels.lora": "LoRA shrink/expand on CUDA: triton is optional on the CPU, and the interpreter "
                             "must be settled before its kernels are decorated",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_cli(path: Path) -> bool:
    return path.name == "cli.py" or path.name.endswith("_cli.py") or path.parent.name == "cli"


def _imported_names(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """Absolute module names an import statement loads (``from a import b`` is ``a.b`` when that
    is a module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", node.level)[0]
        if node.level > 1:
            package = package.rsplit(".", node.level - 1)[0]
        base = f"{package}.{base}" if base else package
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module loads (``if TYPE_CHECKING:`` blocks excluded)."""
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.If, ast.Try)):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            found += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_file_and_function_length(module):
    path = MODULES[module]
    source = path.read_text()
    lines = source.count("\n")
    assert lines <= MAX_FILE_LINES, f"{path} has {lines} lines, over {MAX_FILE_LINES}: split it on its seams"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any("jit" in ast.unparse(d) for d in node.decorator_list):
                continue  # Triton kernels
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{path}:{node.lineno} {node.name}() has {length} lines"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_inside_functions_are_only_heavy_or_optional(module):
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    top = set(map(id, _top_level_imports(tree)))
    misplaced = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in top:
            continue
        for name in _imported_names(node, module):
            root = name.split(".")[0]
            if root == "pagedlab":
                ok = _is_cli(path) or name in LAZY_INTERNAL
            else:
                ok = root in LAZY_THIRD_PARTY or root not in sys.stdlib_module_names
            if not ok:
                misplaced.append(f"{path}:{node.lineno} imports {name}")
    assert not sorted(misplaced), ("imports inside functions (only heavy or optional dependencies, and a "
                                   "command's modules in the CLI, load lazily; import these at the top): "
                                   + "; ".join(sorted(misplaced)))


def test_no_import_cycles():
    graph = {}
    for module, path in MODULES.items():
        imports = _top_level_imports(ast.parse(path.read_text()))
        graph[module] = {n for node in imports for n in _imported_names(node, module) if n in MODULES}
        # importing a.b.c runs a and a.b first
        graph[module] |= {p for n in set(graph[module]) for p in _parents(n) if p in MODULES and p != module}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1 and not module.startswith(target + "."):
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]
