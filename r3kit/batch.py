"""A trainer's batch of rollouts: tokens, masks, logprobs and routes ``[batch, seq, moe_layers, top_k]``.

Positions without a row hold :data:`MISSING_ROUTE` and ``route_mask`` is False there: the last token of each
sequence (it was sampled, never forwarded) and the padding. Dense layers are dropped (the layer axis lists
``batch.layers``, the model card's ``moe_layers``), or kept as :data:`DENSE_LAYER` with ``layers="all"``; a
dense layer is never handed to a trainer as expert 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .card import ModelCard
from .conversation import Conversation
from .errors import DenseLayerError, R3Error, RowMismatchError
from .response import Turn, check_against_card

MISSING_ROUTE = -1
"""The id in every slot of a position that has no row: a sequence's last token, padding."""

DENSE_LAYER = -2
"""The id in every slot of a dense (non-MoE) layer, with ``build_batch(..., layers="all")``."""


@dataclass
class TrainerBatch:
    input_ids: np.ndarray  # [B, S] int64, pad_token_id after each sequence (right padding)
    attention_mask: np.ndarray  # [B, S] int64, 1 on tokens
    routed_experts: np.ndarray  # [B, S, M, K] int16 (int32 beyond 32767 experts); MISSING_ROUTE where no row
    route_mask: np.ndarray  # [B, S] bool: the position has a row (every token but the last, no padding)
    loss_mask: np.ndarray  # [B, S] bool: generated tokens
    rollout_logprobs: np.ndarray  # [B, S] float32: the server's logprob of each generated token, 0 elsewhere
    lengths: np.ndarray  # [B] tokens per sequence
    layers: tuple[int, ...]  # the decoder layer of each index of the M axis
    num_experts: int
    top_k: int
    routed_weights: np.ndarray | None = None  # [B, S, M, K] float32 combine weights (0 without a row)
    dense_layers: tuple[int, ...] = ()  # layers on the M axis that are dense (only with layers="all")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        dense = set(self.dense_layers)
        return tuple(layer for layer in self.layers if layer not in dense)

    def layer_routes(self, layer: int) -> np.ndarray:
        """``[B, S, K]`` routes of decoder layer ``layer``."""
        if layer not in self.layers:
            raise DenseLayerError(f"layer {layer} is not among the batch's layers {list(self.layers)}")
        return self.routed_experts[:, :, self.layers.index(layer)]

    def to_torch(self, device=None) -> dict:
        """Every array as a torch tensor (routes as int64, ready for ``gather`` / ``scatter``)."""
        import torch

        out = {
            "input_ids": torch.as_tensor(self.input_ids, device=device),
            "attention_mask": torch.as_tensor(self.attention_mask, device=device),
            "routed_experts": torch.as_tensor(self.routed_experts.astype(np.int64), device=device),
            "route_mask": torch.as_tensor(self.route_mask, device=device),
            "loss_mask": torch.as_tensor(self.loss_mask, device=device),
            "rollout_logprobs": torch.as_tensor(self.rollout_logprobs, device=device),
        }
        if self.routed_weights is not None:
            out["routed_weights"] = torch.as_tensor(self.routed_weights, device=device)
        return out

    def megatron_replay_data(self, layout: str = "sbh", fill_missing: str = "arange", as_torch: bool = False):
        """One ``[tokens, top_k]`` int64 array per MoE layer, in layer order: what Megatron-Core's
        ``RouterReplay.set_replay_data`` takes (its router instances are created in that order; under pipeline
        parallelism give each stage its own layers' slice).

        ``layout``: how the trainer flattens tokens. ``"sbh"`` (Megatron's [seq, batch, hidden]: token
        ``s * B + b``), ``"bsh"`` (token ``b * S + s``), ``"thd"`` (packed: each sequence's own tokens one after
        the other, no padding).
        ``fill_missing``: positions without a row (each sequence's last token, padding) must hold valid ids for
        stock RouterReplay: ``"arange"`` puts experts ``0..top_k-1`` there (no loss reads those outputs: the last
        token predicts nothing, padding is masked); ``"keep"`` leaves :data:`MISSING_ROUTE` for routers that fall
        back to their own choice on such rows.
        """
        if fill_missing not in ("arange", "keep"):
            raise ValueError(f"fill_missing must be 'arange' or 'keep', got {fill_missing!r}")
        moe_idx = [i for i, layer in enumerate(self.layers) if layer not in set(self.dense_layers)]
        r = self.routed_experts[:, :, moe_idx].astype(np.int64)  # [B, S, M, K]
        if fill_missing == "arange":
            r = np.where(self.route_mask[:, :, None, None], r, np.arange(self.top_k, dtype=np.int64))
        B, S, M, K = r.shape
        if layout == "sbh":
            flat = r.transpose(1, 0, 2, 3).reshape(S * B, M, K)
        elif layout == "bsh":
            flat = r.reshape(B * S, M, K)
        elif layout == "thd":
            flat = np.concatenate([r[b, : int(n)] for b, n in enumerate(self.lengths)]) if B else r.reshape(0, M, K)
        else:
            raise ValueError(f"layout must be 'sbh', 'bsh' or 'thd', got {layout!r}")
        per_layer = [np.ascontiguousarray(flat[:, m]) for m in range(M)]
        if as_torch:
            import torch

            return [torch.from_numpy(a) for a in per_layer]
        return per_layer


def _as_sequence(seq) -> Conversation:
    if isinstance(seq, Conversation):
        return seq
    if isinstance(seq, Turn):
        if seq.prompt_start:
            raise RowMismatchError(
                f"a turn requested with routed_experts_prompt_start={seq.prompt_start} has no rows for positions "
                f"0..{seq.prompt_start - 1}: stitch it into the Conversation that holds them (Conversation.add)")
        conv = Conversation(card=seq.card)
        conv.add(seq)
        return conv
    raise TypeError(f"expected a Conversation or a Turn, got {type(seq).__name__}")


def _route_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.int16) if num_experts <= np.iinfo(np.int16).max else np.dtype(np.int32)


def build_batch(sequences, card: ModelCard | None = None, *, pad_token_id: int = 0, pad_to: int | None = None,
                layers: str = "moe") -> TrainerBatch:
    """Right-padded batch of ``sequences`` (:class:`Conversation` or :class:`Turn` each).

    ``card``: the model card (default: the sequences'); required, since only it tells dense layers apart.
    ``layers``: ``"moe"`` (the M axis is ``card.moe_layers``) or ``"all"`` (every decoder layer; dense ones hold
    :data:`DENSE_LAYER`). ``pad_to``: the sequence length S (default: the longest sequence).
    """
    convs = [_as_sequence(s) for s in sequences]
    if not convs:
        raise R3Error("no sequences")
    cards = {c.card for c in convs if c.card is not None}
    if card is None:
        if len(cards) != 1:
            raise DenseLayerError(
                "build_batch needs the model card (ModelCard.fetch(base_url)): only its moe_layers tell dense "
                "layers (rows of 0) from expert 0" if not cards else "the sequences come from different models")
        card = cards.pop()
    if layers not in ("moe", "all"):
        raise ValueError(f"layers must be 'moe' or 'all', got {layers!r}")
    lengths = np.array([len(c.tokens) for c in convs], dtype=np.int64)
    S = int(lengths.max()) if pad_to is None else int(pad_to)
    if S < lengths.max():
        raise R3Error(f"pad_to={S} is shorter than the longest sequence ({int(lengths.max())} tokens): cut "
                      "sequences with Conversation.truncate (tokens and rows together) first")
    B, K = len(convs), card.top_k
    axis = tuple(card.moe_layers) if layers == "moe" else tuple(range(card.num_hidden_layers))
    dtype = _route_dtype(card.num_experts)
    routes = np.full((B, S, len(axis), K), MISSING_ROUTE, dtype=dtype)
    weights_all = all(c.routed_weights is not None for c in convs)
    weights = np.zeros((B, S, len(axis), K), dtype=np.float32) if weights_all else None
    input_ids = np.full((B, S), pad_token_id, dtype=np.int64)
    attention = np.zeros((B, S), dtype=np.int64)
    route_mask = np.zeros((B, S), dtype=bool)
    loss_mask = np.zeros((B, S), dtype=bool)
    logprobs = np.zeros((B, S), dtype=np.float32)
    for b, conv in enumerate(convs):
        n = len(conv.tokens)
        rows = conv.routed_experts
        check_against_card(rows, card)
        routes[b, : n - 1] = rows[:, list(axis)]
        if weights is not None:
            weights[b, : n - 1] = conv.routed_weights[:, list(axis)]
        input_ids[b, :n] = conv.tokens
        attention[b, :n] = 1
        route_mask[b, : n - 1] = True
        gen = conv.generated_mask
        loss_mask[b, :n] = gen
        lp = conv.logprobs
        logprobs[b, :n] = np.where(gen & ~np.isnan(lp), lp, 0.0)
    if layers == "all" and card.dense_layers:
        routes[:, :, list(card.dense_layers)] = DENSE_LAYER
    return TrainerBatch(input_ids=input_ids, attention_mask=attention, routed_experts=routes, route_mask=route_mask,
                        loss_mask=loss_mask, rollout_logprobs=logprobs, lengths=lengths, layers=axis,
                        num_experts=card.num_experts, top_k=K, routed_weights=weights,
                        dense_layers=tuple(card.dense_layers) if layers == "all" else ())
