"""vLLM's tests/entrypoints/openai/test_return_routed_experts.py, adapted to this server.

Same request and same assertions (async client, completions, return_token_ids,
routed_experts decoded with the documented one-liner); the module-scoped
RemoteOpenAIServer becomes the session's real moe-serve.
"""
from __future__ import annotations

import asyncio

import openai

from .openai_helpers import assert_valid_routed_experts


def test_routed_experts(moe_server):
    """Test that /v1/completions returns routed_experts when enabled."""

    async def main():
        async with openai.AsyncOpenAI(base_url=moe_server.base_url, api_key=moe_server.api_key,
                                      max_retries=0) as client:
            result = await client.completions.create(
                model=moe_server.model,
                prompt="Hello, world",
                max_tokens=10,
                temperature=0,
                extra_body={"return_token_ids": True},
            )

            choice = result.model_dump()["choices"][0]

            assert choice["token_ids"] is not None
            assert_valid_routed_experts(choice["routed_experts"])

    asyncio.run(main())
