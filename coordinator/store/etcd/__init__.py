"""The etcd store and everything that knows etcd: its key layout and record codec, the client and its channels,
shared leases, group commit, watch feeds, and the etcd processes the development mode, the tests and the fault
harness run (process, embedded, cluster, peek). No module outside this package imports etcd's client or knows
its keys; the composition root (coordinator.ops) builds the store from its settings."""
