"""vLLM rollout fields of trl_stable's PPOConfig (a dataclass mixin), with `trl.GRPOConfig`'s names and defaults so
a GRPO user's vLLM settings carry over; `trl_stable.trainers.ppo.vllm` hands them to TRL's vLLM helper."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from trl_stable.settings.checks import Dependent, check_dependents, option

_MODES = ("server", "colocate")


@dataclass
class VLLMArguments:
    """Fields that route PPO's rollouts through vLLM (TRL's integration: colocate or a `trl vllm-serve` server)."""

    use_vllm: bool = option(
        False,
        "Sample the rollouts with vLLM instead of HF generate (TRL's vLLM integration, as in GRPO). The "
        "sampler's log-probs come from vLLM and feed the decoupled loss and the mismatch monitor. Needs `vllm`.",
    )
    vllm_mode: str = option(
        "colocate",
        "'colocate': a vLLM engine in each training process, on its GPU; 'server': requests to a "
        "separate `trl vllm-serve` server (see vllm_server_*).",
    )
    vllm_server_base_url: str | None = option(None, "Server mode: base URL of the server; overrides host and port.")
    vllm_server_host: str = option("0.0.0.0", "Server mode: host of the server.")
    vllm_server_port: int = option(8000, "Server mode: port of the server.")
    vllm_server_timeout: float = option(240.0, "Server mode: seconds to wait for the server to come up.")
    vllm_group_port: int = option(51216, "Server mode: port of the weight-update communicator.")
    vllm_gpu_memory_utilization: float = option(
        0.3, "Colocate mode: share of GPU memory vLLM reserves (weights and KV cache)."
    )
    vllm_tensor_parallel_size: int = option(
        1, "Colocate mode: tensor-parallel size; must divide the number of processes."
    )
    vllm_max_model_length: int | None = option(
        None, "Colocate mode: context length (prompt + response); None: from the model config."
    )
    vllm_enable_sleep_mode: bool = option(
        False, "Colocate mode: offload vLLM's weights and cache between rollouts (less memory, slower)."
    )
    vllm_model_impl: str = option(
        "vllm", "Colocate mode: vLLM's model implementation, 'vllm', 'transformers' or 'auto'."
    )

    def validate_vllm_arguments(self) -> None:
        """Raise ValueError, naming the field and the fix, on vLLM settings that cannot work."""
        if self.vllm_mode not in _MODES:
            raise ValueError(f"vllm_mode must be one of {_MODES}, got {self.vllm_mode!r}.")
        check_dependents(self, vllm_dependents(self))
        if not self.use_vllm:
            return  # the ranges of the numeric fields are `PPO_BOUNDS`'
        if getattr(self, "routing_replay", "off") == "R3" and self.vllm_mode == "server":
            raise ValueError(
                "routing_replay='R3' with vllm_mode='server': TRL's vLLM client returns no routed experts. Use "
                "vllm_mode='colocate' or routing_replay='R2'."
            )
        if getattr(self, "load_in_8bit", False):
            raise ValueError("use_vllm does not support load_in_8bit (vLLM has no in-flight 8-bit); use load_in_4bit.")


def vllm_dependents(config: Any, settings: tuple[str, ...] | None = None) -> tuple[Dependent, ...]:
    """The vLLM fields as [`Dependent`]s: `settings` (default: every `VLLMArguments` field but the switch) only act
    with vLLM on, and each mode reads only its own fields (enumerated from the fields' help, "Server mode: ..." /
    "Colocate mode: ...", so a new field is covered)."""
    fields = dataclasses.fields(VLLMArguments)
    server = tuple(f.name for f in fields if f.metadata["help"].startswith("Server mode:"))
    colocate = tuple(f.name for f in fields if f.metadata["help"].startswith("Colocate mode:"))
    return (
        Dependent(settings or tuple(f.name for f in fields if f.name != "use_vllm"), config.use_vllm, "use_vllm=True"),
        Dependent(server, config.vllm_mode == "server", "vllm_mode='server'"),
        Dependent(colocate, config.vllm_mode == "colocate", "vllm_mode='colocate'"),
        Dependent(
            ("vllm_server_host", "vllm_server_port"),
            config.vllm_server_base_url is None,
            "vllm_server_base_url=None (a base URL replaces host and port)",
        ),
    )
