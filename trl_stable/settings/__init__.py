"""Rules every trl_stable configuration follows: field checks (`checks`) and secrets kept out of everything a run
writes (`secrets`)."""
