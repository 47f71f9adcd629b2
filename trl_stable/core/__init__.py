"""core (filled by its issue)."""
