"""What `PPOTrainer.step` makes of its arguments: each checked, the sampler's record taken from the `Rollout`, and the
samples padded into one batch dict (trimmed per micro-batch in the update)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from trl.trainer.utils import pad

from trl_stable.core.positions import position_ids_from_mask
from trl_stable.moe.hook import ROUTED_EXPERTS_KEY, batch_routing
from trl_stable.rewards.dense import RewardContractError, RewardTypeError
from trl_stable.trainers.ppo.rollout import Rollout

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_token_ids(ids: Any, where: str, vocab_size: int | None) -> None:
    """`ids` must be a 1-D integer tensor of ids in [0, vocab_size): else ValueError naming `where`, the position, the
    value and the fix (an id outside the embedding table is an IndexError inside the model's first layer)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        raise ValueError(f"{where} must be a 1-D LongTensor of token ids, got {ids!r:.60}.")
    if ids.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"{where} has dtype {ids.dtype}; token ids are integers: pass a LongTensor of token ids.")
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero() if vocab_size is not None else []
    if len(bad):
        position = int(bad[0])
        raise ValueError(
            f"{where} holds token id {int(ids[position])} at position {position}, outside [0, {vocab_size}) (the "
            "model's embeddings): pass ids from this tokenizer/model."
        )


def is_sized(value: Any) -> bool:
    """Whether `value` holds entries (a list, tuple, >= 1-D tensor or array), not a string or a number."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim > 0
    return not isinstance(value, (str, bytes)) and hasattr(value, "__len__")


def _sampler_record(queries, responses, sampler_logprobs, use_decoupled_loss: bool, routing_mode: str):
    """The sampler's log-probs and routing for this step, from the arguments or the `Rollout` itself."""
    rollout = responses if isinstance(responses, Rollout) else None
    if rollout is not None and rollout.with_prompt:
        raise ValueError("step() takes responses without their prompt: generate them with return_prompt=False.")
    if sampler_logprobs is None and rollout is not None:
        sampler_logprobs = rollout.sampler_logprobs
    if use_decoupled_loss and sampler_logprobs is None:
        raise ValueError(
            "use_decoupled_loss needs the sampler's log-probs: pass step(sampler_logprobs=...) or step the "
            "Rollout returned by trainer.generate(..., return_prompt=False) unchanged."
        )
    if routing_mode != "R3":
        return sampler_logprobs, None
    routing = rollout.routing if rollout is not None else None
    if routing is None or len(routing) != len(queries):
        raise ValueError(
            "routing_replay='R3' needs the sampler's routing: step() the Rollout returned by "
            "generate(..., return_prompt=False) unchanged, with all its samples (or use routing_replay='R2')."
        )
    for i, (route, q, r) in enumerate(zip(routing, queries, responses)):
        if len(route) > len(q) + len(r) or len(rollout.queries[i]) != len(q):
            raise ValueError(
                f"routing_replay='R3': sample {i} is not the one generate() produced (its routing does not apply): "
                "pass the generated queries and responses unchanged, in order."
            )
    return sampler_logprobs, routing


def check_per_token(name: str, rows, responses) -> None:
    """One entry of `rows` per response token of each sample. For token rewards the errors are the reward
    contract's (`RewardContractError`, `RewardTypeError`), so deferred token rewards stop every process with them.
    `turn_ids` rows hold integers; `sampler_logprobs` rows log-probabilities: finite and <= 0, NaN where the sampler
    gave none (as vLLM's None, and TRL's GRPO, which leaves such a token uncorrected)."""
    rewards = name == "token_rewards"
    value_error, type_error = (RewardContractError, RewardTypeError) if rewards else (ValueError, TypeError)
    if not is_sized(rows):
        raise type_error(f"step()'s {name} is {rows!r:.60} ({type(rows).__name__}); pass one row per sample.")
    if len(rows) != len(responses):
        raise value_error(f"step() got {len(rows)} {name} for {len(responses)} responses; pass one per sample.")
    what = "reward" if rewards else "entry"
    for i, (row, r) in enumerate(zip(rows, responses)):
        if not is_sized(row):
            raise type_error(f"{name}[{i}] is {row!r:.60} ({type(row).__name__}); give one {what} per response token.")
        if len(row) != len(r):
            raise value_error(f"{name}[{i}] has {len(row)} entries for {len(r)} tokens; give one {what} per token.")
    if rewards:
        return  # their numbers are the reward contract's, checked when they are read
    for i, row in enumerate(rows):
        try:
            values = torch.as_tensor(row)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"{name}[{i}] is not a row of numbers ({err}).") from None
        if name == "turn_ids" and values.dtype not in _INTEGER_DTYPES:
            raise ValueError(
                f"turn_ids[{i}] has dtype {values.dtype}; turn ids are integers (0, 1, ...; -1: no action)."
            )
        if name == "sampler_logprobs":
            bad = (values.isinf() | (values > 0)).nonzero()
            if len(bad):
                t = int(bad[0])
                raise ValueError(
                    f"sampler_logprobs[{i}] holds {float(values[t]):.6g} at position {t}, not a log-prob (finite and "
                    "<= 0, NaN: not reported): pass the sampler's log-probs, not logits or probabilities."
                )


def check_step_inputs(trainer, queries, responses, token_rewards, scores, turn_ids, sampler_logprobs):
    """Check `step()`'s arguments: one entry per sample in each, `args.batch_size` samples, non-empty queries and
    responses of token ids in [0, trainer.vocab_size), integer turn ids, the sampler's log-probs where the loss or
    routing replay needs them. Returns the sampler's log-probs and routing (from the arguments or the `Rollout`) and
    the deferred token rewards (a callable `token_rewards`)."""
    args, vocab_size = trainer.args, trainer.vocab_size
    sampler_logprobs, routing = _sampler_record(
        queries, responses, sampler_logprobs, args.use_decoupled_loss, trainer.routing.mode
    )
    deferred = token_rewards if callable(token_rewards) else None
    token_rewards = None if deferred else token_rewards
    n = len(queries)
    lengths = {"queries": n, "responses": len(responses)}
    per_sample = dict(token_rewards=token_rewards, scores=scores, turn_ids=turn_ids, sampler_logprobs=sampler_logprobs)
    for name, value in per_sample.items():
        if value is not None:
            if not is_sized(value):
                raise RewardTypeError(
                    f"step()'s {name} is {value!r:.60} ({type(value).__name__}); pass one entry per sample."
                )
            lengths[name] = len(value)
    if len(set(lengths.values())) != 1:
        raise ValueError(f"step() got lists of different lengths: {lengths}; pass one entry per sample.")
    if n != args.batch_size:
        raise ValueError(f"step() got {n} samples but args.batch_size is {args.batch_size}.")
    if token_rewards is None and scores is None and deferred is None:
        raise ValueError("step() needs `token_rewards`, `scores` or both.")
    for i, (q, r) in enumerate(zip(queries, responses)):
        check_token_ids(q, f"queries[{i}]", vocab_size)
        check_token_ids(r, f"responses[{i}]", vocab_size)
        if len(q) == 0 or len(r) == 0:
            raise ValueError(f"Sample {i} has an empty query or response.")
    for name in ("token_rewards", "turn_ids", "sampler_logprobs"):
        if per_sample[name] is not None:
            check_per_token(name, per_sample[name], responses)
    return sampler_logprobs, routing, deferred


def resolve_token_rewards(deferred, responses):
    """Call deferred token rewards and check them (errors under the reward contract, see `check_per_token`)."""
    rows = deferred()
    if rows is not None:
        check_per_token("token_rewards", rows, responses)
    return rows


def make_batch(queries, responses, pad_token_id: int, device, turn_ids=None, routing=None) -> dict[str, torch.Tensor]:
    """Left-padded queries and right-padded responses in one [B, P + R] batch, with the response mask, the turn ids
    ([B, R], -1 on non-actions; action mask = response mask and turn id >= 0) and the R3 routing."""
    queries = [q.to(device).long() for q in queries]
    responses = [r.to(device).long() for r in responses]
    prompt_ids = pad(queries, pad_token_id, padding_side="left")
    response_ids = pad(responses, pad_token_id)
    response_mask = pad([torch.ones(len(r), device=device) for r in responses])
    prompt_mask = pad([torch.ones_like(q) for q in queries], padding_side="left")
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
    batch = {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        # numbered from each row's first real token, as `generate` did: every pass agrees with the sampler
        "position_ids": position_ids_from_mask(attention_mask),
        "response_ids": response_ids,
        "response_mask": response_mask,
        "response_lengths": torch.tensor([len(r) for r in responses], device=device),
    }
    if turn_ids is not None:
        turns = pad([torch.as_tensor(row, dtype=torch.long).to(device) for row in turn_ids], padding_value=-1)
        batch["turn_ids"] = turns
        batch["response_mask"] = response_mask * (turns >= 0)
    if routing is not None:
        batch[ROUTED_EXPERTS_KEY] = batch_routing(routing, attention_mask, prompt_ids.shape[1])
    return batch


def trim_micro_batch(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the trailing response columns that are padding in every row of the micro-batch (saves compute)."""
    width = int(mb["response_lengths"].max())
    full = mb["response_ids"].shape[1]
    seq = mb["input_ids"].shape[1]  # > full: every query has a token
    # sequence-aligned entries (ids, masks, routing, any per-position extra) and response-aligned ones lose the columns
    kept = {seq: seq - (full - width), full: width}
    return {k: v[:, : kept[v.shape[1]]] if v.dim() >= 2 and v.shape[1] in kept else v for k, v in mb.items()}
