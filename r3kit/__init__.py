"""r3kit: from a moe-serve response to a trainer's routing replay (Rollout Routing Replay, R3).

numpy only at import; :mod:`r3kit.hf_replay` and :mod:`r3kit.mismatch` need torch and transformers.

    card = ModelCard.fetch("http://127.0.0.1:9000/v1")          # num layers, moe_layers, experts, top-k
    conv = Conversation(card)
    conv.add(client.completions.create(..., extra_body=conv.request_fields()))   # every turn
    batch = build_batch([conv])                                   # [B, S, moe_layers, top_k] + masks
    with replay_routing(hf_model, batch): loss = ...; loss.backward()   # from r3kit.hf_replay
"""

from .batch import DENSE_LAYER, MISSING_ROUTE, TrainerBatch, build_batch
from .card import ModelCard
from .conversation import Conversation
from .errors import (AbortedChoiceError, DenseLayerError, MissingRoutedExpertsError, MissingTokenIdsError,
                     MultipleChoicesError, R3Error, ReplayError, RowMismatchError, StitchError,
                     TruncatedChoiceError)
from .response import StreamCollector, Turn, collect_stream, turn_from_response, turns_from_response
from .wire import decode_array, encode_array

__all__ = [
    "DENSE_LAYER", "MISSING_ROUTE", "AbortedChoiceError", "Conversation", "DenseLayerError",
    "MissingRoutedExpertsError", "MissingTokenIdsError", "ModelCard", "MultipleChoicesError", "R3Error",
    "ReplayError", "RowMismatchError", "StitchError", "StreamCollector", "TrainerBatch", "TruncatedChoiceError",
    "Turn", "build_batch", "collect_stream", "decode_array", "encode_array", "turn_from_response",
    "turns_from_response",
]
__version__ = "0.1.0"


def __getattr__(name):  # r3kit.hf_replay / r3kit.mismatch on first use: torch is imported only then
    if name in ("hf_replay", "mismatch"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'r3kit' has no attribute {name!r}")
