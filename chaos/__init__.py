"""Jepsen-style fault injection for the Inbox Coordinator: no double reply under crashes, pauses and partitions.

``python -m chaos run --seed 7 --duration 180`` starts a 3-member etcd, two coordinators (the real CLI), agent
processes on the real client shim, a human tool that takes messages over, and a record-only fake mail API (the
*sink*); it delivers Nylas-shaped webhooks to the agents while it kills, pauses, slows and partitions things,
then checks what really went out against what the coordinator recorded. See ``docs/reliability.md``.

Modules: :mod:`chaos.harness` (the command line), :mod:`chaos.run` (the phases of a run),
:mod:`chaos.processes` (every process of the world: start, stop, restart, kill, addresses), :mod:`chaos.targets`
(all a fault may do to the world), :mod:`chaos.faults` (the seeded fault schedule and the faults),
:mod:`chaos.webhooks` (the signed deliveries to the agents), :mod:`chaos.monitor` (the harness's own client:
watches, measurements, final reads), :mod:`chaos.config` (settings, fault kinds), :mod:`chaos.workload` (the
seeded plan of messages and deliveries), :mod:`chaos.agent`, :mod:`chaos.human`, :mod:`chaos.sink`,
:mod:`chaos.proxy` (the child processes), :mod:`chaos.netns` (network namespaces for the partition),
:mod:`chaos.checker` (the invariants), :mod:`chaos.common` (small shared pieces).
"""
