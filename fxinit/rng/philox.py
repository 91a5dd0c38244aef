"""CUDA's Philox generator, followed on a machine without CUDA.

A CUDA generator's state is ``(seed, offset)``; each random kernel reserves an offset
increment before it runs, and the increment depends on the device: it is computed from the
grid the kernel launches, which depends on the number of multiprocessors. A machine without
CUDA cannot read that number, so tracing for a CUDA target there records each random op's
*reservation* (elements and unroll factor) and its snapshot as "the offset after these
reservations since the seed" (:class:`PendingPhilox`). The state is computed where the device
exists, from its properties, when materialization reads it; an artifact carries the chain.

What a kernel reserves (``aten/src/ATen/native/cuda/DistributionTemplates.h``,
``calc_execution_policy``; the same in torch 2.11-2.15): with ``N`` elements, blocks of 256
threads and ``G = min(ceil(N / 256), SMs * (maxThreadsPerSM // 256))`` blocks,
``((N - 1) // (256 * G * U) + 1) * 4``, where ``U`` (the unroll factor) is 4 for
``uniform_``, ``normal_``, ``bernoulli_(p)``, ``exponential_``, ``cauchy_``, ``log_normal_``,
``geometric_`` and ``random_(from, to)`` of a range under 2**32, and 2 for float64 and for
``random_`` of int64/float32/float64/bfloat16 over a range of 2**32 or more. A kernel of no
elements reserves nothing. ``native_dropout`` (``aten/src/ATen/native/cuda/Dropout.cu``)
reserves as a float32 ``bernoulli_`` does, whatever its dtype (its ``UNROLL`` is 4).
Tensors beyond 32-bit indexing are split into sub-kernels that reserve each: those, and
every other random op, are refused here by name.

The chain of a device lives for the process (:data:`CHAINS`), as the generator does: a
second model traced after the same seed continues where the first left off.

>>> from fxinit.rng.philox import Reservation, increment
>>> h100 = dict(sms=132, threads_per_sm=2048)
>>> [increment(Reservation(n, 4), **h100) for n in (1, 2**20, 2**24, 2**27)]
[4, 4, 64, 500]
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from fxinit.errors import DeferredInitError

#: torch's default CUDA seed (``default_rng_seed_val``) before anything seeds it
DEFAULT_SEED = 67280421310721
_BLOCK = 256
_MAX_32BIT = 2**31 - 1


@dataclass(frozen=True)
class Reservation:
    """What one random kernel reserves: its elements and unroll factor."""

    numel: int
    unroll: int


def increment(r: Reservation, sms: int, threads_per_sm: int) -> int:
    """The Philox offset increment of ``r`` on a device with ``sms`` multiprocessors of
    ``threads_per_sm`` threads."""
    if r.numel == 0:
        return 0
    grid = min((r.numel + _BLOCK - 1) // _BLOCK, sms * (threads_per_sm // _BLOCK))
    return ((r.numel - 1) // (_BLOCK * grid * r.unroll) + 1) * 4


_ATEN = torch.ops.aten
_FILLS = {_ATEN.uniform_.default, _ATEN.normal_.default, _ATEN.exponential_.default, _ATEN.cauchy_.default,
          _ATEN.log_normal_.default, _ATEN.geometric_.default, _ATEN.bernoulli_.float,
          _ATEN.normal.Tensor_float, _ATEN.normal.float_Tensor, _ATEN.normal.Tensor_Tensor,
          _ATEN.normal.float_float, _ATEN.rand.default, _ATEN.randn.default, _ATEN.rand_like.default,
          _ATEN.randn_like.default, _ATEN.bernoulli.p}
_RANDOM_FROM = getattr(_ATEN.random_, "from")
_RANDOM_FROM_TO = {_RANDOM_FROM, _ATEN.random_.to, _ATEN.randint.low, _ATEN.randint.default,
                   _ATEN.randint_like.default, _ATEN.randint_like.low_dtype}
_WIDE = {torch.int64, torch.float64, torch.float32, torch.bfloat16}


def reservation(func: Any, args: tuple, kwargs: dict, out: torch.Tensor) -> Reservation | None:
    """What random op ``func`` writing ``out`` reserves on CUDA, or None if fxinit does not
    know it (the op is then refused for a device this machine lacks)."""
    numel = out.numel()
    if numel > _MAX_32BIT:
        return None
    if func is _ATEN.native_dropout.default:  # Dropout.cu: UNROLL is 4 for every dtype
        return Reservation(numel, 4)
    if func in _FILLS:
        return Reservation(numel, 2 if out.dtype == torch.float64 else 4)
    if func in _RANDOM_FROM_TO:
        low, high = _bounds(func, args, kwargs)
        if high is None:
            return None
        wide = out.dtype in _WIDE and high - low >= 2**32
        return Reservation(numel, 2 if wide else 4)
    return None


def _bounds(func: Any, args: tuple, kwargs: dict) -> tuple[int, int | None]:
    if func is _RANDOM_FROM:
        high = args[2] if len(args) > 2 else kwargs.get("to")
        return int(args[1]), (int(high) if high is not None else None)
    if func is _ATEN.random_.to:
        return 0, int(args[1])
    if func is _ATEN.randint.low:
        return int(args[0]), int(args[1])
    if func is _ATEN.randint_like.low_dtype:
        return int(args[1]), int(args[2])
    if func is _ATEN.randint_like.default:
        return 0, int(args[1])
    return 0, int(args[0])  # randint(high, size)


class PendingPhilox:
    """The state of CUDA generator ``device`` before a random op traced where CUDA is absent:
    ``seed``, and the offset reached after the reservations of the ops before it since the
    seed was set (``prev``'s offset plus ``prev``'s own reservation). Computed, on the device,
    when first read."""

    __slots__ = ("device", "seed", "prev", "reserved", "_state", "_offset")

    def __init__(self, device: str, seed: int, prev: "PendingPhilox | None", reserved: Reservation | None) -> None:
        self.device = device
        self.seed = seed
        self.prev = prev  # None: the first op after the seed (offset 0)
        self.reserved = reserved  # what ``prev`` reserved
        self._state: torch.Tensor | None = None
        self._offset: tuple[tuple[int, int], int] | None = None

    def offset(self, sms: int, threads_per_sm: int) -> int:
        """The Philox offset on a device of ``sms`` multiprocessors (no device needed); each
        link remembers its last answer, so reading a chain in order costs one step each."""
        key = (sms, threads_per_sm)
        total, node = 0, self
        while node.prev is not None:
            if node._offset is not None and node._offset[0] == key:
                total += node._offset[1]
                break
            assert node.reserved is not None
            total += increment(node.reserved, sms, threads_per_sm)
            node = node.prev
        self._offset = (key, total)
        return total

    @property
    def state(self) -> torch.Tensor:
        """``torch.Generator.get_state()`` of the CUDA generator: seed and offset, 8 bytes each."""
        if self._state is None:
            with _LOCK:
                if self._state is None:
                    if not torch.cuda.is_available():
                        raise DeferredInitError(
                            f"random values traced for {self.device} can only be computed on that device: its "
                            "generator's position depends on the device's multiprocessor count",
                            hint="materialize on a machine with CUDA, or save the init graph (fxinit.init_graph(m)"
                                 ".save(path)) and materialize it there")
                    props = torch.cuda.get_device_properties(torch.device(self.device))
                    self._state = philox_state(self.seed, self.offset(props.multi_processor_count,
                                                                      props.max_threads_per_multi_processor))
        return self._state


_LOCK = threading.Lock()
#: ``{device: (seeding call, last snapshot, its reservation)}``: where each absent CUDA
#: generator is, for every trace of the process (``capture.stepping``)
CHAINS: dict[str, tuple[Any, "PendingPhilox", Reservation]] = {}


def philox_state(seed: int, offset: int) -> torch.Tensor:
    """A CUDA generator's ``get_state()`` bytes for ``(seed, offset)``."""
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


def queued_seed(device: torch.device) -> tuple[Any, int]:
    """On a machine whose torch has not initialized CUDA: the seed ``torch.manual_seed`` (or
    ``torch.cuda.manual_seed[_all]``) queued for CUDA generator ``device``, and the queued
    call it came from (a new call restarts the offset at 0, even with the same seed). Raises
    ``LookupError`` when the state was set in a way that cannot be followed (a random seed,
    ``set_rng_state``)."""
    cuda = torch.cuda
    for call in list(getattr(cuda, "_queued_calls", ())):
        name = getattr(call[0], "__qualname__", "")
        if "seed" in name or "rng_state" in name:
            raise LookupError(f"the CUDA generator was set by {name.split('.')[0]}, whose state is only known on CUDA")
    tracker = getattr(cuda, "_lazy_seed_tracker", None)
    calls = [c for c in (tracker.get_calls() if tracker is not None else []) if c is not None]
    if not calls:
        return None, DEFAULT_SEED
    cb = calls[-1][0]
    if cb.__qualname__.startswith("manual_seed.") and (device.index or 0) != 0:
        calls = [c for c in calls[:-1] if c[0].__qualname__.startswith("manual_seed_all.")]
        if not calls:
            return None, DEFAULT_SEED
        cb = calls[-1][0]
    cells = dict(zip(cb.__code__.co_freevars, cb.__closure__ or ()))
    if "seed" not in cells:
        raise LookupError(f"torch's queued CUDA seeding ({cb.__qualname__}) has no seed fxinit can read")
    return cb, int(cells["seed"].cell_contents)


#: the fields of a PendingPhilox in an artifact's ``rng`` table (``after``: the key of the
#: snapshot before it on the same chain, or None; ``reserved``: what that one reserved)
PENDING_FIELDS = ("device", "seed", "after", "reserved")


def encode_pending(snapshots: dict[str, Any]) -> dict[str, dict]:
    """The artifact ``rng`` entries of the PendingPhilox among ``snapshots``: their chain
    fields. A chain's earlier links that no kept node uses are kept too (keyed ``<key>~<n>``):
    the offset of a snapshot is the sum of every reservation before it."""
    keys = {id(s): k for k, s in snapshots.items()}
    out: dict[str, dict] = {}
    todo = [(k, s) for k, s in snapshots.items() if isinstance(s, PendingPhilox)]
    while todo:
        k, s = todo.pop(0)
        after = None
        if s.prev is not None:
            after = keys.get(id(s.prev))
            if after is None:
                after = keys[id(s.prev)] = f"{k}~{len(keys)}"
                todo.append((after, s.prev))
        out[k] = {"device": s.device, "seed": s.seed, "after": after,
                  "reserved": None if s.reserved is None else [s.reserved.numel, s.reserved.unroll]}
    return out


def decode_pending(table: dict[str, dict], snapshots: dict[str, Any]) -> list[str]:
    """Add the PendingPhilox entries of ``table`` to ``snapshots``, each after the link it
    follows (in any order of the table); the keys of entries that are not valid ones."""
    todo = dict(table)
    while todo:
        progress = False
        for key, v in list(todo.items()):
            device, seed, after, reserved = (v[f] for f in PENDING_FIELDS)
            if not (isinstance(device, str) and device.startswith("cuda") and type(seed) is int
                    and 0 <= seed < 2**64):
                return [key]
            if after is None:
                if reserved is not None:
                    return [key]
                snapshots[key] = PendingPhilox(device, seed, None, None)
            else:
                if not (isinstance(reserved, list) and len(reserved) == 2 and all(type(x) is int for x in reserved)
                        and 0 <= reserved[0] <= _MAX_32BIT and reserved[1] in (2, 4) and isinstance(after, str)):
                    return [key]
                if after in todo:
                    continue
                prev = snapshots.get(after)
                if not isinstance(prev, PendingPhilox) or prev.device != device or prev.seed != seed:
                    return [key]
                snapshots[key] = PendingPhilox(device, seed, prev, Reservation(*reserved))
            del todo[key]
            progress = True
        if not progress:
            return sorted(todo)  # links that follow nothing decodable (a cycle, a missing key)
    return []
