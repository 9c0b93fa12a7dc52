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
    # Reliability and security (README "Security", "Health, failures and shutdown").
    triton_headers: dict[str, str] | None = None  # moe-serve's Triton key, sent with every gRPC call
    triton_metrics_url: str | None = None  # Triton's metrics (loopback): engine gauges copied into /metrics
    max_request_bytes: int | None = 16 * 2**20  # bodies over this get 413; None = no limit
    request_timeout_s: float | None = 3600.0  # a generation request running longer gets 504; None = no limit
    trust_request_chat_template: bool = False  # accept `chat_template` in requests (as vLLM's flag)
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (as vLLM's flag)
    # Logprob entries one response may carry at most (bounded.py); None = no limit.
    max_response_logprobs: int | None = 1 << 20
    # /dump_expert_distribution_record also writes its record here (.npy + .json); None: only in the response.
    expert_distribution_recorder_dir: str | None = None
