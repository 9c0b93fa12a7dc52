"""``replay_routed_experts`` against the model and the prompt: what the engine is asked to force.

The request field arrives decoded (:func:`.routing_codec.decode_int_array`:
a 3-D array of any integer dtype).  Here it must be the routing of this
prompt on this model, exactly as the server returns ``routed_experts``:

- shape ``[R, num_hidden_layers, top_k]`` with ``1 <= R <= prompt tokens`` (row i
  forces the experts of the token at absolute position i; positions past R
  route normally);
- in every MoE layer, ids in ``0..num_experts-1`` and no id twice in a row.
  Rows of dense layers are ignored (the server returns 0 there).

The backend's engine checks the same for Triton clients; checking here too
gives the 400 a ``param`` and costs no Triton round trip.
"""

from __future__ import annotations

import numpy as np

from .errors import BadRequestError
from .triton_client import ModelInfo


def check_replay(arr: np.ndarray, num_prompt: int, model: ModelInfo, param: str) -> np.ndarray:
    """The int32 array to send (dense layers zeroed), or :class:`BadRequestError` naming ``param``."""
    L, K, E = model.num_hidden_layers, model.num_experts_per_tok, model.num_experts
    R = arr.shape[0]
    if arr.shape[1:] != (L, K):
        raise BadRequestError(
            f"`{param}` has shape {tuple(arr.shape)}; expected (rows, {L}, {K}): (rows <= {num_prompt} prompt "
            f"tokens, num_hidden_layers, top_k), as the server returns routed_experts.",
            param=param, code="invalid_replay",
        )
    if R == 0:
        raise BadRequestError(f"`{param}` has no rows; send at least the first prompt token's, or leave it out.",
                              param=param, code="invalid_replay")
    if R > num_prompt:
        raise BadRequestError(
            f"`{param}` has {R} rows but the prompt has {num_prompt} tokens: row i forces the experts of prompt "
            f"token i, so at most {num_prompt} rows.",
            param=param, code="invalid_replay",
        )
    out = np.zeros((R, L, K), dtype=np.int32)
    moe = list(model.moe_layers)
    if not moe:
        return out
    ids = arr[:, moe]  # [R, M, K] in the client's dtype (no cast before the range check: no wrap-around)
    bad = (ids < 0) | (ids >= E)
    if bad.any():
        r, m, k = (int(i) for i in np.argwhere(bad)[0])
        raise BadRequestError(
            f"`{param}`[{r}, {moe[m]}, {k}] is expert id {int(ids[r, m, k])}; ids must be in 0..{E - 1} "
            f"(the model has {E} experts).",
            param=param, code="invalid_replay",
        )
    ids = ids.astype(np.int32)
    if K > 1:
        s = np.sort(ids, axis=-1)
        repeated = (s[..., 1:] == s[..., :-1]).any(axis=-1)  # [R, M]
        if repeated.any():
            r, m = (int(i) for i in np.argwhere(repeated)[0])
            raise BadRequestError(
                f"`{param}`[{r}, {moe[m]}] repeats an expert id ({ids[r, m].tolist()}); the top_k ids of a row "
                f"must be distinct.",
                param=param, code="invalid_replay",
            )
    out[:, moe] = ids
    return out
