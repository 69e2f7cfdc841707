"""Placeholder until the command line lands."""


def main() -> int:
    raise SystemExit("inbox-claims-mcp: not yet")
