"""``python -m chaos run --seed 7 --duration 180``: a chaos run (see :mod:`chaos.harness`).

The other commands are the run's child processes: ``agent``, ``human``, ``sink``, ``proxy``.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    commands = ("run", "agent", "human", "sink", "proxy")
    if not argv or argv[0] not in commands:
        print(f"usage: python -m chaos {{{','.join(commands)}}} ... (python -m chaos run --help)", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        from .harness import main as run_main

        return run_main(rest)
    if command == "agent":
        from .agent import main as agent_main

        return agent_main(rest)
    if command == "human":
        from .human import main as human_main

        return human_main(rest)
    if command == "sink":
        from .sink import main as sink_main

        return sink_main(rest)
    from .proxy import main as proxy_main

    return proxy_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
