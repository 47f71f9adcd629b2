"""Step-mask fields shared by the GRPO and PPO configs: a dataclass mixin whose `validate_step_mask_arguments()` the
configs call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trl_stable.settings.checks import option


@dataclass
class StepMaskArguments:
    """Fields that remove invalid agent steps from the policy loss (`trl_stable.masking.CompletionStepMasker`); a
    config may redeclare `step_loss_mask` to say what else its trainer does with the masked tokens."""

    step_loss_mask: bool = option(
        False,
        "Remove the tokens of invalid agent steps (tool calls that are not JSON, name an unknown tool or "
        "have wrongly typed arguments) from the policy loss.",
    )
    step_mask_tools: dict[str, Any] | str | None = option(
        None,
        "Valid tools for step_loss_mask: names, {name: signature}, OpenAI tool specs, or a JSON string/"
        "file of these. None checks only that a tool call is JSON with a name.",
    )

    def validate_step_mask_arguments(self) -> None:
        """Parse and check `step_mask_tools` (see `trl_stable.masking.load_tools`) now, not at the first tool call;
        raise ValueError on bad or unused tools."""
        from trl_stable.masking.validation import load_tools  # lazy: the config modules stay import-light

        try:
            self.step_mask_tools = load_tools(self.step_mask_tools)
        except ValueError as err:
            raise ValueError(f"step_mask_tools is invalid: {err}") from err
        if self.step_mask_tools is not None and not self.step_loss_mask:
            raise ValueError("step_mask_tools is set but step_loss_mask=False; set step_loss_mask=True to use it.")
