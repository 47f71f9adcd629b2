"""Compatibility layers for scripts written against older TRL APIs (see `trl_stable.compat.relc`)."""
