"""The RL lifecycle endpoints' HTTP layer (openai_frontend/serving_weights.py) over a fake backend: SGLang bodies in,
the right control request out, SGLang's answer shape back with the right status. The real path (Triton, engine)
is tests/integration/test_rl_lifecycle.py."""
from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest

from openai_frontend.triton_client import BackendError
from tests.unit.conftest import SCRIPT_TEXT, ServerThread, make_model_info
from tests.unit.fake_engine import FakeEngine

KEY = "k"


@dataclass
class ControlledEngine(FakeEngine):
    """The fake backend, plus control requests: records them, answers what ``answers`` says (default success)."""

    controls: list = field(default_factory=list)
    answers: dict = field(default_factory=dict)
    version: str = "A"

    async def control(self, op, args, request_id=""):
        self.controls.append((op, args))
        answer = self.answers.get(op, {"success": True, "message": f"{op} done"})
        if isinstance(answer, Exception):
            raise answer
        return {"weight_version": self.version, **answer}


@pytest.fixture
def srv(fe_checkpoint_dir, fe_tokenizer):
    from openai_frontend.app import create_app
    from openai_frontend.config import FrontendConfig

    engine = ControlledEngine(info=make_model_info(), script=fe_tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))
    cfg = FrontendConfig(triton_grpc_url="unused:0", served_model_name="m", checkpoint_dir=fe_checkpoint_dir,
                         api_key=KEY)
    with ServerThread(create_app(cfg, engine=engine)) as s:
        s.engine = engine
        s.http = httpx.Client(base_url=s.root_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        yield s
        s.http.close()


def test_sglang_bodies_become_control_requests_with_their_defaults(srv):
    # Fields SGLang has that change nothing here are accepted (torch_empty_cache, recapture_cuda_graph, token_step).
    r = srv.http.post("/update_weights_from_disk", json={"model_path": "/ckpt/step-3", "torch_empty_cache": True,
                                                         "recapture_cuda_graph": True, "token_step": 3})
    assert r.status_code == 200
    assert r.json() == {"success": True, "message": "update_weights_from_disk done", "weight_version": "A",
                        "num_paused_requests": 0}
    r = srv.http.post("/update_weights_from_distributed", json={"names": ["a"], "dtypes": ["bfloat16"],
                                                                "shapes": [[2, 3]], "weight_version": "v2"})
    assert r.status_code == 200
    assert srv.http.post("/init_weights_update_group", json={"master_address": "10.0.0.1", "master_port": 29500,
                                                             "rank_offset": 1, "world_size": 2}).status_code == 200
    for path in ("/flush_cache", "/pause_generation", "/continue_generation", "/release_memory_occupation",
                 "/resume_memory_occupation"):
        assert srv.http.post(path).status_code == 200, path  # no body: SGLang's defaults
    assert srv.http.get("/flush_cache").status_code == 200
    assert srv.http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert srv.http.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert srv.engine.controls == [
        ("update_weights_from_disk", {"model_path": "/ckpt/step-3", "weight_version": None, "flush_cache": True,
                                      "abort_all_requests": False}),
        ("update_weights_from_distributed", {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, 3]],
                                             "group_name": "weight_update_group", "weight_version": "v2",
                                             "flush_cache": True, "abort_all_requests": False}),
        ("init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
                                       "world_size": 2, "group_name": "weight_update_group", "backend": "nccl"}),
        ("flush_cache", {}), ("pause_generation", {"mode": "abort"}), ("continue_generation", {}),
        ("release_memory_occupation", {"tags": None}), ("resume_memory_occupation", {"tags": None}),
        ("flush_cache", {}), ("release_memory_occupation", {"tags": ["kv_cache"]}),
        ("pause_generation", {"mode": "in_place"}),
    ]
    assert srv.http.get("/get_weight_version").json() == {"weight_version": "A"}
    assert srv.http.get("/v1/models").json()["data"][0]["weight_version"] == "A"


def test_the_model_card_states_the_engines_kv_block_size_and_survives_a_backend_that_cannot_tell(srv):
    """/v1/models asks the engine (get_engine_info) for what it decided at start: the KV block size (64 on Hopper,
    16 elsewhere), beside the weight version; a backend error leaves those fields null, never fails the card."""
    srv.engine.answers["get_engine_info"] = {"success": True, "message": "KV cache: 10 blocks x 64 tokens",
                                             "kv_block_size": 64, "num_kv_blocks": 10}
    card = srv.http.get("/v1/models/m").json()
    assert card["kv_block_size"] == 64 and card["weight_version"] == "A"
    assert srv.engine.controls[-1] == ("get_engine_info", {})
    srv.engine.answers["get_engine_info"] = BackendError(BackendError.UNAVAILABLE, "the engine is not running")
    r = srv.http.get("/v1/models")
    assert r.status_code == 200
    card = r.json()["data"][0]
    assert card["kv_block_size"] is None and card["weight_version"] is None and card["id"] == "m"
    assert card["deterministic_inference"] is None


def test_the_model_card_says_whether_deterministic_inference_is_on(srv):
    """--enable-deterministic-inference (or VLLM_BATCH_INVARIANT=1) is the engine's decision: /v1/models shows it
    (get_engine_info), so a trainer can check that its rollouts are batch-invariant before relying on it."""
    for on in (True, False):
        srv.engine.answers["get_engine_info"] = {"success": True, "message": "", "kv_block_size": 16,
                                                 "deterministic_inference": on}
        assert srv.http.get("/v1/models/m").json()["deterministic_inference"] is on


def test_the_model_card_says_what_the_kv_cache_holds(srv):
    """--kv-cache-dtype fp8: quantization.kv_cache is the engine's answer (fp8_e4m3, or auto for the model dtype)."""
    for kv in ("fp8_e4m3", "auto"):
        srv.engine.answers["get_engine_info"] = {"success": True, "message": "", "kv_block_size": 16,
                                                 "kv_cache_dtype": kv}
        assert srv.http.get("/v1/models/m").json()["quantization"]["kv_cache"] == kv


@pytest.mark.parametrize("path, body, param", [
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/x", "is_async": True}, "is_async"),
    ("/update_weights_from_disk", {"model_path": "/x", "load_format": "dummy"}, "load_format"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": 1, "rank_offset": 0, "world_size": 2},
     "rank_offset"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2,
                                    "backend": "mpi"}, "backend"),
    ("/pause_generation", {"mode": "sleep"}, "mode"),
    ("/release_memory_occupation", {"tags": ["gpu"]}, "tags[0]"),
])
def test_bad_bodies_are_400s_naming_the_field_and_reach_no_backend(srv, path, body, param):
    r = srv.http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert srv.engine.controls == []


def test_refusals_are_400_with_both_shapes_and_backend_states_map_to_status_codes(srv):
    srv.engine.answers["update_weights_from_disk"] = {"success": False, "param": "model_path",
                                                      "message": "tensor 'w' has shape [2], the model's is [3]"}
    r = srv.http.post("/update_weights_from_disk", json={"model_path": "/other"})
    assert r.status_code == 400
    body = r.json()
    assert body["success"] is False and body["weight_version"] == "A" and "tensor 'w'" in body["message"]
    assert body["error"]["message"] == body["message"] and body["error"]["param"] == "model_path"
    srv.engine.answers["flush_cache"] = BackendError(BackendError.UNAVAILABLE, "the engine is not running")
    r = srv.http.post("/flush_cache")
    assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
    srv.engine.answers["continue_generation"] = {"success": False, "message": "boom", "internal": True}
    assert srv.http.post("/continue_generation").status_code == 500


def test_every_lifecycle_endpoint_needs_the_api_key(srv):
    for path in ("/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
                 "/flush_cache", "/pause_generation", "/continue_generation", "/release_memory_occupation",
                 "/resume_memory_occupation", "/reset_prefix_cache", "/sleep", "/wake_up"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(srv.root_url + path, json={}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error", path
    assert httpx.get(srv.root_url + "/get_weight_version").status_code == 401
    assert httpx.get(srv.root_url + "/is_sleeping").status_code == 401
    assert srv.engine.controls == []


def test_vllm_names_run_the_same_operations(srv):
    """vLLM's /reset_prefix_cache, /sleep, /wake_up and /is_sleeping are the SGLang operations under other names."""
    assert srv.http.post("/reset_prefix_cache").status_code == 200
    assert srv.http.post("/sleep", params={"level": 2}).status_code == 200
    assert srv.http.post("/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")]).status_code == 200
    assert srv.http.post("/wake_up").status_code == 200
    assert srv.engine.controls == [("flush_cache", {}), ("release_memory_occupation", {"tags": None}),
                                   ("resume_memory_occupation", {"tags": ["weights", "kv_cache"]}),
                                   ("resume_memory_occupation", {"tags": None})]
    for params in ({"level": 3}, {"level": "deep"}):
        r = srv.http.post("/sleep", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == "level", params
    r = srv.http.post("/wake_up", params={"tags": "gpu"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
    assert len(srv.engine.controls) == 4  # refused before reaching the backend
    srv.engine.answers["is_sleeping"] = {"success": True, "message": "released: kv_cache", "is_sleeping": True}
    assert srv.http.get("/is_sleeping").json() == {"is_sleeping": True}
