"""Routed-experts arrays <-> base64 ``.npy`` (vLLM's wire format).

Decode on the client: ``np.load(io.BytesIO(base64.b64decode(s)))`` gives
``(rows, num_hidden_layers, top_k)``, uint8 when the model has at most 256
experts, else uint16.  ``routed_weights`` use the same format and the same
accumulator, in float32.

The other direction, a client's array in a request (``replay_routed_experts``),
goes through :func:`decode_int_array`: it trusts nothing in the bytes (base64
checked strictly, no pickled objects, the header's shape must match the data's
length before anything is allocated).

The engine sends UINT16 chunks (one per Triton response).  The accumulator
keeps references to them and, at the end, copies each chunk once, casting,
straight into the data area of a preallocated ``.npy`` buffer; that buffer is
then base64-encoded with pybase64.  No intermediate concatenation.

:class:`Payloads` puts those base64 bytes into a response's JSON body
without turning them into a Python ``str`` or running a JSON encoder over
them (base64 needs no escaping).
"""

from __future__ import annotations

import binascii
import io
import math
import secrets

import numpy as np
import pybase64


def npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The ``.npy`` v1.0 header np.save writes for a C-ordered array (64-byte aligned)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf,
        {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)},
    )
    return buf.getvalue()


def _npy_buffer(shape: tuple[int, ...], dtype: np.dtype) -> tuple[bytearray, np.ndarray]:
    """A bytearray holding a ``.npy`` file and a writable array view of its data."""
    header = npy_header(shape, dtype)
    count = int(np.prod(shape, dtype=np.int64))
    buf = bytearray(len(header) + count * np.dtype(dtype).itemsize)
    buf[: len(header)] = header
    view = np.frombuffer(buf, dtype=dtype, count=count, offset=len(header)).reshape(shape)
    return buf, view


def encode_npy_b64(arr: np.ndarray) -> str:
    """base64 of the bytes ``np.save(arr)`` would write (C order)."""
    arr = np.ascontiguousarray(arr)
    buf, view = _npy_buffer(arr.shape, arr.dtype)
    view[...] = arr
    return pybase64.b64encode(buf).decode("ascii")


def decode_routed_experts(encoded: str) -> np.ndarray:
    """Client-side decode, exactly as vLLM documents it."""
    return np.load(io.BytesIO(pybase64.b64decode(encoded)), allow_pickle=False)


class ArrayDecodeError(ValueError):
    """A request's base64 ``.npy`` field is not what it must be; the message says what is wrong."""

    code = "invalid_replay"  # the API's error code (its only use: a replay_routed_experts array)


def decode_int_array(encoded: object, ndim: int) -> np.ndarray:
    """base64 of ``.npy`` bytes holding an ``ndim``-D array of any integer dtype -> that array (read-only view).

    Raises :class:`ArrayDecodeError` for: not a string, not base64, not ``.npy``,
    a dtype that is not a plain integer (float, bool, object/pickled, structured),
    another number of dimensions, or data whose length disagrees with the header.
    The header is read before any allocation, so a header claiming a huge shape
    costs nothing (``np.load`` would allocate it first).
    """
    if not isinstance(encoded, str):
        raise ArrayDecodeError("must be a string: base64 of .npy bytes")
    try:
        raw = pybase64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ArrayDecodeError("is not valid base64") from None
    fp = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise ArrayDecodeError(f"is a .npy file of version {version[0]}.{version[1]}, which is not supported "
                                   "(np.save writes 1.0)")
    except ArrayDecodeError:
        raise
    except (ValueError, SyntaxError, TypeError, EOFError) as e:  # numpy's messages for a bad magic/header
        raise ArrayDecodeError(f"is not a .npy file ({e})") from None
    if dtype.hasobject or dtype.kind not in "iu" or dtype.fields is not None:
        raise ArrayDecodeError(f"must hold an integer array (any signed or unsigned integer dtype), got dtype {dtype}")
    if len(shape) != ndim:
        raise ArrayDecodeError(f"must be a {ndim}-D array, got {len(shape)}-D with shape {tuple(shape)}")
    count = math.prod(shape)
    data = memoryview(raw)[fp.tell() :]
    if len(data) != count * dtype.itemsize:
        raise ArrayDecodeError(f"holds {len(data)} bytes of data where its header (shape {tuple(shape)}, dtype "
                               f"{dtype}) says {count * dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype, count=count).reshape(shape, order="F" if fortran_order else "C")


class RoutedExpertsAccumulator:
    """Collects per-response routing chunks of one choice and encodes them once.

    Also used for ``routed_weights`` (float32 chunks, ``dtype=np.float32``).
    """

    __slots__ = ("num_layers", "top_k", "dtype", "_chunks", "rows")

    def __init__(self, num_layers: int, top_k: int, dtype: np.dtype) -> None:
        self.num_layers = num_layers
        self.top_k = top_k
        self.dtype = np.dtype(dtype)
        self._chunks: list[np.ndarray] = []
        self.rows = 0

    def add(self, chunk: np.ndarray | None) -> None:
        if chunk is None or chunk.size == 0:
            return
        if chunk.ndim != 3 or chunk.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"routing chunk has shape {chunk.shape}, "
                f"expected (rows, {self.num_layers}, {self.top_k})"
            )
        self._chunks.append(chunk)
        self.rows += chunk.shape[0]

    def to_array(self, max_rows: int | None = None) -> np.ndarray | None:
        """The concatenated array (first ``max_rows`` rows), or None if empty."""
        buf_view = self._fill(max_rows, into_npy=False)
        return None if buf_view is None else buf_view[1]

    def encode(self, max_rows: int | None = None) -> tuple[bytes | None, np.ndarray | None]:
        """(base64 of the .npy as ASCII bytes, array view) of the first ``max_rows`` rows.

        (None, None) when there is nothing.  The base64 stays ``bytes``: the
        API splices it into the JSON body as is (no str round trip).
        """
        filled = self._fill(max_rows, into_npy=True)
        if filled is None:
            return None, None
        buf, view = filled
        return pybase64.b64encode(buf), view

    @property
    def nbytes(self) -> int:
        return self.rows * self.num_layers * self.top_k * self.dtype.itemsize

    def _fill(self, max_rows: int | None, *, into_npy: bool):
        total = self.rows if max_rows is None else max(0, min(self.rows, max_rows))
        if total == 0:
            return None
        shape = (total, self.num_layers, self.top_k)
        if into_npy:
            buf, out = _npy_buffer(shape, self.dtype)
        else:
            buf, out = None, np.empty(shape, dtype=self.dtype)
        pos = 0
        for chunk in self._chunks:
            take = min(chunk.shape[0], total - pos)
            if take <= 0:
                break
            # One copy per chunk; uint16 -> uint8 cast happens here.
            np.copyto(out[pos : pos + take], chunk[:take], casting="unsafe")
            pos += take
        return buf, out


class Payloads:
    """Splices large base64 payloads (routed experts) into the JSON bytes of one response.

    Models carry a short placeholder string (with a per-request nonce) where
    the payload goes; :meth:`dump` serialises the small model and joins the
    payload bytes in at the placeholders in one pass.
    """

    __slots__ = ("_prefix", "_parts", "_n", "_raw")

    def __init__(self) -> None:
        self._prefix = f"@@routed-{secrets.token_hex(8)}:"
        self._parts: dict[bytes, bytes] = {}
        self._n = 0
        self._raw: set[bytes] = set()  # keys whose payload is JSON itself (spliced without the quotes)

    def ref(self, payload: bytes | None) -> str | None:
        """The placeholder to put in the model where ``payload`` goes (None stays None)."""
        if payload is None:
            return None
        key = f"{self._prefix}{self._n}@@"
        self._n += 1
        self._parts[key.encode()] = payload
        return key

    def raw(self, json_value: bytes | None) -> str | None:
        """The placeholder for an already serialised JSON value (an object, a list): spliced in as is, without
        quotes. Large logprob structures are serialised once (once per prompt, in a worker) and spliced."""
        key = self.ref(json_value)
        if key is not None:
            self._raw.add(key.encode())
        return key

    def dump(self, model, prefix: bytes = b"", suffix: bytes = b"") -> bytes:  # noqa: ANN001 - pydantic model
        """``prefix`` + the model's JSON with the payloads in place of their placeholders + ``suffix``."""
        # warnings off: a raw placeholder stands (as a string) where the model declares an object or a list
        body = model.model_dump_json(warnings=False).encode()
        if not self._parts:
            return prefix + body + suffix if prefix or suffix else body
        return b"".join(self._splice(body, prefix, suffix))

    def dump_parts(self, model) -> list[bytes]:  # noqa: ANN001 - pydantic model
        """The pieces ``dump`` would join (a large body is sent piece by piece, never copied whole)."""
        body = model.model_dump_json(warnings=False).encode()
        return self._splice(body, b"", b"") if self._parts else [body]

    def _splice(self, body: bytes, prefix: bytes, suffix: bytes) -> list[bytes]:
        marker = b'"' + self._prefix.encode()
        pieces = [prefix]
        pos = 0
        while (i := body.find(marker, pos)) >= 0:
            end = body.find(b'@@"', i + len(marker))
            key = body[i + 1 : end + 2]
            if key in self._raw:  # JSON itself: the quotes go
                pieces.append(body[pos:i])
                pieces.append(self._parts.pop(key))
                pos = end + 3
                continue
            pieces.append(body[pos : i + 1])  # up to and including the opening quote
            pieces.append(self._parts.pop(key))
            pos = end + 2  # the closing quote starts the next piece
        pieces.append(body[pos:])
        pieces.append(suffix)
        return pieces

    def sse(self, model) -> bytes:  # noqa: ANN001 - pydantic model
        """The model as one server-sent event."""
        return self.dump(model, b"data: ", b"\n\n")
