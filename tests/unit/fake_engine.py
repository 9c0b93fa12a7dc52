"""An in-process stand-in for the Triton model, following the same contract.

Used only by the frontend's unit tests (the integration tests run the real
tritonserver).  Routing rows are a known function of the absolute token
position, so tests can check row alignment exactly:
``row(pos)[layer][j] == (pos * 7 + layer * 3 + j) % num_experts``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from openai_frontend.triton_client import BackendError, BackendOutput, BackendRequest, ModelInfo


def routing_row(pos: int, num_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    layers = np.arange(num_layers)[:, None]
    slots = np.arange(top_k)[None, :]
    return ((pos * 7 + layers * 3 + slots) % num_experts).astype(np.uint16)


def routing_rows(start: int, stop: int, info: ModelInfo) -> np.ndarray:
    if stop <= start:
        return np.zeros((0, info.num_hidden_layers, info.num_experts_per_tok), np.uint16)
    return np.stack(
        [routing_row(p, info.num_hidden_layers, info.num_experts_per_tok, info.num_experts) for p in range(start, stop)]
    )


@dataclass
class FakeEngine:
    info: ModelInfo
    script: list[int]  # the token ids "generated", in a loop
    step_delay: float = 0.0
    requests: list[tuple[str, BackendRequest]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    fail_with: BackendError | None = None
    ready: bool = True

    async def model_info(self) -> ModelInfo:
        return self.info

    async def is_ready(self) -> bool:
        return self.ready

    async def close(self) -> None:
        pass

    def _token(self, req: BackendRequest, k: int) -> int:
        offset = 0
        if req.temperature not in (None, 0.0) and req.seed is not None:
            offset = req.seed % len(self.script)
        return self.script[(k + offset) % len(self.script)]

    async def generate(self, req: BackendRequest, request_id: str):
        self.requests.append((request_id, req))
        if self.fail_with is not None:
            raise self.fail_with
        info = self.info
        prompt = list(np.asarray(req.input_ids).tolist())
        n_prompt = len(prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else info.max_model_len - n_prompt
        if n_prompt + max_tokens > info.max_model_len:
            raise BackendError(BackendError.INVALID, "invalid argument: prompt + max_tokens exceeds max_model_len")
        routed = bool(req.return_routed_experts)
        start = req.routed_experts_prompt_start or 0
        stops = set(req.stop_token_ids or ())
        eos = set() if req.ignore_eos else set(info.eos_token_ids)
        min_tokens = req.min_tokens or 0
        pending = []  # non-streaming: everything in one response
        done = False
        try:
            forwarded = start  # next absolute position whose row has not been sent
            for k in range(max_tokens):
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                else:
                    await asyncio.sleep(0)
                tok = self._token(req, k)
                # This step forwarded positions [forwarded, n_prompt + k).
                rows = routing_rows(forwarded, n_prompt + k, info) if routed else None
                forwarded = n_prompt + k
                finish = ""
                if k + 1 >= min_tokens and (tok in stops or tok in eos):
                    finish = "stop"
                elif k + 1 == max_tokens:
                    finish = "length"
                out = BackendOutput(
                    output_ids=np.array([tok], np.int64),
                    routed_experts=rows,
                    finish_reason=finish or None,
                    num_prompt_tokens=n_prompt,
                    num_output_tokens=k + 1,
                )
                if req.logprobs is not None:
                    out.logprobs = np.array([-0.25 - 0.01 * k], np.float32)
                    n_top = req.logprobs
                    out.top_logprob_ids = np.array([[(tok + j) % info.vocab_size for j in range(n_top)]], np.int64)
                    out.top_logprobs = np.array([[-0.25 - j for j in range(n_top)]], np.float32)
                if req.stream:
                    if finish:
                        done = True
                    yield out
                else:
                    pending.append(out)
                if finish:
                    break
            if not req.stream:
                done = True
                yield _merge(pending)
            self.finished.append(request_id)
        finally:
            if not done:
                self.cancelled.append(request_id)


def _merge(outs: list[BackendOutput]) -> BackendOutput:
    last = outs[-1]
    rows = [o.routed_experts for o in outs if o.routed_experts is not None]
    merged = BackendOutput(
        output_ids=np.concatenate([o.output_ids for o in outs]),
        routed_experts=np.concatenate(rows) if rows else None,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
    )
    if last.logprobs is not None:
        merged.logprobs = np.concatenate([o.logprobs for o in outs])
        merged.top_logprob_ids = np.concatenate([o.top_logprob_ids for o in outs])
        merged.top_logprobs = np.concatenate([o.top_logprobs for o in outs])
    return merged
