"""Communication behind compute on two ranks (gloo, launched by torchrun from the test).

Collectives are made slow with the test hook `Collectives.injected_delay_s` (each all-gather and
reduce-scatter completes no earlier than that long after it was issued) and each block computes
for longer than that (it sleeps in forward and in backward). With the next group's all-gather
issued while the current group computes ([Note: All-gather ahead] in residency/scheduler.py) and
each reduce-scatter finished one flush later, the engine's counters must show that only a small
part of the collectives' time was waited for, and each rank's trace must show all-gathers on
the communication track running while another group computes. The same run shows that no
collective goes through a deprecated torch API (no FutureWarning on either rank).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DELAY_S = 0.03
"""Each collective's injected duration."""
COMPUTE_S = 0.06
"""Each block's forward, and its backward: longer than a collective, so one can hide behind it."""
NUM_BLOCKS = 6

WORKER = textwrap.dedent(
    """
    import gc, json, os, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn
    sys.path.insert(0, {repo!r})
    import offload_trainer as ot

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep({compute})
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep({compute})
            return grad

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return Slow.apply(torch.tanh(self.lin(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range({blocks})])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = ot.OffloadConfig(
        tiers={{"params": "host", "grads": "host", "optimizer": "host", "nvme_dir": os.path.join({out!r}, f"nvme-{{rank}}")}},
        prefetch={{"lookahead_groups": 2}},
        optimizer={{"kind": "sgd", "lr": 1e-2}},
    )
    engine = ot.initialize(Net(), cfg)
    engine.collectives.injected_delay_s = {delay}
    # A full garbage collection of this process takes ~0.3 s on a loaded 2-core machine; one rank
    # collecting while the other waits in a collective would be counted as exposed communication.
    gc.disable()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    for step in range(3):  # the first records the order; the others replay it
        if step == 2:
            engine.trace_next_step(os.path.join({out!r}, f"trace-{{rank}}.json"))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    engine.full_state_dict()
    with open(os.path.join({out!r}, f"stats-{{rank}}.json"), "w") as f:
        json.dump(engine.stats().as_dict(), f)
    engine.close()
    dist.destroy_process_group()
    """
)


def test_collectives_run_behind_compute_and_use_no_deprecated_api(tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(
        WORKER.format(repo=str(REPO), out=str(tmp_path), delay=DELAY_S, compute=COMPUTE_S, blocks=NUM_BLOCKS)
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "FutureWarning" not in done.stderr, done.stderr[-4000:]
    for rank in (0, 1):
        stats = json.loads((tmp_path / f"stats-{rank}.json").read_text())
        # Every block but the first of forward (and of backward, if evicted) is gathered ahead.
        assert stats["all_gathers_ahead"] >= NUM_BLOCKS - 1, stats
        # The injected delay is counted in full in each collective's duration...
        assert stats["all_gather_total_s"] >= 0.9 * DELAY_S * stats["all_gathers_ahead"], stats
        assert stats["reduce_scatter_total_s"] >= 0.9 * DELAY_S * NUM_BLOCKS, stats
        # ...and little of it is waited for: the all-gather issued at the step's end (nothing to
        # hide behind) and the last reduce-scatter (finished at the end of backward) at most.
        assert stats["all_gather_exposed_s"] <= 0.35 * stats["all_gather_total_s"], stats
        assert stats["reduce_scatter_exposed_s"] <= 0.5 * stats["reduce_scatter_total_s"], stats
        assert stats["communication_s"] < stats["comm_total_s"], stats

        trace = json.loads((tmp_path / f"trace-{rank}.json").read_text())
        tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        gathers = [e for e in spans if tracks[e["tid"]] == "communication" and e["name"].startswith("all-gather")]
        forwards = [e for e in spans if tracks[e["tid"]] == "compute" and e["name"].startswith("forward")]
        behind = [
            (g["name"], f["name"])
            for g in gathers
            for f in forwards
            if g["name"].split()[-1] != f["name"].split()[-1] and g["ts"] < f["ts"] + f["dur"] and f["ts"] < g["ts"] + g["dur"]
        ]
        assert len(behind) >= NUM_BLOCKS - 1, (gathers, forwards)
