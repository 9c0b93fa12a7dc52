"""Replay a rollout's routing in a Hugging Face transformers model, for training (forward and backward).

``with replay_routing(model, batch): loss = ...; loss.backward()`` forces every MoE router of ``model`` to the
batch's expert ids. Only the *selection* is replaced, as Megatron-Core's ``RouterReplay`` does: inside each router
the top-k over the experts returns the given ids, and everything else is the router's own code (logits, softmax or
sigmoid, correction bias, renormalisation, ``routed_scaling_factor``), so the combine weights are the router's
formula at those ids and gradients reach the router's weights through them. A group-limited router's group mask
only chooses experts: a replayed expert outside the chosen groups gets its own score, as in Megatron and on the
server (``replay_routed_experts``).

Supported: every router class of transformers whose forward returns ``(logits, weights, ids)`` and picks ids with
one ``torch.topk`` over ``[tokens, num_experts]`` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS in
transformers 5); any other is refused with :class:`ReplayError` rather than left to route on its own.

torch and transformers are imported only here (``import r3kit`` needs numpy alone).
"""

from __future__ import annotations

import re

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from .batch import DENSE_LAYER, MISSING_ROUTE, TrainerBatch
from .errors import DenseLayerError, ReplayError

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_TOPK = {torch.topk, torch.Tensor.topk}
_MASKED_FILL = {torch.masked_fill, torch.Tensor.masked_fill}


def find_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> the MoE router module of that layer (transformers' ``*TopKRouter`` /
    ``*TopkRouter``: ``mlp.gate``, GPT-OSS ``mlp.router``). Dense layers have none."""
    out: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if not type(module).__name__.lower().endswith("topkrouter"):
            continue
        m = _LAYER.search(name)
        if m is None:
            raise ReplayError(f"router {name!r} ({type(module).__name__}) is not inside a numbered layer")
        layer = int(m.group(1))
        if layer in out:
            raise ReplayError(f"layer {layer} has two routers ({name!r} and another): not a supported model")
        out[layer] = module
    return dict(sorted(out.items()))


def _router_shape(router: torch.nn.Module, model: torch.nn.Module) -> tuple[int, int]:
    cfg = getattr(model, "config", None)
    top_k = getattr(router, "top_k", None) or getattr(cfg, "num_experts_per_tok", None)
    experts = (getattr(router, "num_experts", None) or getattr(cfg, "num_local_experts", None)
               or getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None))
    if top_k is None or experts is None:
        raise ReplayError(f"cannot tell top_k / num_experts of router {type(router).__name__}")
    return int(top_k), int(experts)


def _as_long(x) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise ReplayError(f"routes must be integers, got dtype {x.dtype}")
        return torch.from_numpy(x.astype(np.int64))
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise ReplayError(f"routes must be integers, got dtype {x.dtype}")
        return x.detach().to(torch.int64)
    raise ReplayError(f"routes must be numpy arrays or torch tensors, got {type(x).__name__}")


def normalize_routes(routes, layers=None) -> dict[int, torch.Tensor]:
    """``{layer: int64 [tokens, top_k]}`` (tokens flattened batch-major, as transformers' routers see them) from a
    :class:`TrainerBatch`, an array ``[B, S, M, K]`` / ``[tokens, M, K]`` with ``layers`` (the decoder layer of
    each index of M), or a dict ``{layer: [B, S, K] or [tokens, K]}``."""
    if isinstance(routes, TrainerBatch):
        if layers is not None:
            raise ReplayError("a TrainerBatch names its layers itself (batch.layers); do not pass layers")
        dense = set(routes.dense_layers)
        return {layer: _as_long(routes.routed_experts[:, :, i]).reshape(-1, routes.top_k)
                for i, layer in enumerate(routes.layers) if layer not in dense}
    if isinstance(routes, dict):
        out = {}
        for layer, r in routes.items():
            t = _as_long(r)
            if t.dim() not in (2, 3):
                raise ReplayError(f"routes of layer {layer} must be [tokens, top_k] or [B, S, top_k], got "
                                  f"{tuple(t.shape)}")
            out[int(layer)] = t.reshape(-1, t.shape[-1])
        return out
    t = _as_long(routes)
    if layers is None:
        raise DenseLayerError(
            "routes as one array need layers=[the decoder layer of each index of its layer axis] (the model "
            "card's moe_layers): the kit never guesses which layers are dense")
    layers = [int(i) for i in layers]
    if t.dim() not in (3, 4) or t.shape[-2] != len(layers):
        raise ReplayError(f"routes of shape {tuple(t.shape)} do not have {len(layers)} layers (layers={layers}) "
                          "on their second-to-last axis: expected [B, S, M, K] or [tokens, M, K]")
    t = t.reshape(-1, len(layers), t.shape[-1])
    return {layer: t[:, i] for i, layer in enumerate(layers)}


class _TopKReplay(TorchFunctionMode):
    """Inside one router's forward: the top-k over [N, E] with k = top_k returns the given ids for replayed rows
    (values gathered from the top-k's input), and masking (``masked_fill``) leaves replayed rows unmasked."""

    def __init__(self, ids: torch.Tensor, replayed: torch.Tensor, num_experts: int, top_k: int):
        super().__init__()
        self.ids, self.replayed, self.E, self.K = ids, replayed, num_experts, top_k
        self.N = ids.shape[0]
        self.hits = 0

    def _rows(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() == 2 and tuple(t.shape) == (self.N, self.E)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TOPK:
            inp = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
            if self._rows(inp) and k == self.K and dim in (-1, 1) and largest:
                values, ids = func(*args, **kwargs)
                self.hits += 1
                ids = torch.where(self.replayed[:, None], self.ids, ids)
                return torch.return_types.topk((inp.gather(1, ids), ids))
        elif func in _MASKED_FILL and self._rows(args[0]):
            out = func(*args, **kwargs)
            return torch.where(self.replayed[:, None], args[0], out)
        return func(*args, **kwargs)


class RoutingReplay:
    """Forces the routers of ``model`` to ``routes`` while active (use :func:`replay_routing`).

    ``on_missing``: rows holding :data:`MISSING_ROUTE` (a sequence's last token, padding: no loss reads their
    outputs) route as the model's router chooses with ``"live"``, or raise with ``"error"``. Every other row is
    replayed; ``stats[layer]`` counts calls and rows. With gradient checkpointing, run ``backward`` inside the
    context: the recomputed forward replays the same ids (Megatron's REPLAY_BACKWARD).
    """

    def __init__(self, model: torch.nn.Module, routes, *, layers=None, on_missing: str = "live"):
        if on_missing not in ("live", "error"):
            raise ValueError(f"on_missing must be 'live' or 'error', got {on_missing!r}")
        self.model = model
        self.on_missing = on_missing
        self.routers = find_routers(model)
        if not self.routers:
            raise ReplayError(f"{type(model).__name__} has no MoE router r3kit knows (transformers' *TopKRouter)")
        self.shapes = {layer: _router_shape(r, model) for layer, r in self.routers.items()}
        self.stats: dict[int, dict[str, int]] = {}
        self._saved: dict[int, object] = {}
        self._active = False
        self.set_routes(routes, layers=layers)

    def set_routes(self, routes, layers=None) -> None:
        """Other routes (the next micro-batch) without leaving the context."""
        given = normalize_routes(routes, layers)
        dense = sorted(set(given) - set(self.routers))
        if dense:
            raise DenseLayerError(
                f"routes are given for layers {dense}, which have no router in this model (dense layers; MoE layers "
                f"are {sorted(self.routers)}). Drop them by the model card's moe_layers: a dense layer is never "
                "replayed as expert 0")
        missing = sorted(set(self.routers) - set(given))
        if missing:
            raise ReplayError(f"layers {missing} of the model route but no routes are given for them; they would "
                              "route on their own. Give every MoE layer (the card's moe_layers)")
        checked = {}
        for layer, ids in given.items():
            K, E = self.shapes[layer]
            if ids.shape[-1] != K:
                raise ReplayError(f"routes of layer {layer} have {ids.shape[-1]} ids per token; its router picks {K}")
            if (ids == DENSE_LAYER).any():
                raise DenseLayerError(f"routes of MoE layer {layer} hold DENSE_LAYER: routes of another model?")
            missing_rows = (ids == MISSING_ROUTE).all(-1)
            partial = (ids == MISSING_ROUTE).any(-1) & ~missing_rows
            if partial.any():
                raise ReplayError(f"layer {layer}, token {int(partial.nonzero()[0])}: some ids missing, some not")
            if self.on_missing == "error" and missing_rows.any():
                raise ReplayError(f"layer {layer}: {int(missing_rows.sum())} tokens have no route (MISSING_ROUTE: "
                                  "last tokens, padding) and on_missing='error'")
            valid = ids[~missing_rows]
            if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= E):
                raise ReplayError(f"routes of layer {layer} hold expert ids outside 0..{E - 1}")
            if K > 1 and valid.numel():
                s = valid.sort(-1).values
                if (s[:, 1:] == s[:, :-1]).any():
                    raise ReplayError(f"routes of layer {layer} repeat an expert within a token's top-{K}")
            checked[layer] = (ids.clamp_min(0), ~missing_rows)
        self._routes = checked
        self._on_device: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _for(self, layer: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        ids, replayed = self._routes[layer]
        if ids.shape[0] != n:
            raise ReplayError(
                f"the router of layer {layer} sees {n} tokens but the routes hold {ids.shape[0]}: routes must be "
                "[B, S] exactly as the input_ids of the forward (the batch's padding included)")
        key = (layer, device)
        if key not in self._on_device:
            self._on_device[key] = (ids.to(device), replayed.to(device))
        return self._on_device[key]

    def _wrap(self, layer: int, router: torch.nn.Module):
        original = router.forward
        K, E = self.shapes[layer]
        stats = self.stats.setdefault(layer, {"calls": 0, "replayed_rows": 0, "live_rows": 0})

        def forward(*args, **kwargs):
            hidden_states = args[0] if args else kwargs["hidden_states"]
            n = hidden_states.numel() // hidden_states.shape[-1]
            ids, replayed = self._for(layer, n, hidden_states.device)
            mode = _TopKReplay(ids, replayed, E, K)
            with mode:
                out = original(*args, **kwargs)
            if mode.hits != 1:
                raise ReplayError(
                    f"the router of layer {layer} ({type(router).__name__}) made {mode.hits} top-k selections over "
                    f"[{n} tokens, {E} experts] with k={K}; r3kit replays routers that make exactly one")
            stats["calls"] += 1
            done = int(replayed.sum())
            stats["replayed_rows"] += done
            stats["live_rows"] += n - done
            return out

        return forward

    def __enter__(self) -> "RoutingReplay":
        if self._active:
            raise ReplayError("this RoutingReplay is already active")
        for layer, router in self.routers.items():
            if getattr(router, "_r3kit_replay", False):
                raise ReplayError(f"layer {layer}'s router is already under another replay")
            self._saved[layer] = router.__dict__.get("forward")  # an instance-level forward (accelerate hooks)
            router.forward = self._wrap(layer, router)
            router._r3kit_replay = True
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for layer, router in self.routers.items():
            saved = self._saved.pop(layer, None)
            if saved is None:
                router.__dict__.pop("forward", None)
            else:
                router.forward = saved
            router.__dict__.pop("_r3kit_replay", None)
        self._active = False
        if exc_type is None:
            idle = [layer for layer in self.routers if not self.stats.get(layer, {}).get("calls")]
            if idle:
                raise ReplayError(
                    f"the routers of layers {idle} never ran under replay: no forward ran, or a fused kernel "
                    "replaced the MoE block (e.g. use_kernels=True): nothing was replayed there")


def replay_routing(model: torch.nn.Module, routes, *, layers=None, on_missing: str = "live") -> RoutingReplay:
    """Context manager: the routers of ``model`` pick ``routes``' experts during every forward (and the recompute
    of a checkpointed backward) inside it. ``routes``: a :class:`TrainerBatch` (its ``input_ids`` are the forward's
    input), an array ``[B, S, M, K]`` with ``layers``, or ``{layer: [B, S, K]}``."""
    return RoutingReplay(model, routes, layers=layers, on_missing=on_missing)


class capture_routing:
    """Context manager recording each router's own choice: ``ids[layer]`` = int64 ``[tokens, top_k]`` of the last
    forward (transformers' routers return ``(logits, weights, ids)``)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        self.ids: dict[int, torch.Tensor] = {}
        self.weights: dict[int, torch.Tensor] = {}
        self._hooks = []

    def __enter__(self) -> "capture_routing":
        for layer, router in self.routers.items():
            def hook(_module, _inputs, output, layer=layer):
                self.weights[layer] = output[1].detach().float().clone()
                self.ids[layer] = output[2].detach().to(torch.int64).clone()

            self._hooks.append(router.register_forward_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
