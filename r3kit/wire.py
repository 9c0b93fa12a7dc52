"""The wire format: base64 of ``.npy`` bytes (vLLM's), decoded without pickle and checked."""

from __future__ import annotations

import binascii
import io

import numpy as np

try:  # pybase64 is ~3x faster on large arrays; the standard library does the same
    import pybase64 as _b64
except ImportError:  # pragma: no cover - depends on the environment
    import base64 as _b64

from .errors import R3Error


def decode_array(encoded: str | bytes, field: str = "routed_experts") -> np.ndarray:
    """base64 ``.npy`` -> array, as ``np.load(io.BytesIO(base64.b64decode(s)))`` with pickles refused."""
    if not isinstance(encoded, (str, bytes)):
        raise R3Error(f"`{field}` must be a base64 string of .npy bytes, got {type(encoded).__name__}")
    try:
        raw = _b64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise R3Error(f"`{field}` is not valid base64") from None
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise R3Error(f"`{field}` is not a .npy array ({e})") from None


def encode_array(arr: np.ndarray) -> str:
    """array -> base64 ``.npy`` (what the server sends; what ``replay_routed_experts`` takes)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return _b64.b64encode(buf.getvalue()).decode("ascii")
