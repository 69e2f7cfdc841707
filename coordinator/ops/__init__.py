"""Running a coordinator: the server that wires store, engine and API together, the ``inbox-coordinator``
command, its configuration, logs and metrics. The only layer that chooses a store."""
