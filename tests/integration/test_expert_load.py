"""Expert load on the real server (tritonserver, the moe backend, the engine): SGLang's recorder endpoints driven
the way SGLang's own test drives them (start, generate, stop, dump with ``requests.post``), the per-layer series on
/metrics, and /dashboard in a real headless browser (Debian's Chromium: no console errors, layers x experts cells,
changing after traffic)."""
from __future__ import annotations

import os
import re
import uuid

import numpy as np
import pytest
import requests

from openai_frontend.routing_codec import decode_routed_experts

from .browser import Chromium, find_chromium


def _auth(server) -> dict:
    return {"Authorization": f"Bearer {server.api_key}"}


def _model(server) -> dict:
    return requests.get(f"{server.base_url}/models", headers=_auth(server), timeout=30).json()["data"][0]


def _complete(server, prompt: str, max_tokens: int = 32) -> np.ndarray:
    """A greedy completion that shares no cached block with any other request; its routed experts."""
    r = requests.post(f"{server.base_url}/completions", headers=_auth(server), timeout=120, json={
        "model": _model(server)["id"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True,  # ends on its length: no row forwarded after a stop token (overlapped steps on GPUs)
        "cache_salt": uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    return decode_routed_experts(r.json()["choices"][0]["routed_experts"])


def test_recorder_endpoints_as_sglang_tests_drive_them(moe_server):
    url, headers = moe_server.root_url, _auth(moe_server)
    assert requests.post(f"{url}/start_expert_distribution_record").status_code == 401  # behind the API key
    response = requests.post(f"{url}/start_expert_distribution_record", headers=headers)
    assert response.status_code == 200 and response.text == "Start recording the expert distribution.\n"
    rows = _complete(moe_server, "The capital of France is")
    response = requests.post(f"{url}/stop_expert_distribution_record", headers=headers)
    assert response.status_code == 200
    response = requests.post(f"{url}/dump_expert_distribution_record", headers=headers)
    assert response.status_code == 200
    dump = response.json()
    model = _model(moe_server)
    assert dump["mode"] == "stat" and dump["dims"] == ["layer", "expert"]
    assert dump["layers"] == model["moe_layers"] and dump["experts"] == list(range(model["num_experts"]))
    count = np.array(dump["logical_count"])
    assert count.sum() > 0  # SGLang's test checks this much
    expect = np.stack([np.bincount(rows[:, layer].ravel(), minlength=model["num_experts"])
                       for layer in model["moe_layers"]])
    np.testing.assert_array_equal(count, expect)  # the routed experts returned, counted
    assert dump["num_tokens"] == len(rows)
    # dumped: cleared (nothing recorded since the stop)
    again = requests.post(f"{url}/dump_expert_distribution_record", headers=headers).json()
    assert again["num_steps"] == 0 and np.array(again["logical_count"]).sum() == 0


def test_metrics_are_per_layer_with_fixed_cardinality(moe_server):
    _complete(moe_server, "Experts per layer", max_tokens=4)
    text = requests.get(f"{moe_server.root_url}/metrics", timeout=30).text
    layers = [str(i) for i in _model(moe_server)["moe_layers"]]
    for family in ("moe_engine_expert_load_imbalance", "moe_engine_expert_load_entropy",
                   "moe_engine_expert_load_top10_share"):
        series = re.findall(rf"^{family}\{{([^}}]*)\}} (\S+)$", text, re.M)
        assert sorted(re.search(r'layer="(\d+)"', labels).group(1) for labels, _ in series) == sorted(layers)
        assert all("expert=" not in labels for labels, _ in series)
    routed = re.search(r"^moe_engine_routed_tokens(?:_total)?\{[^}]*\} (\S+)$", text, re.M)
    assert routed and float(routed.group(1)) > 0
    assert re.search(r"^moe_engine_expert_load_window_seconds\{[^}]*\} 60(\.0)?$", text, re.M)


def test_dashboard_in_a_headless_browser(moe_server, tmp_path):
    if find_chromium() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: the Makefile's test set-up installs it (make test)")
        pytest.skip("chromium not installed (apt-get install chromium, or run make test as root)")
    model = _model(moe_server)
    cells = len(model["moe_layers"]) * model["num_experts"]
    total = "[...document.querySelectorAll('#heatmap .cell')].reduce((a, c) => a + Number(c.dataset.count), 0)"
    with Chromium() as browser:
        page = browser.open(f"{moe_server.root_url}/dashboard?refresh=500#key={moe_server.api_key}")
        page.wait_for("window.dashboardState.updates > 0")
        assert page.eval("document.querySelectorAll('#heatmap .cell').length") == cells
        assert page.eval("document.querySelectorAll('#heat-rows div').length") == len(model["moe_layers"])
        before = page.eval(total)
        updates = page.eval("window.dashboardState.updates")
        _complete(moe_server, "A dashboard shows the experts this prompt routes to", max_tokens=24)
        page.wait_for(f"{total} > {before} && window.dashboardState.updates > {updates}")
        assert page.eval("document.getElementById('c-total').textContent") not in ("", "–")
        assert page.eval("document.querySelectorAll('#tput polyline').length") >= 1
        page.screenshot(str(tmp_path / "dashboard.png"))
        page.pump(0.5)
        assert page.errors == []
        assert page.eval("window.dashboardState.lastError") is None
