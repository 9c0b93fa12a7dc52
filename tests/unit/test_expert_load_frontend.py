"""The expert-load endpoints' HTTP layer (openai_frontend/serving_expert_load.py) over a fake backend: SGLang's
recorder endpoints (names, methods, text answers, behind the key), the dump with its axes named (JSON, .npy, files),
and the dashboard's page (open, every asset shipped here) and data (behind the key). The real path is
tests/integration/test_expert_load.py."""
from __future__ import annotations

import base64
import io
import json
import re
from dataclasses import dataclass

import httpx
import numpy as np
import pytest

from tests.unit.conftest import SCRIPT_TEXT, ServerThread, make_model_info
from tests.unit.test_serving_weights import ControlledEngine

KEY = "k"
COUNTS = np.arange(12, dtype=np.int64).reshape(2, 6)


def npy_b64(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a)
    return base64.b64encode(buf.getvalue()).decode()


@dataclass
class LoadEngine(ControlledEngine):
    def __post_init__(self):
        self.answers.update({
            "start_expert_distribution_record": {"success": True, "message": "Start recording the expert distribution."},
            "stop_expert_distribution_record": {"success": True, "message": "Stop recording the expert distribution."},
            "dump_expert_distribution_record": {
                "success": True, "message": "Dump expert distribution record.", "mode": "stat",
                "dims": ["layer", "expert"], "layers": [1, 3], "num_experts": 6, "top_k": 2, "num_steps": 4,
                "num_tokens": 33, "logical_count_npy": npy_b64(COUNTS)},
            "get_expert_load": {"success": True, "enabled": True, "layers": [1, 3], "num_experts": 6},
        })


@pytest.fixture
def srv(fe_checkpoint_dir, fe_tokenizer, tmp_path):
    from openai_frontend.app import create_app
    from openai_frontend.config import FrontendConfig

    engine = LoadEngine(info=make_model_info(), script=fe_tokenizer.encode(SCRIPT_TEXT, add_special_tokens=False))
    cfg = FrontendConfig(triton_grpc_url="unused:0", served_model_name="m", checkpoint_dir=fe_checkpoint_dir,
                         api_key=KEY, expert_distribution_recorder_dir=str(tmp_path / "dumps"))
    with ServerThread(create_app(cfg, engine=engine)) as s:
        s.engine, s.dumps = engine, tmp_path / "dumps"
        s.http = httpx.Client(base_url=s.root_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        yield s
        s.http.close()


def test_recorder_endpoints_answer_as_sglang_and_need_the_key(srv):
    for path in ("/start_expert_distribution_record", "/stop_expert_distribution_record",
                 "/dump_expert_distribution_record"):
        assert httpx.post(srv.root_url + path).status_code == 401  # no key: refused before the backend
    assert srv.engine.controls == []
    for method in ("POST", "GET"):  # SGLang's api_route takes both
        r = srv.http.request(method, "/start_expert_distribution_record")
        assert (r.status_code, r.text) == (200, "Start recording the expert distribution.\n")
    assert srv.http.post("/stop_expert_distribution_record").text == "Stop recording the expert distribution.\n"
    assert [op for op, _ in srv.engine.controls] == ["start_expert_distribution_record"] * 2 + [
        "stop_expert_distribution_record"]


def test_dump_names_its_axes_and_writes_npy_and_json(srv):
    r = srv.http.post("/dump_expert_distribution_record")
    assert r.status_code == 200
    body = r.json()
    assert body["dims"] == ["layer", "expert"] and body["layers"] == [1, 3] and body["experts"] == list(range(6))
    assert body["logical_count"] == COUNTS.tolist() and body["num_tokens"] == 33
    written = np.load(body["path"])
    np.testing.assert_array_equal(written, COUNTS)
    assert json.loads(open(body["path"][:-4] + ".json").read())["layers"] == [1, 3]
    raw = srv.http.get("/dump_expert_distribution_record", params={"format": "npy"})
    np.testing.assert_array_equal(np.load(io.BytesIO(raw.content)), COUNTS)
    assert raw.headers["x-expert-distribution-dims"] == "layer,expert"
    assert raw.headers["x-expert-distribution-layers"] == "1,3"
    assert srv.http.get("/dump_expert_distribution_record", params={"format": "pt"}).status_code == 400


def test_a_refused_operation_is_a_400(srv):
    srv.engine.answers["start_expert_distribution_record"] = {
        "success": False, "message": "expert load counting is off: the server runs with --disable-expert-load",
        "param": "expert_load"}
    r = srv.http.post("/start_expert_distribution_record")
    assert r.status_code == 400 and "--disable-expert-load" in r.json()["error"]["message"]


def test_dashboard_page_is_open_and_loads_only_what_it_ships(srv):
    page = httpx.get(srv.root_url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'data-key-required="1"' in page.text  # the page asks for the key instead of failing a request
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert refs and all(r.startswith("/dashboard/static/") or r.startswith("data:") for r in refs), refs
    for name in ("dashboard.js", "dashboard.css"):
        asset = httpx.get(srv.root_url + "/dashboard/static/" + name)
        assert asset.status_code == 200
        assert not re.search(r"https?://", asset.text), f"{name} loads something from elsewhere"
    assert httpx.get(srv.root_url + "/dashboard/static/..%2Fapp.py").status_code == 404
    assert httpx.get(srv.root_url + "/dashboard/data").status_code == 401
    data = srv.http.get("/dashboard/data").json()
    assert data["layers"] == [1, 3] and data["model"]["name"] == "m" and "success" not in data
    assert srv.engine.controls[-1] == ("get_expert_load", {})


def test_grafana_dashboard_queries_documented_metrics():
    """docs/grafana/expert_load.json is a dashboard whose every query names a metric docs/operations.md lists."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    dash = json.loads((docs / "grafana" / "expert_load.json").read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel["targets"]]
    names = {re.sub(r"_total$", "", n) for e in exprs for n in re.findall(r"moe_(?:engine|serve)_\w+", e)}
    assert {"moe_engine_expert_load_imbalance", "moe_engine_expert_load_entropy", "moe_engine_routed_tokens",
            "moe_engine_expert_load_top10_share"} <= names
    operations = (docs / "operations.md").read_text()
    assert [n for n in sorted(names) if f"`{n}" not in operations] == []
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
