"""Decoupled-loss and token-filter fields shared by the GRPO and PPO configs: a dataclass mixin whose
`validate_decoupled_loss_arguments()` the configs call (import-light, for `ppo_config`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl_stable.settings.checks import field_default, option

TOKEN_FILTERS = ("icepop", "kpop")
# (lower, upper) when the field is None; KPop has only an upper KL threshold.
_FILTER_DEFAULT_BOUNDS = {"icepop": (0.5, 5.0), "kpop": (None, 2.0)}


@dataclass
class DecoupledLossArguments:
    """Fields of AReaL's decoupled PPO loss and its IcePop / KPop token filter (`trl_stable.core.behaviour_weights`);
    a config may redeclare `use_decoupled_loss` to say how its trainer gets the sampler's log-probs."""

    use_decoupled_loss: bool = option(
        False, "Decoupled PPO loss (AReaL): the clipped term times the behaviour weight exp(logp_prox - logp_sampler)."
    )
    token_filter: str | None = option(
        None, "Token filter of the decoupled loss: 'icepop' (ratio band) or 'kpop' (binary KL)."
    )
    token_filter_level: str = option("token", "Filter level: 'token', or 'sequence' (keep or drop whole sequences).")
    token_filter_action: str = option(
        "mask", "'mask' drops filtered tokens from the loss; 'clamp' bounds the weight (IcePop only)."
    )
    token_filter_lower: float | None = option(None, "IcePop lower bound of the weight (default 0.5). Unused by KPop.")
    token_filter_upper: float | None = option(
        None, "IcePop upper bound of the weight (default 5.0); KPop KL threshold (2.0)."
    )

    def validate_decoupled_loss_arguments(self) -> None:
        if self.token_filter is not None:
            if self.token_filter not in TOKEN_FILTERS:
                raise ValueError(f"token_filter={self.token_filter!r} is unknown; use 'icepop', 'kpop' or None.")
            if not self.use_decoupled_loss:
                raise ValueError(
                    f"token_filter={self.token_filter!r} filters the decoupled loss's tokens; set "
                    "use_decoupled_loss=True (or token_filter=None)."
                )
        else:
            settings = ("token_filter_level", "token_filter_action", "token_filter_lower", "token_filter_upper")
            unused = [name for name in settings if getattr(self, name) != field_default(self, name)]
            if unused:
                raise ValueError(
                    f"{', '.join(unused)} only apply to a token filter, but token_filter=None; set "
                    "token_filter='icepop' or 'kpop' (with use_decoupled_loss=True), or unset them."
                )
        if self.token_filter_level not in ("token", "sequence"):
            raise ValueError(f"token_filter_level={self.token_filter_level!r} is invalid; use 'token' or 'sequence'.")
        if self.token_filter_action not in ("mask", "clamp"):
            raise ValueError(f"token_filter_action={self.token_filter_action!r} is invalid; use 'mask' or 'clamp'.")
        if self.token_filter == "kpop":
            if self.token_filter_action == "clamp":
                raise ValueError(
                    "KPop only masks tokens: token_filter='kpop' supports only token_filter_action='mask' (a KL has "
                    "no band to clamp a weight into); set token_filter_action='mask' or use token_filter='icepop'."
                )
            if self.token_filter_lower is not None:
                raise ValueError(
                    "token_filter='kpop' has only an upper KL threshold; unset token_filter_lower (use "
                    "token_filter_upper)."
                )
            if self.token_filter_upper is not None and not self.token_filter_upper > 0:
                raise ValueError(f"token_filter_upper={self.token_filter_upper} must be > 0 for KPop.")
        if self.token_filter == "icepop":
            lower, upper = self.filter_bounds
            if not (lower > 0 and upper > 0):
                raise ValueError(
                    "IcePop bounds must be positive ratios, got "
                    f"token_filter_lower={lower}, token_filter_upper={upper}."
                )
            if lower >= upper:
                raise ValueError(
                    f"token_filter_lower ({lower}) must be < token_filter_upper ({upper}); swap or widen the band."
                )

    @property
    def filter_bounds(self) -> tuple[float | None, float | None]:
        """(lower, upper) of the token filter, defaults filled in: IcePop (0.5, 5.0), KPop (None, 2.0)."""
        default_lower, default_upper = _FILTER_DEFAULT_BOUNDS.get(self.token_filter, (None, None))
        lower = self.token_filter_lower if self.token_filter_lower is not None else default_lower
        upper = self.token_filter_upper if self.token_filter_upper is not None else default_upper
        return lower, upper
