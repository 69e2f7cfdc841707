"""The API layer: the gRPC service and the HTTP face over one servicer, authentication, quotas and pacing."""
