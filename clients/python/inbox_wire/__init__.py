"""The wire contract, neutral ground between the coordinator and its Python client: the messages and gRPC stubs
generated from proto/ (``inbox_wire.v1``, by scripts/gen_proto.py) and the constants both sides spell. Neither
side imports the other's modules; both import this. The Node client (clients/node) spells the same values,
checked by the shared vectors of conformance/; the .proto documents them.

Beside the contract, the code both sides run and neither owns: ``inbox_wire.http_guard`` (with
``inbox_wire.addresses``), the guard the coordinator's HTTP face and ``inbox-claims-mcp``'s HTTP transport serve
behind (docs/design.md#architecture). Importing this package loads neither (they need uvicorn, which the plain
client does not install).
"""

from __future__ import annotations

__all__ = [
    "BATCH_MAX_CALLS",
    "PRINCIPAL_KIND_METADATA",
    "PRINCIPAL_METADATA",
    "RETRY_AFTER_METADATA",
    "VERSION",
]

# The package's version: pyproject.toml reads it from here (dynamic version), the coordinator reports it.
VERSION = "0.1.0"

# Development mode's identity: who the caller acts as, and whether an agent or a human (metadata keys).
PRINCIPAL_METADATA = "x-inbox-principal"
PRINCIPAL_KIND_METADATA = "x-inbox-principal-kind"

# The trailer (and HTTP response header) with how long to wait before retrying a RESOURCE_EXHAUSTED call, in
# milliseconds; google.rpc.RetryInfo in the status details says the same.
RETRY_AFTER_METADATA = "retry-after-ms"

# Calls one Batch RPC may carry: a round trip's worth of concurrent callers, not a bulk import.
BATCH_MAX_CALLS = 256
