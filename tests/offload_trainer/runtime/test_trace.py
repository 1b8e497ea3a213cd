"""A Chrome/Perfetto trace of one step: IO, compute and optimizer per group on separate tracks."""

from __future__ import annotations

import json

import torch

import offload_trainer as ot
from offload_trainer.models import DecoderConfig, DecoderLM
from offload_trainer.runtime.trace import TRACKS


def test_trace_of_one_step_has_every_track_per_group(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(
        tiers={"params": {"host": 0.5, "nvme": 0.5}, "grads": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path)}
    )
    x = torch.randint(0, 256, (2, 16))
    with ot.initialize(DecoderLM(DecoderConfig.preset("tiny")), cfg) as engine:
        engine.backward(engine(x, x)[1])
        engine.step()  # the recording step: nothing traced
        assert not (tmp_path / "trace.json").exists()
        engine.trace_next_step(tmp_path / "trace.json")
        engine.backward(engine(x, x)[1])
        engine.step()
        names = [g.plan.name for g in engine.groups]
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    tracks = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert set(tracks) == set(TRACKS)
    by_track = {t: [e for e in events if e["tid"] == tid] for t, tid in tracks.items()}
    for track in TRACKS:
        if track == "communication":
            continue  # one rank: no collective runs
        assert by_track[track], f"nothing on the {track} track"
    for name in names:
        assert any(name in e["name"] and e["name"].startswith("forward") for e in by_track["compute"]), name
        assert any(name in e["name"] for e in by_track["param io"] + by_track["param copies"]), name
        assert any(e["name"] == f"update {name}" for e in by_track["optimizer"]), name
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
