"""A stop guard for reward components that can fail wholesale (a reward function, an arena judge, the LLM critic):
one failing step costs that step its reward, with a warning; a component that keeps failing stops the run."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class RewardComponentFailure(RuntimeError):
    """A reward component failed on every call for `max_failing_steps` consecutive steps."""


class FailureGuard:
    """Counts the consecutive steps in which a reward component failed wholesale, warns on each, and stops the run.

    Args:
        component: The component, as the messages name it ("reward function 'length'", "the arena judge of
            'arena_swiss'").
        max_failing_steps: Consecutive failing steps that stop the run; None: never stop (each one still warns).
        setting: The setting that sets `max_failing_steps`, named in the error's fix.

    Attributes:
        consecutive: Failing steps in a row, up to now.
        failed_steps: Failing steps in all (a checkpoint keeps both).
    """

    def __init__(
        self,
        component: str,
        max_failing_steps: int | None = 5,
        setting: str = "max_failing_steps",
        error: type[RewardComponentFailure] = RewardComponentFailure,
    ):
        if max_failing_steps is not None and max_failing_steps < 1:
            raise ValueError(f"{setting}={max_failing_steps} must be >= 1, or None to never stop.")
        self.component = component
        self.max_failing_steps = max_failing_steps
        self.setting = setting
        self.error = error
        self.consecutive = 0
        self.failed_steps = 0

    def record(self, failed: bool, cause: str | None = None, fix: str | None = None) -> None:
        """One step's outcome: `failed` when the component gave nothing usable for the whole step, why, and what to
        check (`fix`, for the error; default: the component's service, key, parser or code).

        Raises:
            RewardComponentFailure: (or the guard's `error` class) on the `max_failing_steps`-th failing step in a row.
        """
        if not failed:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.failed_steps += 1
        cause = cause or "no usable value"
        limit = self.max_failing_steps
        if limit is not None and self.consecutive >= limit:
            fix = fix or "Fix the component (its service, key, parser or code)"
            raise self.error(
                f"{self.component} failed on every completion for {self.consecutive} consecutive steps (last cause: "
                f"{cause}). Training on it would learn from nothing. {fix}, or raise {self.setting} (None never "
                "stops)."
            )
        left = "" if limit is None else f"; the run stops after {limit} in a row"
        logger.warning(
            f"{self.component} failed on every completion of this step ({cause}): {self.consecutive} failing step(s) "
            f"in a row{left}."
        )

    def checkpoint_state(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "failed_steps": self.failed_steps}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.consecutive = int(state["consecutive"])
        self.failed_steps = int(state["failed_steps"])
