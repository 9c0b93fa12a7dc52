"""What the kit needs to know about the served model: ``GET /v1/models``' card."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field

from .errors import DenseLayerError, R3Error


def as_dict(obj) -> dict:
    """A JSON object from a dict, a JSON string / bytes, or an SDK (pydantic) object."""
    if isinstance(obj, dict):
        return obj
    if isinstance(obj, (str, bytes, bytearray)):
        return json.loads(obj)
    if hasattr(obj, "model_dump"):  # openai SDK objects keep the server's extra fields in the dump
        return obj.model_dump()
    raise TypeError(f"expected a response dict, JSON or an SDK object, got {type(obj).__name__}")


@dataclass(frozen=True)
class ModelCard:
    """The layer layout of a served MoE model.

    ``moe_layers`` are the decoder layers that route; the server's ``routed_experts`` has a row for every one of
    the ``num_hidden_layers`` (dense ones hold 0, which is *not* expert 0).
    """

    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    id: str = field(default="", compare=False)  # equality = the same layer layout
    weight_version: str | None = field(default=None, compare=False)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        moe = tuple(int(i) for i in self.moe_layers)
        object.__setattr__(self, "moe_layers", moe)
        if not moe:
            raise DenseLayerError(f"model {self.id!r} lists no MoE layers: it has no routing to replay")
        if sorted(set(moe)) != list(moe) or moe[0] < 0 or moe[-1] >= self.num_hidden_layers:
            raise R3Error(f"moe_layers {list(moe)} must be distinct, ascending, in 0..{self.num_hidden_layers - 1}")

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.moe_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in moe)

    @classmethod
    def from_dict(cls, card) -> "ModelCard":
        """One entry of ``/v1/models`` (a dict or an openai SDK ``Model``)."""
        d = as_dict(card)
        missing = [k for k in ("num_hidden_layers", "moe_layers", "num_experts") if d.get(k) is None]
        top_k = d.get("num_experts_per_tok", d.get("top_k"))
        if top_k is None:
            missing.append("num_experts_per_tok")
        if missing:
            raise R3Error(
                f"the model card of {d.get('id')!r} has no {', '.join(missing)}: not a moe-serve card. Build "
                "ModelCard(num_hidden_layers=..., moe_layers=[...], num_experts=..., top_k=...) from the model's "
                "config.json (moe_layers: the layers with a router; never guess them, dense layers hold 0)")
        return cls(num_hidden_layers=int(d["num_hidden_layers"]), moe_layers=tuple(d["moe_layers"]),
                   num_experts=int(d["num_experts"]), top_k=int(top_k), id=str(d.get("id") or ""),
                   weight_version=d.get("weight_version"), extra=d)

    @classmethod
    def from_models_response(cls, response, model: str | None = None) -> "ModelCard":
        """The card of ``model`` (or the only one) out of a whole ``GET /v1/models`` answer."""
        data = as_dict(response).get("data") or []
        cards = [c for c in (as_dict(c) for c in data) if model is None or c.get("id") == model]
        if len(cards) != 1:
            ids = [as_dict(c).get("id") for c in data]
            raise R3Error(f"/v1/models serves {ids}; name the model (model=...)" if cards else
                          f"model {model!r} is not among the served models {ids}")
        return cls.from_dict(cards[0])

    @classmethod
    def fetch(cls, base_url: str, model: str | None = None, api_key: str | None = None,
              timeout: float = 30.0) -> "ModelCard":
        """``GET {base_url}/models`` (``base_url`` as the openai SDK's, ending in ``/v1``)."""
        req = urllib.request.Request(base_url.rstrip("/") + "/models")
        if api_key:
            req.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return cls.from_models_response(json.loads(r.read()), model)
