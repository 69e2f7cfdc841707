"""The core: the claim state machine (domain, pure, the clock passed in), the use cases (engine), the errors and
limits every layer shares, and the store the engine needs, as a protocol (storage: the implementations live in
coordinator.store). Imports nothing of the coordinator outside this package."""
