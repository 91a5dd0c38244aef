"""The values of deferred tensors: slice, plan and run their nodes (``execute``).

``compute_values`` gives the values of a recorder's tensors, exact or portable, cast to a
requested dtype, on the devices eager would have used (or a requested target). On a GPU,
exact mode plans and runs them in waves (``passes.waves``): the GPU fills one wave's tensors
while the host plans the next. ``value_of_at_read`` gives the value a node had when a later
node read it, for ``autograd_links``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from fxinit import execute
from fxinit.capture.deferred import plain_attributes, state_of
from fxinit.capture.devices import device_available
from fxinit.capture.recorder import Recorder
from fxinit.errors import DeferredInitError
from fxinit.execute import slicer
from fxinit.passes.waves import waves
from fxinit.spec import dtype_after_to

TRACED_SEED = -(1 << 70)  # marker: the portable stream uses the seed each trace saw


def stream_seed(recorder: Recorder, seed: int | None) -> int | None:
    """The portable seed of ``recorder``'s tensors: ``seed``, the trace's own for
    ``TRACED_SEED``, None (exact mode) for None."""
    return None if seed is None else (recorder.seed if seed is TRACED_SEED else seed)


def _device_map(nodes: list[fx.Node], target: torch.device | None) -> dict[torch.device, torch.device]:
    """Intended devices missing on this machine, mapped to the requested target."""
    mapping: dict[torch.device, torch.device] = {}
    for n in nodes:
        dev = n.kwargs.get("device") if n.op == "call_function" else None
        if isinstance(dev, torch.device) and dev.type not in ("cpu", "meta") and dev not in mapping:
            if device_available(dev):
                continue
            if target is None:
                raise DeferredInitError(
                    f"these tensors were meant for {dev}, which is not available on this machine",
                    hint="pass device=... to materialize them elsewhere",
                )
            mapping[dev] = target
    return mapping


def _waves(targets: list[tuple[fx.Node, int]], target: torch.device | None, rng: str) -> list[list[int]]:
    """``passes.waves`` for exact values computed on a GPU that is here (its kernels run while
    the next wave is planned); else one wave of everything. Portable mode is not cut: its
    fills run batched in a few launches per plan, and waves took an 8B Llama 6 ms longer on
    an H100."""
    if rng != "exact":
        return [list(range(len(targets)))]
    devices = {n.meta["spec"].device if n.meta.get("spec") is not None else None for n, _ in targets}
    if target is not None:
        devices.add(torch.device(target))
    if not _overlapping(devices):
        return [list(range(len(targets)))]
    return waves(targets, [n.meta["spec"].nbytes for n, _ in targets])


def _overlapping(devices: set[torch.device | None]) -> bool:
    """Whether kernels run on ``devices`` while the host goes on: one CUDA device, here."""
    if not all(d is not None and d.type == "cuda" and device_available(d) for d in devices):
        return False
    return len({d.index if d.index is not None else torch.cuda.current_device() for d in devices}) == 1  # type: ignore[union-attr]


def compute_values(recorder: Recorder, tensors: list[torch.Tensor], target: torch.device | None = None,
                   seed: int | None = None, dtype: torch.dtype | None = None,
                   describe: Callable[[int], str] | None = None,
                   compile: bool | str | None = None) -> list[torch.Tensor]:
    """Values of ``tensors``: exact replay, or the portable stream when ``seed`` is given;
    cast to ``dtype`` by ``Module.to``'s rule if given. ``describe(i)`` names the i-th
    tensor in errors."""
    recorder._check_live()
    targets = [(state_of(t).node, recorder.storage_id(t)) for t in tensors]
    if seed is not None:
        recorder.stamp_module_paths()
    env: dict[fx.Node, Any] = {}
    for wave in _waves(targets, target, "exact" if seed is None else "portable"):
        part = [targets[i] for i in wave]
        todo = execute.plan(recorder, part, rng="exact" if seed is None else "portable", seed=seed, dtype=dtype,
                            devices=lambda nodes: _device_map(nodes, target), compile=compile)
        unwritten = execute.unwritten(todo, part)
        if unwritten:
            raise _unwritten_error(recorder, part, unwritten,
                                   None if describe is None else (lambda i, wave=wave: describe(wave[i])))
        env.update(execute.run(recorder, todo))
    values = []
    for t, (node, _) in zip(tensors, targets):
        v = env[node]
        with plain_attributes():
            shape, want = t.shape, dtype_after_to(t.dtype, dtype)
        if not isinstance(v, torch.Tensor) or v.shape != shape or v.dtype != want:
            raise DeferredInitError(
                f"fxinit internal error: replay produced {type(v).__name__} "
                f"{getattr(v, 'shape', '')} {getattr(v, 'dtype', '')} for a tensor of {tuple(t.shape)} {t.dtype}",
                hint="please report this with the model that triggers it",
            )
        values.append(v)
    return values


def _unwritten_error(recorder: Recorder, targets: list[tuple[fx.Node, int]],
                     unwritten: list[tuple[fx.Node, fx.Node]], describe: Callable[[int], str] | None
                     ) -> DeferredInitError:
    """The safety net of passes.uninitialized: which requested tensors read memory nobody wrote."""
    names = recorder.storage_names()
    involved = {n for pair in unwritten for n in pair}
    hit = [i for i, t in enumerate(targets)
           if involved & set(slicer(recorder).required([t], to_run=True)[0])]
    what = [describe(i) if describe is not None else names.get(targets[i][1], f"tensor {i}") for i in hit]
    alloc = unwritten[0][1]
    return DeferredInitError(
        f"{len(hit)} tensor(s) would be materialized from memory no recorded op wrote: {', '.join(what[:4])}"
        f"{' ...' if len(what) > 4 else ''} (the buffer {alloc.name}, allocated by torch.distributed to receive data, "
        "was never filled while fxinit recorded)",
        op=str(alloc.target), source=getattr(alloc.meta.get("prov"), "source", None),
        hint="a collective or layout step ran on deferred tensors in a way fxinit does not replay; materialize "
             "before that step, and please report the layout that triggers this")


def moved(values: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Move to ``device`` keeping tensors that shared a storage sharing one."""
    moved_storage: dict[int, torch.UntypedStorage] = {}
    out = []
    for v in values:
        if v.device == device:
            out.append(v)
            continue
        st = v.untyped_storage()
        key = st.data_ptr()
        if key not in moved_storage:
            new = torch.UntypedStorage(st.nbytes(), device=device)
            new.copy_(st)
            moved_storage[key] = new
        out.append(torch.empty(0, dtype=v.dtype, device=device).set_(
            moved_storage[key], v.storage_offset(), v.size(), v.stride()))
    return out


def value_of_at_read(target: torch.device | None, seed: Any,
                     compile: bool | str | None) -> Callable[[Recorder, fx.Node, fx.Node], torch.Tensor]:
    """``autograd_links.ValueOf``: the value a node had when ``reader`` read it (not the final
    value of its storage), computed as a materialize with these arguments computes values
    (``seed``: its portable seed, ``TRACED_SEED`` or None): the slice of the two, without any
    write after ``reader``."""
    def value_of(rec: Recorder, node: fx.Node, reader: fx.Node) -> torch.Tensor:
        portable = stream_seed(rec, seed)
        todo = execute.plan(rec, [(reader, _NO_STORAGE), (node, _NO_STORAGE)],
                            rng="exact" if portable is None else "portable", seed=portable,
                            devices=lambda nodes: _device_map(nodes, target), compile=compile)
        value = execute.run(rec, todo)[node]
        return value if target is None else moved([value], target)[0]

    return value_of


#: A target's storage id that no node writes: its slice ends at the node (no later writes).
_NO_STORAGE = -1
