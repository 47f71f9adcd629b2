"""Routing replay for HuggingFace MoE models (R2/R3, arXiv 2510.11370; docs/routing_replay.md): a forward hook on
every supported router records its top-k experts or swaps in the recorded ones with the family's gates recomputed; a
pre-hook on the MoE block gives each call's [B, S], one on the decoder layer whether checkpointing will recompute it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trl_stable.moe.adapters import RouterAdapter, adapter_for, unsupported_error
from trl_stable.monitoring.reduction import Stat, reduce_metrics

_OWNER_ATTRIBUTE = "_trl_stable_routing_replay"
_COUNTERS = ("seen", "replayed", "agree")


def _owner(module: nn.Module) -> RoutingReplay | None:
    """The live RoutingReplay that hooked `module` itself (not a copy of it), if any."""
    ref = getattr(module, _OWNER_ATTRIBUTE, None)
    owner = ref() if ref is not None else None
    return owner if owner is not None and any(state.module is module for state in owner._states) else None


# Private but present since torch 1.13 (-1 outside a backward pass). Without it a recomputation cannot be told from a
# forward, so replay refuses gradient checkpointing instead of letting the recomputation route freely (silently wrong
# gradients).
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _fingerprint(router_logits: torch.Tensor) -> torch.Tensor:
    """One float per token (the sum of its router logits): tells which forward a checkpoint recomputation repeats."""
    return router_logits.detach().float().sum(dim=-1)


def _pop_matching(fifo: deque, router_logits: torch.Tensor, name: str) -> torch.Tensor:
    """Remove and return the experts of the pending ``(index, fingerprint)`` forward this recomputation repeats: among
    those of its token count, the closest fingerprint (a loss summed over several forwards recomputes out of order)."""
    tokens = router_logits.shape[0]
    candidates = [i for i, (index, _) in enumerate(fifo) if index.shape[0] == tokens]
    if not candidates:
        raise RuntimeError(
            f"Routing replay at router {name}: a gradient-checkpointing recomputation sees {tokens} tokens but no "
            f"pending forward had that many ({[i.shape[0] for i, _ in fifo]}). Call `clear()` after an aborted "
            f"step."
        )
    best = candidates[0]
    if len(candidates) > 1:
        fingerprint = _fingerprint(router_logits)
        best = min(candidates, key=lambda i: float((fifo[i][1].to(fingerprint.device) - fingerprint).abs().max()))
    index = fifo[best][0]
    del fifo[best]
    return index


def _take_rows(queue: deque, batch: int, seq_len: int, layer: str) -> torch.Tensor:
    """The next `batch` rows [batch, seq_len, k] of `queue` (router `layer`'s recorded [b_i, s_i, k] segments still
    to replay: one per recorded call or loaded batch), taken in order across segment borders."""
    parts, needed = [], batch
    while needed > 0:
        if not queue:
            raise ValueError(
                f"Routing replay ran out of recorded routing at router {layer}: a forward pass asked for {batch} "
                f"more sequences than were recorded or loaded. Fix: replay exactly the batch that was recorded, "
                f"or pass its routing tensor [B, S, layers, k] to `replay(routing)`."
            )
        segment = queue.popleft()
        if segment.shape[1] != seq_len:
            raise ValueError(
                f"Routing replay at router {layer}: the recorded routing has sequence length {segment.shape[1]} "
                f"but the forward pass has {seq_len}. Fix: pad or trim the routing tensor to the model input "
                f"(trl_stable.moe.pad_routing), or replay the same padded batch that was recorded."
            )
        parts.append(segment[:needed])
        needed -= parts[-1].shape[0]
        if segment.shape[0] > parts[-1].shape[0]:  # the rest of the segment is the next call's
            queue.appendleft(segment[parts[-1].shape[0] :])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


@dataclass
class _RouterState:
    """One hooked router: where it sits, what was recorded for it, and its agreement counters."""

    name: str
    module: nn.Module
    adapter: RouterAdapter
    block: nn.Module
    layer: nn.Module | None
    top_k: int
    num_experts: int
    shape: tuple[int, int] | None = None
    has_missing: bool = False
    will_recompute: bool = False
    record: list[torch.Tensor] = field(default_factory=list)
    queue: deque | None = None
    recompute_fifo: deque = field(default_factory=deque)
    agree: torch.Tensor | int = 0
    replayed: torch.Tensor | int = 0
    seen: int = 0


def _find_routers(model: nn.Module) -> list[_RouterState]:
    """A state for every router of a supported class in `model`, in module order (= layer order)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    modules = dict(model.named_modules())
    states = []
    for name, module in modules.items():
        adapter = adapter_for(module)
        if adapter is None:
            continue
        if _owner(module) is not None:
            raise ValueError(
                f"Router {name} is already hooked by another RoutingReplay. Fix: call `.remove()` on the old "
                f"RoutingReplay before creating a new one for the same model."
            )
        parent_name = name.rpartition(".")[0]
        prefix = parent_name  # up to the closest enclosing GradientCheckpointingLayer (the decoder layer), if any
        while prefix and not isinstance(modules[prefix], GradientCheckpointingLayer):
            prefix = prefix.rpartition(".")[0]
        block = modules[parent_name] if parent_name else module
        layer = modules[prefix] if prefix else None
        states.append(_RouterState(name, module, adapter, block, layer, int(module.top_k), int(module.num_experts)))
    return states


class RoutingReplay:
    """Record and replay the expert choices of every router of a HuggingFace MoE model as a routing tensor
    [B, S, num_moe_layers, k] (vLLM's `routed_experts` layout; rows of -1 keep the router's own choice).

    Args:
        model: A transformers MoE model (or a wrapper holding one, e.g. a PEFT model); every router of a supported
            class is hooked, and a model without any raises ValueError listing the supported classes.
        disable_router_jitter: Switch off training-time router input jitter (Mixtral's) inside `record` and `replay`,
            so a replayed pass matches the recorded one exactly.
    """

    def __init__(self, model: nn.Module, *, disable_router_jitter: bool = False):
        self.model = model
        self.disable_router_jitter = disable_router_jitter
        self._mode = "off"
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._jitter_off: dict[nn.Module, tuple[str, float]] = {}  # MoE block -> (jitter attribute, its value)
        self._states: list[_RouterState] = _find_routers(model)
        if not self._states:
            raise unsupported_error(model)
        top_ks = {s.top_k for s in self._states}
        if len(top_ks) != 1:
            raise ValueError(f"RoutingReplay needs one top-k for all routers, found {sorted(top_ks)}.")
        for state in self._states:
            # a weak reference: a deep copy of the model (e.g. a reference model) shares it and is not "owned"
            setattr(state.module, _OWNER_ATTRIBUTE, weakref.ref(self))
            self._handles.append(state.block.register_forward_pre_hook(self._block_pre_hook(state), with_kwargs=True))
            if state.layer is not None:
                self._handles.append(state.layer.register_forward_pre_hook(self._layer_pre_hook(state)))
            self._handles.append(state.module.register_forward_hook(self._router_hook(state)))
        max_experts = max(s.num_experts for s in self._states)
        self.storage_dtype = torch.int16 if max_experts <= torch.iinfo(torch.int16).max else torch.int32

    @property
    def num_layers(self) -> int:
        """Number of hooked routers (MoE layers), the third dimension of the routing tensor."""
        return len(self._states)

    @property
    def top_k(self) -> int:
        """Experts per token, the last dimension of the routing tensor."""
        return self._states[0].top_k

    @property
    def families(self) -> list[str]:
        """Model families of the hooked routers."""
        return sorted({s.adapter.family for s in self._states})

    @property
    def recorded_shapes(self) -> list[tuple[int, int]]:
        """[batch, seq] of each recorded call (or of the loaded tensor), as the first router saw them."""
        return [(int(t.shape[0]), int(t.shape[1])) for t in self._states[0].record]

    @property
    def has_routing(self) -> bool:
        """Whether routing was recorded or loaded (and not cleared)."""
        return any(s.record for s in self._states)

    @contextlib.contextmanager
    def record(self, *, append: bool = False) -> Iterator[RoutingReplay]:
        """Forward passes inside store each router's top-k experts (previous routing is dropped unless `append`)."""
        with self._in_mode("record"):
            if not append:
                for state in self._states:
                    state.record, state.has_missing = [], False
            yield self

    @contextlib.contextmanager
    def replay(self, routing: torch.Tensor | None = None) -> Iterator[RoutingReplay]:
        """Forward passes inside use the recorded experts (or `routing` [B, S, num_layers, k], which replaces them
        as `load` does), consuming its rows in batch order: one call on the whole batch, or consecutive chunks."""
        if routing is not None:
            self.load(routing)
        if not self.has_routing:
            raise ValueError("Nothing to replay: record a pass with `record()` or pass a routing tensor first.")
        with self._in_mode("replay"):
            for state in self._states:
                state.queue = deque(state.record)
            yield self

    @contextlib.contextmanager
    def _in_mode(self, mode: str) -> Iterator[None]:
        if self._mode != "off":
            raise RuntimeError(f"RoutingReplay is already in {self._mode!r} mode; contexts do not nest.")
        if not self._handles:
            raise RuntimeError("This RoutingReplay was removed; create a new one.")
        self._mode = mode
        for state in self._states if self.disable_router_jitter else ():
            # switch off each MoE block's router jitter, remembering its value (once, while already off)
            block, attribute = state.block, state.adapter.jitter_attribute
            if attribute is not None and hasattr(block, attribute) and block not in self._jitter_off:
                self._jitter_off[block] = (attribute, getattr(block, attribute))
                setattr(block, attribute, 0.0)
        try:
            yield
        finally:
            self._mode = "off"
            for state in self._states:
                state.shape, state.will_recompute, state.queue = None, False, None
            self._restore_jitter(only_settled=True)

    def _restore_jitter(self, only_settled: bool) -> None:
        """Give back the router jitter `disable_router_jitter` switched off; with `only_settled`, not yet to a block
        whose checkpointed forward awaits its backward recomputation (the router hook restores it after that)."""
        pending = {s.block for s in self._states if s.recompute_fifo} if only_settled else set()
        for block in [block for block in self._jitter_off if block not in pending]:
            setattr(block, *self._jitter_off.pop(block))

    def export(self, dim: str = "batch") -> torch.Tensor:
        """The recorded routing as a [B, S, num_layers, k] tensor (int16, or int32 beyond 32767 experts), successive
        calls joined along `dim`: "batch" for chunks of one batch (a chunked log-prob pass), "sequence" for the steps
        of one generation (prefill, then one row per decode step)."""
        if dim not in ("batch", "sequence"):
            raise ValueError(f"dim must be 'batch' or 'sequence', got {dim!r}.")
        if not self.has_routing:
            raise ValueError("No routing recorded: run forward passes inside `record()` first.")
        per_layer = []
        for state in self._states:
            if not state.record:
                raise ValueError(f"Router {state.name} recorded nothing (was it skipped by the forward pass?).")
            try:
                per_layer.append(torch.cat(state.record, dim=0 if dim == "batch" else 1))
            except RuntimeError as err:
                shapes = [tuple(t.shape[:2]) for t in state.record]
                raise ValueError(
                    f"Cannot join the recorded calls along {dim!r}: their [batch, seq] shapes are {shapes}. Fix: use "
                    f"dim='batch' for chunks of one batch, dim='sequence' for the steps of one generation."
                ) from err
        shapes = {tuple(t.shape) for t in per_layer}
        if len(shapes) != 1:
            raise ValueError(f"Routers recorded different shapes {sorted(shapes)}; record whole forward passes only.")
        return torch.stack(per_layer, dim=2)

    def load(self, routing: torch.Tensor) -> None:
        """Import a [B, S, num_layers, k] routing tensor (from `export`, or vLLM's `routed_experts`) to replay; -1
        entries keep the router's own choice."""
        routing = torch.as_tensor(routing)
        if routing.dim() != 4 or routing.shape[2] != self.num_layers or routing.shape[3] != self.top_k:
            raise ValueError(
                f"routing must have shape [B, S, num_layers={self.num_layers}, k={self.top_k}], got "
                f"{tuple(routing.shape)}."
            )
        if routing.is_floating_point() or routing.is_complex() or routing.dtype == torch.bool:
            raise ValueError(f"routing must hold integer expert indices, got dtype {routing.dtype}.")
        for layer, state in enumerate(self._states):
            rows = routing[:, :, layer, :]
            low = int(rows.min()) if rows.numel() else 0
            if rows.numel() and (int(rows.max()) >= state.num_experts or low < -1):
                raise ValueError(
                    f"routing for router {state.name} holds expert indices outside [-1, {state.num_experts - 1}]."
                )
            state.record = [rows.to(self.storage_dtype)]
            state.has_missing = low < 0

    def clear(self) -> None:
        """Drop the recorded routing, pending gradient-checkpointing entries and the metrics."""
        for state in self._states:
            state.record, state.queue, state.has_missing = [], None, False
            state.recompute_fifo.clear()
        self._restore_jitter(only_settled=False)
        self.reset_metrics()

    def remove(self) -> None:
        """Unhook every router; the model behaves as if RoutingReplay had never touched it."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for state in self._states:
            if _owner(state.module) is self:
                delattr(state.module, _OWNER_ATTRIBUTE)
        self.clear()

    def metrics(self, prefix: str = "routing/", accelerator: Any | None = None) -> dict[str, float]:
        """``{prefix}agreement`` (mean over layers, and ``/layer_{i}``) and ``{prefix}replayed_frac`` of the
        replayed passes since the last `reset_metrics` (docs/routing_replay.md, "Logged metrics"); empty when none
        ran. With `accelerator` (a collective) the counts of every process are summed first."""
        counts = {f"{i}/{w}": Stat.total(getattr(s, w)) for i, s in enumerate(self._states) for w in _COUNTERS}
        totals = reduce_metrics(counts, accelerator)
        seen, replayed, agree = ([totals[f"{i}/{w}"] for i in range(self.num_layers)] for w in _COUNTERS)
        if not any(n > 0 for n in seen):
            return {}
        out = {f"{prefix}agreement/layer_{i}": a / r for i, (a, r) in enumerate(zip(agree, replayed)) if r > 0}
        if out:
            out[f"{prefix}agreement"] = sum(out.values()) / len(out)
        out[f"{prefix}replayed_frac"] = sum(replayed) / sum(seen)
        return out

    def reset_metrics(self) -> None:
        """Zero the agreement counters."""
        for state in self._states:
            state.agree = state.replayed = state.seen = 0

    def _block_pre_hook(self, state: _RouterState):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            # `module is state.block`: a deep copy of the model carries the hook along
            if module is state.block and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
                shape = hidden.shape[:-1]
                state.shape = (int(shape[0]), int(shape[1])) if len(shape) == 2 else (1, int(shape[0]))

        return hook

    def _layer_pre_hook(self, state: _RouterState):
        def hook(module, args):
            # GradientCheckpointingLayer's own test that backward will run this forward again
            if module is state.layer:
                state.will_recompute = bool(
                    getattr(module, "gradient_checkpointing", False) and module.training and torch.is_grad_enabled()
                )

        return hook

    def _router_hook(self, state: _RouterState):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise RuntimeError(
                    f"Router {state.name} ({type(module).__name__}) returned {type(output).__name__}, not "
                    f"(router_logits, top_k_weights, top_k_index) as in transformers 5.x; this transformers "
                    f"version routes differently and routing replay does not support it yet."
                )
            if module is not state.module:
                return None
            router_logits, _, current = output
            if _current_graph_task_id is not None and _current_graph_task_id() != -1:
                # Inside backward: the recomputation of a checkpointed layer reuses what its forward used.
                if not state.recompute_fifo:
                    return None
                forced = _pop_matching(state.recompute_fifo, router_logits, state.name)
                if self._mode == "off":
                    self._restore_jitter(only_settled=True)
                return router_logits, state.adapter.gate(module, router_logits, forced), forced
            will_recompute, state.will_recompute = state.will_recompute, False
            shape, state.shape = state.shape, None
            if self._mode == "off":
                return None
            tokens = current.shape[0]
            batch, seq_len = shape if shape is not None and shape[0] * shape[1] == tokens else (1, tokens)
            if self._mode == "record":  # the router's own experts as [batch, seq, k] rows
                state.record.append(current.detach().to(self.storage_dtype).view(batch, seq_len, -1))
                if will_recompute:
                    state.recompute_fifo.append((current.detach(), _fingerprint(router_logits)))
                return None
            # replay: the next recorded rows as experts, the family's gates at those experts
            if will_recompute and _current_graph_task_id is None:
                raise RuntimeError(
                    "Routing replay with gradient checkpointing needs torch._C._current_graph_task_id (torch >= 1.13) "
                    "to replay the same experts when backward recomputes a layer. Fix: upgrade torch, or disable "
                    "gradient checkpointing."
                )
            rows = _take_rows(state.queue, batch, seq_len, state.name).reshape(tokens, -1)
            rows = rows.to(device=current.device, dtype=current.dtype)
            valid = (rows >= 0).all(dim=-1) if state.has_missing else None  # only loaded routing can hold -1 rows
            forced = rows if valid is None else torch.where(valid.unsqueeze(-1), rows, current)
            with torch.no_grad():  # this call's agreeing / replayed / seen token counts (kept on device)
                # the replayed experts are the router's own top-k set (indices within a row are distinct)
                same = (forced.unsqueeze(-1) == current.unsqueeze(-2)).any(dim=-1).all(dim=-1)
                state.agree = state.agree + (same.sum() if valid is None else (same & valid).sum())
                state.replayed = state.replayed + (tokens if valid is None else valid.sum())
                state.seen += tokens
            if will_recompute:
                state.recompute_fifo.append((forced, _fingerprint(router_logits)))
            return router_logits, state.adapter.gate(state.module, router_logits, forced), forced

        return hook
