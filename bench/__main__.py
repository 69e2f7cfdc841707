"""python -m bench claims [--clients 64] [--seconds 10] [--rounds 3]"""

from __future__ import annotations

import argparse
import asyncio
import sys

from . import claims


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    claims.add_arguments(commands.add_parser("claims", help="ClaimReply through the coordinator vs raw etcd txns"))
    options = parser.parse_args()
    if options.command == "claims":
        return asyncio.run(claims.run(options))
    raise AssertionError(options.command)


if __name__ == "__main__":
    sys.exit(main())
