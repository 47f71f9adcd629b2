"""Names transformers gives things that trl_stable must find again: the path a model was loaded from, and the file
a process's RNG state goes into in a checkpoint (see `trl_members.CONFIG_NAME_ATTRIBUTE` and `mirrored.MIRRORED`)."""

from __future__ import annotations

from typing import Any

from trl_stable.integration.trl_members import CONFIG_NAME_ATTRIBUTE


def model_name_of(model: Any) -> str | None:
    """The name or path `model` was loaded from (its config's `CONFIG_NAME_ATTRIBUTE`), None when it has none."""
    return getattr(getattr(model, "config", None), CONFIG_NAME_ATTRIBUTE, None) or None


def rng_state_file(trainer: Any) -> str:
    """The name of this process's RNG file in a checkpoint transformers' `Trainer` wrote (see `MIRRORED`)."""
    return "rng_state.pth" if trainer.args.world_size <= 1 else f"rng_state_{trainer.args.process_index}.pth"
