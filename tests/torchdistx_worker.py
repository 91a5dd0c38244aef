"""A gloo rank running FSDP1's torchdistX scenarios (those of PyTorch's
``test/distributed/fsdp/test_fsdp_meta.py``, restated here: that file is not in torch's wheel)
through ``fxinit.torchdistx``, each compared with eager construction bit for bit.

The stand-in is installed before ``torch.distributed.fsdp`` is imported, as a user's script
would: FSDP1 looks for torchdistX once, at its own import."""

from __future__ import annotations

from typing import Any

import fxinit.torchdistx

fxinit.torchdistx.install()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: E402
from torch.distributed.fsdp import _init_utils  # noqa: E402
from torch.distributed.fsdp.wrap import always_wrap_policy  # noqa: E402
from torchdistx import deferred_init, fake  # noqa: E402

from tests.launch import serve  # noqa: E402


class SeededLinear(nn.Linear):
    """A Linear whose reset_parameters reseeds (as PyTorch's test's MyLinear does)."""

    def reset_parameters(self) -> None:
        torch.manual_seed(42)
        with torch.no_grad():
            nn.init.xavier_uniform_(self.weight, 1.0)


class Buffered(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.buf = nn.Buffer(torch.randn(3, 3, device=device))


class Model(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.lin1 = SeededLinear(2, 2, bias=False, device=device)
        self.lin2 = nn.Linear(2, 2, device=device)  # the default init: draws from the global stream
        self.buf_mod = Buffered(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.lin1(x)) + self.buf_mod.buf.sum()


class Nested(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.lin1 = nn.Linear(2, 2, device=device)
        self.lin2 = SeededLinear(2, 2, bias=False, device=device)
        self.l3 = Model(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.lin2(self.lin1(x)))


def _init_with_torchdistx(module: nn.Module) -> None:
    deferred_init.materialize_module(module, check_fn=lambda k: not isinstance(k, FSDP))


_CALLS: list[nn.Module] = []
_MATERIALIZE_MODULE = deferred_init.materialize_module


def _counted(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    _CALLS.append(module)
    return _MATERIALIZE_MODULE(module, *args, **kwargs)


deferred_init.materialize_module = _counted  # FSDP reads it from the module at each call


def _count_calls() -> list[nn.Module]:
    _CALLS.clear()
    return _CALLS


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compare(cls: type, init_fn: Any, auto_wrap: bool) -> list[str]:
    what = f"{cls.__name__} init_fn={init_fn is not None} auto_wrap={auto_wrap}"
    wrap = {"auto_wrap_policy": always_wrap_policy, "device_id": torch.device("cpu")} if auto_wrap \
        else {"device_id": torch.device("cpu")}
    torch.manual_seed(0)
    deferred = deferred_init.deferred_init(cls, "cpu")
    errors = [] if all(fake.is_fake(p) for p in deferred.parameters()) else [f"{what}: parameters are not fake"]
    calls = _count_calls()
    ours = FSDP(deferred, param_init_fn=init_fn, **wrap)
    if not calls and init_fn is None:  # (a param_init_fn eager's FSDP never calls on a built model: fxinit's own)
        errors.append(f"{what}: FSDP did not materialize through deferred_init.materialize_module")
    torch.manual_seed(0)
    eager = FSDP(cls("cpu"), **wrap)
    want, got = _full(eager), _full(ours)
    errors += [f"{what}: {k} differs" for k in want if not torch.equal(want[k], got[k])]
    x = torch.arange(20.0).reshape(10, 2)
    for m in (ours, eager):
        m(x).sum().backward()
        torch.optim.SGD(m.parameters(), lr=1e-3).step()
    want, got = _full(eager), _full(ours)
    errors += [f"{what}: {k} differs after a step" for k in want if not torch.equal(want[k], got[k])]
    return errors


def _compare_reinit(cls: type, device: str) -> list[str]:
    """A ``param_init_fn`` that initializes afresh (composer's ``to_empty(recurse=False)`` and
    ``reset_parameters``): eager's FSDP calls it on a meta module, never on a built one. Found by
    a sweep of llm-foundry: with the stand-in installed, FSDP's torchdistX branch called it once
    more on a meta-traced unit (other values, silently), and on a CPU-traced one (a crash)."""
    calls: list[str] = []

    def reinit(module: nn.Module) -> None:
        for sub in module.modules():
            if any(t.is_meta for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False))):
                calls.append(type(sub).__name__)
                sub.to_empty(device="cpu", recurse=False)
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
                else:
                    torch.nn.init.uniform_(sub.buf)  # (Buffered's: to_empty leaves it unwritten)

    what = f"{cls.__name__} on {device} with a re-initializing param_init_fn"
    wrap = {"auto_wrap_policy": always_wrap_policy, "device_id": torch.device("cpu"), "param_init_fn": reinit}
    torch.manual_seed(0)
    want, eager_calls = _full(FSDP(cls(device), **wrap)), list(calls)
    eager_rng = torch.get_rng_state()
    calls.clear()
    torch.manual_seed(0)
    got = _full(FSDP(deferred_init.deferred_init(cls, device), **wrap))
    errors = [f"{what}: {k} differs" for k in want if not torch.equal(want[k], got[k])]
    if calls != eager_calls:
        errors.append(f"{what}: param_init_fn ran on {calls}, eager's on {eager_calls}")
    if not torch.equal(torch.get_rng_state(), eager_rng):
        errors.append(f"{what}: the generator is not where eager's is")
    return errors


def _scenarios() -> dict[str, Any]:
    errors: list[str] = []
    if not (_init_utils._TORCHDISTX_AVAIL and _init_utils.deferred_init is fxinit.torchdistx.deferred_init):
        errors.append("FSDP1 did not find fxinit's torchdistX")
    for cls in (Model, Nested):
        for init_fn in (None, _init_with_torchdistx):
            for auto_wrap in (True, False):
                errors += _compare(cls, init_fn, auto_wrap)
        for device in ("meta", "cpu"):
            errors += _compare_reinit(cls, device)
    try:  # PyTorch's test_bad_arg_torchdistx
        FSDP(deferred_init.deferred_init(Nested, "cpu"), param_init_fn=42, device_id=torch.device("cpu"))
        errors.append("param_init_fn=42 was accepted")
    except ValueError as exc:
        if "to be callable" not in str(exc):
            errors.append(f"param_init_fn=42: {exc}")
    return {"torchdistx": errors}


def run(rank: int, world: int, port: int, scenarios: list[str], queue: Any) -> None:
    serve(rank, world, port, queue, _scenarios)
