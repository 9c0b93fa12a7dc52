"""vLLM's tests/entrypoints/serve/disagg/test_return_routed_experts.py (now
scale_out/token_in_token_out/), adapted to this server: same payload, same
assertions, httpx.AsyncClient with the API key."""
from __future__ import annotations

import asyncio

import httpx

from .openai_helpers import assert_valid_routed_experts

GEN_ENDPOINT = "/inference/v1/generate"


def test_generate_routed_experts(moe_server):
    """Test that /inference/v1/generate returns routed_experts when enabled."""

    async def main():
        headers = {"Authorization": f"Bearer {moe_server.api_key}"}
        async with httpx.AsyncClient(base_url=moe_server.root_url, timeout=600, headers=headers) as client:
            payload = {
                "model": moe_server.model,
                "token_ids": [1, 2, 3],
                "sampling_params": {"max_tokens": 10, "temperature": 0.0},
                "stream": False,
            }
            resp = await client.post(GEN_ENDPOINT, json=payload)
            resp.raise_for_status()
            data = resp.json()

            choice = data["choices"][0]

            assert choice["routed_experts"] is not None
            assert choice["token_ids"] is not None

            # routed_experts is base64-encoded .npy bytes; decode to ndarray.
            assert_valid_routed_experts(choice["routed_experts"])

    asyncio.run(main())
