"""Generator state snapshots.

Capture keeps every generator exactly where eager construction would leave it: each
random op is run for real on a scratch tensor (or skipped ahead) after its generator's
state was snapshotted. A random op therefore carries the complete state it starts from,
and replaying it needs nothing else: no ordering between tensors, no global state.

On the default CPU generator, capture does not compute those states: each is a
``PendingSnapshot``, "so many words after the previous one", and a state is computed
(by a jump-ahead) only when a materialization reads it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Mapping, Union

import torch

from fxinit.rng.mt19937 import advance


@dataclass(frozen=True)
class RngSnapshot:
    """The full state of one generator just before a random op."""

    device: str  # "cpu", "cuda:0"
    state: torch.Tensor  # uint8, as returned by Generator.get_state()

    @property
    def nbytes(self) -> int:
        return self.state.numel()


_CHAIN = threading.Lock()  # one lock for all chains: states are computed at most once


class PendingSnapshot:
    """The CPU generator state ``draws`` words after snapshot ``prev``, computed when first
    read. A state is computed from the nearest one already known along the chain, so
    reading the snapshots a slice needs in program order costs one jump each, with jump
    lengths that repeat from layer to layer (and so reuse their polynomials)."""

    __slots__ = ("device", "prev", "draws", "_state")

    def __init__(self, prev: "Snapshot", draws: int) -> None:
        self.device = "cpu"
        self.prev: Snapshot | None = prev
        self.draws = draws
        self._state: torch.Tensor | None = None

    @property
    def state(self) -> torch.Tensor:
        if self._state is None:
            with _CHAIN:
                if self._state is None:
                    node: Snapshot | None = self
                    draws = 0
                    while isinstance(node, PendingSnapshot) and node._state is None:
                        draws += node.draws
                        node = node.prev
                    assert node is not None
                    self._state = advance(node.state, draws)
                    self.prev = None  # later reads stop here: the chain behind can go
        return self._state


Snapshot = Union[RngSnapshot, PendingSnapshot]


def resolve(snaps: "list[Snapshot]") -> None:
    """Compute the states of ``snaps`` in the order given (program order: one short jump each)."""
    for snap in snaps:
        snap.state


def default_generator_for(device: torch.device) -> torch.Generator:
    """The generator an op on ``device`` uses when it is given none."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        return torch.cuda.default_generators[index]
    if device.type == "meta":
        raise ValueError("meta tensors use no generator")
    module = getattr(torch, device.type, None)
    gens = getattr(module, "default_generators", None)
    if gens is None:
        raise NotImplementedError(f"fxinit does not know the default generator of device {device}")
    return gens[device.index or 0]


def generator_device(gen: torch.Generator) -> str:
    dev = gen.device
    if dev.type == "cuda" and dev.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(dev)


def snapshot(gen: torch.Generator) -> RngSnapshot:
    return RngSnapshot(device=generator_device(gen), state=gen.get_state())


def private_generator(snap: Snapshot) -> torch.Generator:
    """A new generator in the snapshotted state; the user's generators are not touched."""
    gen = torch.Generator(device=snap.device)
    gen.set_state(snap.state)
    return gen


@contextlib.contextmanager
def swapped_default_generators(snaps: Mapping[str, Snapshot]) -> Iterator[None]:
    """Run code that draws from the *default* generators as if from the snapshots.

    Used for opaque init functions (``trunc_normal_``, ``sparse_``...) that call random
    functions without passing a generator. The user's states are restored afterwards.
    """
    saved: list[tuple[torch.Generator, torch.Tensor]] = []
    try:
        for snap in snaps.values():
            gen = default_generator_for(torch.device(snap.device))
            saved.append((gen, gen.get_state()))
            gen.set_state(snap.state)
        yield
    finally:
        for gen, state in reversed(saved):
            gen.set_state(state)
