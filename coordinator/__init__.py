"""The Inbox Coordinator server: domain, store and service."""
