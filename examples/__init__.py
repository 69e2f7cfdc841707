"""Runnable examples of the Inbox Coordinator client (see README.md here)."""
