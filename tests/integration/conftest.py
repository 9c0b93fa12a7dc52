"""One real `moe-serve` (tritonserver + moe backend + OpenAI API) per test session.

Started as a user would start it (the installed console script), on the embedded
tiny model, with free ports; every integration test shares it.
"""
from __future__ import annotations

import pytest

from openai_frontend.server_process import ServerProcess, start_server

API_KEY = "test-key-123"
MAX_MODEL_LEN = 1024


def start_moe_serve(tmp_dir, extra_args=()) -> ServerProcess:
    return start_server(tmp_dir, ["--max-model-len", str(MAX_MODEL_LEN), *extra_args], api_key=API_KEY)


def stop_moe_serve(server: ServerProcess) -> int:
    return server.stop()


@pytest.fixture(scope="session")
def moe_server(tmp_path_factory, tiny_checkpoint):
    server = start_moe_serve(tmp_path_factory.mktemp("moe_serve"))
    server.checkpoint_dir = str(tiny_checkpoint)
    yield server
    code = server.stop()
    assert code == 0, f"moe-serve exited with {code} on SIGTERM:\n{server.log_tail()}"


@pytest.fixture(scope="session")
def openai_client(moe_server):
    import openai

    return openai.OpenAI(base_url=moe_server.base_url, api_key=moe_server.api_key, max_retries=0, timeout=120)
