"""Frontend configuration (the contract with ``openai_frontend.cli``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FrontendConfig:
    triton_grpc_url: str  # e.g. "127.0.0.1:8001"
    served_model_name: str
    checkpoint_dir: str  # HF dir: tokenizer.json, tokenizer_config.json, config.json
    triton_model_name: str = "moe"
    api_key: str | None = None  # when set, /v1 and /inference need "Authorization: Bearer <key>"
    enable_routed_experts: bool = True  # server-wide switch; False -> routed_experts always null
    max_pending_requests: int = 256  # in-flight choices; over this -> 503 + Retry-After
    # Extra knobs (defaults keep the CLI contract unchanged).
    retry_after_s: int = 1  # Retry-After header value on overload
    max_logprobs: int = 20  # upper bound for logprobs / top_logprobs
    startup_timeout_s: float = 120.0  # how long to keep polling Triton for the model at start
