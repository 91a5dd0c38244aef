"""Starting worker processes for the torch.distributed tests (gloo, CPU)."""

from __future__ import annotations

import io
import socket
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(target: Callable[..., None], world: int, scenarios: list[str]) -> dict[int, dict[str, Any]]:
    """Run ``target(rank, world, port, scenarios, queue)`` on ``world`` spawned processes;
    each puts ``(rank, torch.save bytes of its results)`` on the queue."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _port()
    procs = [ctx.Process(target=target, args=(r, world, port, scenarios, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {rank: torch.load(io.BytesIO(blob), weights_only=True) for rank, blob in (queue.get() for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    for rank, res in results.items():
        assert "crash" not in res, f"rank {rank}:\n{res['crash']}"
    return results
