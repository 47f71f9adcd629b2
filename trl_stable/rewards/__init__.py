"""rewards (filled by its issue)."""
