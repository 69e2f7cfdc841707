"""The Inbox Coordinator server, in layers (docs/design.md#architecture): ``core`` (the claim rules and use cases),
``store`` (the memory and etcd stores), ``api`` (the gRPC service and the HTTP face), ``ops`` (the process, its
settings and metrics); ``testing`` starts one in a test. ``python -m coordinator`` is ``inbox-coordinator``."""
