"""trl_stable's integration with the TRL release it builds on: the version gate (`version`)."""
