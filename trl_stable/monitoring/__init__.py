"""monitoring (filled by its issue)."""
