"""An example agent: a Nylas webhook receiver wired through inbox_claims, a fake LLM and a fake Nylas."""
