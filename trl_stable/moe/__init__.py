"""moe (filled by its issue)."""
