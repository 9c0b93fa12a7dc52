"""Shared helpers for the load test and the benchmarks in ``loadtest/``.

- ``ModelInfo`` / ``fetch_model_info``: what ``GET /v1/models`` says about the
  model (layers, MoE layers, experts, top-k, routed-experts dtype).
- ``RoutingVerifier``: checks one response's ``routed_experts`` (decode, dtype,
  shape ``(prompt + output - 1, layers, top_k)``, ids < num_experts, dense
  layers 0, k distinct ids per row) and, optionally, that the same request
  (same prompt ids, same seed) always gets the same tokens and rows whatever
  else shares the engine's batch.
- prompt factories (text and token ids, deterministic), an SSE reader.
- ``ProcSampler``: RSS / CPU of the server's processes and of the whole
  machine during a run (for leaks and for "was the machine shared").
- ``scrape`` / ``parse_prom``: Prometheus text from /metrics.

No locust import here: the benchmark scripts use it too.
"""
from __future__ import annotations

import csv
import io
import json
import os
import random
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pybase64

REPO = Path(__file__).resolve().parents[2]
CHECKPOINTS = REPO / "loadtest" / "results" / "checkpoints"

# The load-test model: Mixtral-style, 8 layers, 32 experts, top-4 (a checkpoint
# written by moe_engine.tiny with these overrides; vocabulary/tokenizer as tiny).
MEDIUM_OVERRIDES = dict(
    hidden_size=256, intermediate_size=256, num_hidden_layers=8, num_local_experts=32,
    num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
)
# Routing-heavy: narrow but deep, 48 layers x top-8 (384 bytes of ids per token).
DEEP_OVERRIDES = dict(
    hidden_size=64, intermediate_size=64, num_hidden_layers=48, num_local_experts=64,
    num_experts_per_tok=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)
MODEL_PRESETS = {"medium": MEDIUM_OVERRIDES, "deep": DEEP_OVERRIDES}


def resolve_model(model: str) -> tuple[str | None, str]:
    """``tiny`` (embedded default) | ``medium`` / ``deep`` (presets, built once and cached) | a checkpoint dir.

    Returns (path for --model or None, served model name)."""
    if model == "tiny":
        return None, "tiny-mixtral"
    if model in MODEL_PRESETS:
        import sys

        sys.path.insert(0, str(REPO / "backends"))
        from moe_engine.tiny import write_tiny_checkpoint

        ov = MODEL_PRESETS[model]
        name = (f"mixtral-h{ov['hidden_size']}-i{ov['intermediate_size']}-l{ov['num_hidden_layers']}"
                f"-e{ov['num_local_experts']}k{ov['num_experts_per_tok']}")
        path = CHECKPOINTS / name
        if not (path / "config.json").exists():
            tmp = CHECKPOINTS / (name + ".tmp")
            write_tiny_checkpoint(tmp, **ov)
            tmp.rename(path)
        return str(path), name
    p = Path(model)
    if not (p / "config.json").exists():
        raise SystemExit(f"--model {model}: not 'tiny', 'medium' or a checkpoint directory")
    return str(p), p.name


# ----------------------------------------------------------------------------- model info


@dataclass(frozen=True)
class ModelInfo:
    id: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    dtype: str
    vocab_size: int
    max_model_len: int
    routed_experts_enabled: bool

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in set(self.moe_layers))


def http_json(url: str, body: dict | None = None, api_key: str | None = None, timeout: float = 600):
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def fetch_model_info(root_url: str, api_key: str | None = None) -> ModelInfo:
    card = http_json(root_url.rstrip("/") + "/v1/models", api_key=api_key)["data"][0]
    return ModelInfo(
        id=card["id"],
        num_hidden_layers=int(card["num_hidden_layers"]),
        moe_layers=tuple(card.get("moe_layers") or range(int(card["num_hidden_layers"]))),
        num_experts=int(card["num_experts"]),
        top_k=int(card.get("num_experts_per_tok") or card["top_k"]),
        dtype=str(card["routed_experts_dtype"]),
        vocab_size=int(card["vocab_size"]),
        max_model_len=int(card["max_model_len"]),
        routed_experts_enabled=bool(card.get("routed_experts_enabled", True)),
    )


# ----------------------------------------------------------------------------- verification


class VerifyError(Exception):
    """A response whose routed experts (or tokens) are wrong; the message names the check."""


def decode_routed(s: str) -> np.ndarray:
    """vLLM's documented client decode (pybase64 for speed; same bytes as base64.b64decode)."""
    return np.load(io.BytesIO(pybase64.b64decode(s, validate=True)), allow_pickle=False)


MIXUP_FRACTION = 0.25  # share of differing (row, layer) expert sets that counts as a mix-up, not numerics


@dataclass
class RoutingVerifier:
    """Checks responses; counts what it checked. Thread-safe.

    Consistency (``consistency=True``): the first response to a request (prompt ids,
    seed, length) is kept; later identical requests are compared with it. The engine
    is not bitwise batch-invariant on every model (float32 matmuls of a different
    batch shape round differently, which can swap near-tied experts or, rarely, the
    sampled token), so exact equality is *counted*, not required. What fails a
    response is a gross disagreement: over the rows both answers share (up to the
    first differing token), more than ``MIXUP_FRACTION`` of the (row, MoE layer)
    expert sets differ -- what rows of another request, or rows shifted by one,
    would look like.
    """

    info: ModelInfo
    consistency: bool = True
    checked: int = 0
    repeats: int = 0  # responses compared with an earlier one of the same request
    identical: int = 0  # ... and bitwise identical to it (tokens and routed experts)
    token_divergent: int = 0  # ... whose tokens differ from it somewhere
    cells_compared: int = 0  # (row, MoE layer) cells compared
    cells_order_only: int = 0  # same expert set, different slot order
    cells_set_diff: int = 0  # different expert set
    worst_fraction: float = 0.0  # largest share of differing sets in one response
    failures: dict = field(default_factory=dict)
    examples: list = field(default_factory=list)  # a few differences, for the report
    _refs: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, routed_b64: str | None, prompt_ids: list[int], output_ids: list[int],
              key: tuple | None = None) -> np.ndarray:
        """Raise VerifyError or return the decoded array."""
        try:
            arr = self._check(routed_b64, prompt_ids, output_ids, key)
        except VerifyError as e:
            with self._lock:
                self.failures[str(e)] = self.failures.get(str(e), 0) + 1
            raise
        with self._lock:
            self.checked += 1
        return arr

    def _check(self, routed_b64, prompt_ids, output_ids, key):
        info = self.info
        if routed_b64 is None:
            raise VerifyError("routed_experts missing (null)")
        if not prompt_ids or not output_ids:
            raise VerifyError("prompt_token_ids/token_ids missing")
        try:
            arr = decode_routed(routed_b64)
        except Exception as e:  # noqa: BLE001
            raise VerifyError(f"routed_experts does not decode: {type(e).__name__}") from None
        if arr.dtype != np.dtype(info.dtype):
            raise VerifyError(f"routed_experts dtype {arr.dtype}, expected {info.dtype}")
        expected = (len(prompt_ids) + len(output_ids) - 1, info.num_hidden_layers, info.top_k)
        if arr.shape != expected:
            raise VerifyError(f"routed_experts shape {arr.shape}, expected {expected}")
        moe = arr[:, list(info.moe_layers), :]
        if moe.size and int(moe.max()) >= info.num_experts:
            raise VerifyError(f"expert id {int(moe.max())} >= num_experts {info.num_experts}")
        if info.dense_layers and arr[:, list(info.dense_layers), :].any():
            raise VerifyError("non-zero ids on a dense layer")
        if info.top_k > 1 and moe.size:
            s = np.sort(moe, axis=-1)
            if (s[..., 1:] == s[..., :-1]).any():
                raise VerifyError("an expert repeated within a row's top-k")
        if self.consistency and key is not None:
            self._compare(arr, moe, prompt_ids, output_ids, key)
        return arr

    def _compare(self, arr, moe, prompt_ids, output_ids, key):
        full_key = (key, tuple(prompt_ids))
        with self._lock:
            ref = self._refs.get(full_key)
            if ref is None:
                self._refs[full_key] = (list(output_ids), arr.copy())
                return
        ref_out, ref_arr = ref
        out = list(output_ids)
        if out == ref_out and np.array_equal(arr, ref_arr):
            with self._lock:
                self.repeats += 1
                self.identical += 1
                self.cells_compared += moe.shape[0] * moe.shape[1]
            return
        # Rows both answers share: every prompt row, and output rows up to the first differing token
        # (row i routes the token at position i; output token j sits at position len(prompt) + j).
        j = next((n for n, (a, b) in enumerate(zip(out, ref_out)) if a != b), min(len(out), len(ref_out)))
        rows = min(len(prompt_ids) + j, arr.shape[0], ref_arr.shape[0])
        a = moe[:rows]
        b = ref_arr[:rows][:, list(self.info.moe_layers), :]
        differs = (a != b).any(-1)
        set_diff = (np.sort(a, -1) != np.sort(b, -1)).any(-1)
        n_cells, n_diff, n_set = differs.size, int(differs.sum()), int(set_diff.sum())
        frac = n_set / max(1, n_cells)
        with self._lock:
            self.repeats += 1
            self.token_divergent += int(out != ref_out)
            self.cells_compared += n_cells
            self.cells_set_diff += n_set
            self.cells_order_only += n_diff - n_set
            self.worst_fraction = max(self.worst_fraction, frac)
            if len(self.examples) < 20:
                first = [(int(r), int(c), b[r, c].tolist(), a[r, c].tolist()) for r, c in np.argwhere(differs)[:3]]
                self.examples.append({"prompt_tokens": len(prompt_ids), "first_token_diff": j if out != ref_out else None,
                                      "rows_compared": rows, "cells_differ": n_diff, "sets_differ": n_set,
                                      "first_cells (row, layer idx, before, now)": first})
        if frac > MIXUP_FRACTION:
            raise VerifyError("routed experts disagree with an earlier identical request in most rows (mix-up)")

    def summary(self) -> dict:
        with self._lock:
            return {"verified": self.checked, "distinct_requests": len(self._refs), "repeats": self.repeats,
                    "identical_repeats": self.identical, "token_divergent_repeats": self.token_divergent,
                    "cells_compared": self.cells_compared, "cells_order_only": self.cells_order_only,
                    "cells_set_diff": self.cells_set_diff, "worst_set_diff_fraction": round(self.worst_fraction, 4),
                    "failures": dict(self.failures), "examples": list(self.examples)}


# ----------------------------------------------------------------------------- prompts

_WORDS = (
    "the quick brown fox jumps over a lazy dog while routers pick experts for every token in each layer "
    "of the model mixture language serving engine returns choices so that training can replay them "
    "policy rollout agreement large predicts next server models http grpc openai api completions chat "
    "numbers capital france paris story robot code print hello world range value experts top routing "
    "replay keeps generated trained inference triton decode prefill batch cache memory thread request"
).split()


def text_prompts(n: int, min_words: int, max_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]


def token_prompts(n: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def parse_range(s: str) -> tuple[int, int]:
    """'64-192' -> (64, 192); '128' -> (128, 128)."""
    a, _, b = str(s).partition("-")
    lo = int(a)
    return lo, int(b) if b else lo


# ----------------------------------------------------------------------------- SSE


def iter_sse(lines):
    """Yield (arrival time, parsed JSON) for each ``data:`` event; stops at [DONE].

    ``lines`` yields bytes lines (e.g. ``response.iter_lines(chunk_size=None)``)."""
    for line in lines:
        if not line:
            continue
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield time.perf_counter(), json.loads(payload)
        elif line.startswith(b"event: error") or line.startswith(b"error"):
            raise VerifyError(f"SSE error event: {line[:200]!r}")


# ----------------------------------------------------------------------------- /metrics


def scrape(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def parse_prom(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} for every sample."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def expert_counts(prom: dict, num_layers: int, num_experts: int) -> np.ndarray:
    """moe_serve_expert_selections{layer, expert} -> array [layers, experts]."""
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    for (name, labels), v in prom.items():
        if name in ("moe_serve_expert_selections_total", "moe_serve_expert_selections"):
            d = dict(labels)
            counts[int(d["layer"]), int(d["expert"])] = int(v)
    return counts


def prom_value(prom: dict, name: str, **labels) -> float:
    """Sum of the samples of ``name`` (or ``name_total``: the parser adds it to counters) with these labels."""
    want = set(labels.items())
    names = (name, name + "_total")
    return sum(v for (n, lab), v in prom.items() if n in names and want <= set(lab))


# ----------------------------------------------------------------------------- processes


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def proc_tree(root_pid: int) -> list[int]:
    """root_pid and all its descendants."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = _read(f"/proc/{d}/stat")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root_pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def proc_sample(pid: int) -> tuple[str, int, float] | None:
    """(name, RSS bytes, CPU seconds user+system) or None if gone."""
    try:
        stat = _read(f"/proc/{pid}/stat")
        status = _read(f"/proc/{pid}/status")
    except OSError:
        return None
    name = stat[stat.index("(") + 1: stat.rindex(")")]
    fields = stat.rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / tick
    rss = 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return name, rss, cpu


def machine_cpu() -> tuple[float, float]:
    """(busy seconds, total seconds) summed over all CPUs, from /proc/stat."""
    f = [int(x) for x in _read("/proc/stat").splitlines()[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return (sum(f[:8]) - idle) / tick, sum(f[:8]) / tick


def loadavg() -> tuple[float, float, float]:
    a = _read("/proc/loadavg").split()
    return float(a[0]), float(a[1]), float(a[2])


def top_processes(n: int = 6) -> list[str]:
    import subprocess

    out = subprocess.run(["ps", "-eo", "pid,pcpu,rss,etimes,args", "--sort=-pcpu"], capture_output=True, text=True)
    return [line[:160] for line in out.stdout.splitlines()[: n + 1]]


class ProcSampler:
    """Samples every ``interval`` s: per-process RSS/CPU of the server tree, the client's
    own tree, machine busy CPU; optional extra callable (e.g. engine gauges)."""

    def __init__(self, server_pid: int, client_pids_fn=None, interval: float = 2.0, extra=None) -> None:
        self.server_pid = server_pid
        self.client_pids_fn = client_pids_fn or (lambda: [])
        self.interval = interval
        self.extra = extra
        self.rows: list[dict] = []
        self._client_cpu: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "ProcSampler":
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.rows

    def snapshot(self) -> dict:
        row = {"t": time.time()}
        server_cpu, server_rss = 0.0, 0
        for pid in proc_tree(self.server_pid):
            s = proc_sample(pid)
            if s is None:
                continue
            name, rss, cpu = s
            key = ("backend_stub" if name.startswith("triton_python") or "stub" in name
                   else {"moe-serve": "frontend", "python": "frontend", "tritonserver": "tritonserver"}.get(name, name))
            row[f"rss_{key}"] = row.get(f"rss_{key}", 0) + rss
            row[f"cpu_{key}"] = row.get(f"cpu_{key}", 0.0) + cpu
            server_cpu += cpu
            server_rss += rss
        # Client processes come and go: keep each one's last CPU reading (cumulative counter).
        for root in self.client_pids_fn():
            for pid in proc_tree(root):
                s = proc_sample(pid)
                if s:
                    self._client_cpu[pid] = s[2]
        client_cpu = sum(self._client_cpu.values())
        busy, total = machine_cpu()
        row.update(server_cpu=server_cpu, server_rss=server_rss, client_cpu=client_cpu, machine_busy=busy,
                   machine_total=total, load1=loadavg()[0])
        if self.extra:
            try:
                row.update(self.extra())
            except Exception:  # noqa: BLE001 - best effort
                pass
        return row

    def _run(self) -> None:
        while True:
            self.rows.append(self.snapshot())
            if self._stop.wait(self.interval):
                self.rows.append(self.snapshot())
                return


def cpu_split(rows: list[dict]) -> dict:
    """CPU cores used on average between first and last sample: server, client, everything else."""
    if len(rows) < 2:
        return {}
    a, b = rows[0], rows[-1]
    wall = b["t"] - a["t"]
    server = (b["server_cpu"] - a["server_cpu"]) / wall
    client = (b["client_cpu"] - a["client_cpu"]) / wall
    busy = (b["machine_busy"] - a["machine_busy"]) / wall
    ncpu = (b["machine_total"] - a["machine_total"]) / wall
    parts = {k[4:]: (b.get(k, 0) - a.get(k, 0)) / wall for k in b if k.startswith("cpu_")}
    return {"wall_s": wall, "cores": ncpu, "machine_busy_cores": busy, "server_cores": server,
            "client_cores": client, "other_cores": max(0.0, busy - server - client),
            "server_parts_cores": parts}


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def median(xs):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def percentile(xs, q: float) -> float:
    if not len(xs):
        return float("nan")
    return float(np.percentile(np.asarray(xs, dtype=float), q))

