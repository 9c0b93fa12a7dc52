"""Which weights the backend serves, kept on disk so that a restarted backend comes back on them.

moe-serve's watchdog restarts tritonserver when the backend dies or hangs; the model is then loaded again from its
parameters, which name the start-up checkpoint. Without more, a trainer that had pushed new weights would get the
start-up weights back under its next requests without being told. So after every successful weight update the
backend records here where the weights came from (``weights_state_file``, a model parameter that moe-serve points
into its private run directory, so a new moe-serve process starts clean):

- ``{"source": "disk", "model_path": P, "weight_version": V}``: a restart loads checkpoint P and serves version V;
- ``{"source": "distributed", "weight_version": V}``: the tensors came over a broadcast, which cannot be replayed.
  A restart loads the start-up checkpoint but refuses generation (503 ``weights_lost``) until weights are pushed
  again (from disk or a broadcast): never other weights under a new request's feet.

Without the parameter (tritonserver started by hand on this repository) nothing is recorded.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("moe_backend")

# Ops whose success changes the served weights, and where the new ones came from.
UPDATE_SOURCES = {"update_weights_from_disk": "disk", "update_weights_from_distributed": "distributed"}


@dataclass
class Restored:
    """What a starting backend loads: ``checkpoint`` with ``weight_version``; ``lost`` (a message) when the weights
    served before the restart cannot be loaded again and generation must be refused until new ones arrive."""

    checkpoint: str
    weight_version: str
    lost: str | None = None
    lost_version: str | None = None


def lost_message(version: str | None, why: str) -> str:
    return (f"the weights served before the backend restarted (version {version!r}) {why}; generation is refused "
            f"until weights are pushed again (update_weights_from_disk, or init_weights_update_group then "
            f"update_weights_from_distributed)")


class WeightsState:
    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None

    def read(self) -> dict | None:
        if self.path is None or not self.path.is_file():
            return None
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            log.error("weights state %s unreadable (%s); serving the start-up checkpoint", self.path, exc)
            return None
        return state if isinstance(state, dict) else None

    def restored(self, start_checkpoint: str) -> Restored:
        """What to load now: the start-up checkpoint, or what the last update recorded."""
        default = Restored(start_checkpoint, os.path.basename(os.path.normpath(start_checkpoint)))
        state = self.read()
        if state is None:
            return default
        version = state.get("weight_version")
        if state.get("source") == "disk" and state.get("model_path"):
            log.warning("restart: loading the last weights loaded from disk, %s (version %r)", state["model_path"],
                        version)
            return Restored(str(state["model_path"]), str(version or ""))
        why = "came over a distributed broadcast, which cannot be loaded again"
        log.error("restart: %s", lost_message(version, why))
        return Restored(start_checkpoint, default.weight_version, lost_message(version, why), version)

    def record(self, op: str, args: dict, weight_version: str) -> None:
        """After a successful weight update ``op`` (its control arguments): write where the weights came from."""
        if self.path is None or op not in UPDATE_SOURCES:
            return
        state = {"source": UPDATE_SOURCES[op], "weight_version": weight_version}
        if state["source"] == "disk":
            state["model_path"] = str(Path(args["model_path"]).resolve())
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)  # atomic: a restart reads the old state or the new one, never half of one
        except OSError as exc:
            log.error("could not record the weights state in %s: %s (a restart would not restore them)", self.path,
                      exc)
