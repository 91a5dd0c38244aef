"""Starting worker processes for the torch.distributed tests (gloo, CPU)."""

from __future__ import annotations

import io
import os
import socket
import traceback
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


def serve(rank: int, world: int, port: int, queue: Any, scenarios: Callable[[], dict[str, Any]]) -> None:
    """The body of a worker: join the gloo group, run ``scenarios()`` (its results, or the
    traceback of a crash), leave, and put ``(rank, torch.save bytes)`` on ``queue``."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        results = scenarios()
    except Exception:
        results = {"crash": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    buf = io.BytesIO()  # plain bytes: tensors shared through the queue would die with this process
    torch.save(results, buf)
    queue.put((rank, buf.getvalue()))
