"""masking (filled by its issue)."""
