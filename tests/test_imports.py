"""The packages' import graph: no circles, the services free of each other, and the shared
``specdec`` package importing neither (every import counts, type-only and deferred too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specdec", "drafter_service", "verifier_service", "bench", "tools")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of PACKAGES (generated stubs aside) and the modules of PACKAGES it imports."""
    paths = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py") if "v1" not in path.parts]
    modules = {_module(path): path for path in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from package import module
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph()) == []


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_services_import_neither_each_other_nor_upwards_into_the_shared_package():
    graph = import_graph()
    for module, targets in graph.items():
        top = module.split(".")[0]
        tops = {target.split(".")[0] for target in targets}
        if top == "specdec" and module != "specdec.__main__":  # specdec serve starts both, as processes
            assert not tops & {"drafter_service", "verifier_service"}, module
        if top == "drafter_service":
            assert "verifier_service" not in tops, module
        if top == "verifier_service":
            assert "drafter_service" not in tops or module.endswith("local_run"), module


# The verifier's layers, lowest first: a module imports its own layer's and lower ones only.
# The modules at verifier_service's top (its entry point, the CLI client, the local run) stand above them all.
VERIFIER_LAYERS = ("verifier_service.core", "verifier_service.head", "verifier_service.serving")


def layer_of(module: str) -> int | None:
    return next((rank for rank, layer in enumerate(VERIFIER_LAYERS) if module == layer or module.startswith(layer + ".")), None)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, target) for every import of a verifier layer above the importing module's."""
    found = []
    for module, targets in graph.items():
        rank = layer_of(module)
        if rank is None:
            continue
        for target in targets:
            above = layer_of(target)
            if above is not None and above > rank or (target.startswith("verifier_service.") and above is None):
                found.append((module, target))
    return sorted(found)


def test_the_verifier_layers_import_nothing_above_them():
    """core (the engine and what it runs) knows neither the draft head nor serving; the head
    knows no serving; none of them the modules at the package's top."""
    assert upward_imports(import_graph()) == []


def test_the_layer_checker_finds_an_upward_import():
    graph = {
        "verifier_service.core.engine": {"verifier_service.head.proposer", "verifier_service.core.step"},
        "verifier_service.head.proposer": {"verifier_service.core.planner"},
        "verifier_service.serving.server": {"verifier_service.head.proposer", "verifier_service.client"},
    }
    assert upward_imports(graph) == [
        ("verifier_service.core.engine", "verifier_service.head.proposer"),
        ("verifier_service.serving.server", "verifier_service.client"),
    ]
