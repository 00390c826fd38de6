"""The package's layers, read from its imports (``ast``): no module imports from a higher layer,
and no two modules import each other, directly or through others.

The order (README, "Architecture"), lowest first:

    envs < ops < configs < reference < attention_backends < model_executor < spec_decode
         < patch < platforms < entrypoints < the package root < tools

Every import counts, also those inside functions (a lazy import of a higher layer is still a
dependency on it); only imports under ``if TYPE_CHECKING:`` are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "deepinfer_vllm"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

LAYERS = (
    "envs",
    "ops",
    "configs",
    "reference",
    "attention_backends",
    "model_executor",
    "spec_decode",
    "patch",
    "platforms",
    "entrypoints",
    "",  # the package root (``deepinfer_vllm/__init__.py``: the plugin's entry point)
    "tools",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    if top not in LAYERS:
        raise AssertionError(f"{module}: package {top!r} has no place in the layer order {LAYERS}")
    return LAYERS.index(top)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The package's modules ``module`` imports (a ``from a import b`` of a submodule ``b``
    counts as importing ``a.b``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join([*base, child.module] if child.module else base)
                else:
                    target = child.module or ""
                for alias in child.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in known else target)
            visit(child)

    visit(tree)
    return {name for name in found if name in known and name != module}


def _graph() -> dict[str, set[str]]:
    files = {(_module_name(path)): path for path in ROOT.rglob("*.py")}
    known = set(files)
    return {module: _imports(path, module, known) for module, path in files.items()}


GRAPH = _graph()


def test_every_module_has_a_layer():
    for module in GRAPH:
        _layer(module)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_go_down(module):
    mine = _layer(module)
    upward = sorted(target for target in GRAPH[module] if _layer(target) > mine)
    assert not upward, (
        f"{module} (layer {LAYERS[mine] or 'root'}) imports from higher layers: "
        + ", ".join(f"{t} ({LAYERS[_layer(t)] or 'root'})" for t in upward)
    )


def test_ops_import_no_vllm():
    """``ops`` runs on a bare GPU host with no vLLM (the device suites import it there)."""
    offenders = []
    for path in (ROOT / "ops").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "vllm"]
    assert not offenders, offenders


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_cycles():
    # A package's ``__init__`` that re-exports its own submodules is not a cycle.
    graph = {m: {t for t in targets if t not in _ancestors(m)} for m, targets in GRAPH.items()}
    assert not _cycles(graph), _cycles(graph)


def test_the_checker_sees_a_climb_and_a_cycle():
    """The checks above can fail: an upward import and a two-module cycle are found."""
    assert _layer(f"{PACKAGE}.ops.quant") < _layer(f"{PACKAGE}.model_executor.models.deepseek_v41")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    graph_modules = set(GRAPH)
    assert f"{PACKAGE}.configs.checkpoint" in graph_modules
    assert f"{PACKAGE}.configs" in GRAPH[f"{PACKAGE}.configs.checkpoint"]


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (the tests folders are not packages): two files of
    one name in different folders of one suite make it fail to collect one of them. The
    device-only suites (``tests/gpu``, ``tests/gpu_model``, ``tests/npu``) run on their own."""
    root = Path(__file__).resolve().parent
    device_only = {"gpu", "gpu_model", "npu"}
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted(root.rglob("test_*.py")):
        if path.relative_to(root).parts[0] in device_only:
            continue
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(root)} and {path.relative_to(root)}")
        seen.setdefault(path.name, path)
    assert not clashes, clashes
