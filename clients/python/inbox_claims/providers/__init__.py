"""Providers behind one seam (docs/providers.md)."""
