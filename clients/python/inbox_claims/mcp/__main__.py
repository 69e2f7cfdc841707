"""``python -m inbox_claims.mcp``: the ``inbox-claims-mcp`` command."""

from . import main

main()
