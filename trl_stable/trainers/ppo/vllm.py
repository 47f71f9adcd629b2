"""PPO rollouts through TRL's vLLM helper (`trl.generation.vllm_generation.VLLMGeneration`, GRPO's), built from
GRPO's arguments, synced once per PPO step; routing replay R3 reads vLLM's ``routed_experts`` (docs/ppo.md, "Rollouts
through vLLM")."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any
from unittest.mock import patch

import torch
import trl.generation.vllm_generation as trl_vllm
from trl.generation.vllm_generation import VLLMGeneration

from trl_stable.integration.patching import wrapped_method
from trl_stable.trainers.ppo.vllm_args import VLLMArguments

ROUTED_EXPERTS_FLAG = "enable_return_routed_experts"


def _field_names(cls: Any) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    try:
        return set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return set()


def vllm_routed_experts_support() -> str | None:
    """None when the installed vLLM can return each sequence's routed experts (the engine argument
    ``enable_return_routed_experts`` and `CompletionOutput.routed_experts`); else why not, naming the version."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    import vllm

    version = getattr(vllm, "__version__", "of unknown version")
    from vllm.outputs import CompletionOutput

    needed = ((vllm.EngineArgs, ROUTED_EXPERTS_FLAG), (CompletionOutput, "routed_experts"))
    missing = [f"{cls.__name__}.{name}" for cls, name in needed if name not in _field_names(cls)]
    return f"vLLM {version} does not return routed experts (it has no {' / '.join(missing)})" if missing else None


@contextmanager
def _request_outputs(generation: Any) -> Iterator[list[Any]]:
    """Collect the `RequestOutput`s of the colocate engine's ``llm.generate`` in one helper call (TRL keeps only their
    ids and log-probs); an instance-level patch, undone on exit."""
    outputs: list[Any] = []

    def recording(original):
        def generate(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            outputs.extend(result)
            return result

        return generate

    with wrapped_method(generation.llm, "generate", recording):
        yield outputs


class VLLMRollouts:
    """TRL's vLLM helper built from a `PPOConfig` for the (unwrapped) `policy` loaded from `model_id`, with the PPO
    step its weights were last synced at; refuses routing replay R3 when vLLM cannot return the sampler's routing."""

    def __init__(self, policy: torch.nn.Module, accelerator: Any, processing_class: Any, args: Any, model_id: Any):
        self.return_routing = args.routing_replay == "R3"  # colocate mode: `PPOConfig` refuses R3 with a server
        reason = vllm_routed_experts_support() if self.return_routing else None
        if reason is not None:
            raise ValueError(
                f"routing_replay='R3' with use_vllm needs the sampler's routing, but {reason}: use a vLLM taking "
                f"`{ROUTED_EXPERTS_FLAG}`, routing_replay='R2', or use_vllm=False."
            )
        if args.vllm_mode == "colocate" and not model_id:
            raise ValueError(
                "vllm_mode='colocate' starts vLLM from the policy's name or path: pass `model` so, or use 'server'."
            )
        # TRL's `LLM(...)` call takes no extra engine arguments: R3's flag is passed through a patch while it is built
        llm = functools.partial(trl_vllm.LLM, **{ROUTED_EXPERTS_FLAG: True}) if self.return_routing else None
        with patch.object(trl_vllm, "LLM", llm) if llm else nullcontext():
            # GRPO's names: each `VLLMArguments` field vllm_<name> is the helper's <name>
            named = [f.name for f in dataclasses.fields(VLLMArguments) if f.name != "use_vllm"]
            self.generation = VLLMGeneration(
                model=policy,
                accelerator=accelerator,
                processing_class=processing_class,
                **{name.removeprefix("vllm_"): getattr(args, name) for name in named},
                max_num_seqs=(args.generation_batch_size or args.batch_size) * args.vllm_tensor_parallel_size,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                max_completion_length=args.max_new_tokens,
                logprobs=0,  # the sampled token's log-prob only: what the decoupled loss needs
                generation_kwargs=args.generation_kwargs,
            )
        self.synced_step: int | None = None  # None: sync before the first rollout (the policy may differ from disk)

    def sample(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, step: int
    ) -> tuple[list[list[int]], list[list[float]] | None, list[Any] | None]:
        """Completion ids, their sampler log-probs (NaN where vLLM gave none) and, for R3, vLLM's routed experts, of
        one chunk of prompts, after syncing the weights if a PPO step ran since. A collective."""
        if step != self.synced_step:
            self.generation.sync_weights()
            self.synced_step = step
        self.generation.max_completion_length = max_new_tokens  # a length sampler's cap, read by each generate
        record = _request_outputs(self.generation) if self.return_routing else nullcontext([])
        with record as outputs:
            _, completion_ids, logprobs, _ = self.generation.generate([list(p) for p in prompts], None, 1)
        sampler = None
        if logprobs is not None:
            sampler = [[math.nan if lp[0] is None else float(lp[0]) for lp in row] for row in logprobs]
        routing = None
        if self.return_routing:
            routing = [out.outputs[0].routed_experts for out in outputs]
            if len(routing) != len(completion_ids) or any(r is None for r in routing):
                raise RuntimeError(
                    f"routing_replay='R3': vLLM returned no routed experts despite {ROUTED_EXPERTS_FLAG}."
                )
        return [list(c) for c in completion_ids], sampler, routing


def vllm_sampler(trainer: Any) -> AbstractContextManager[Callable[..., tuple]]:
    """`PPOTrainer.generate`'s chunk sampler through vLLM (`hf_sampler`'s contract), with vLLM's log-probs and
    routing."""
    device, rollouts = trainer.accelerator.device, trainer.vllm_rollouts

    def sample(start: int, batch: list[torch.Tensor], max_new_tokens: int | None) -> tuple:
        cap = max_new_tokens or trainer.args.max_new_tokens
        ids, logps, routing = rollouts.sample([q.tolist() for q in batch], cap, trainer.state.global_step)
        if any(len(c) == 0 for c in ids):
            raise ValueError("vLLM returned an empty completion; PPO needs at least one response token per sample.")
        return [torch.tensor(c, dtype=torch.long, device=device) for c in ids], logps, routing

    return nullcontext(sample)
