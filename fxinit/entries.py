"""The tensors a model's checkpoint holds, by the keys of its ``state_dict()``.

Without state-dict hooks or overrides those are its parameters and persistent buffers
under their fully qualified names. With them (torchtitan's fused QKV splits ``wqkv`` into
``wq``/``wk``/``wv`` in a post-hook; quantized modules pack their weights), the keys and
the tensors are what ``state_dict()`` returns: it runs on the deferred model, the hooks'
ops are recorded like any other, and exports write what eager's ``state_dict()`` would.
``init_graph`` and every export take their names from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxinit.capture.names import tensor_slots
from fxinit.errors import DeferredInitError

_PLAIN_STATE_DICT = torch.nn.Module.state_dict
_PLAIN_SAVE = torch.nn.Module._save_to_state_dict
_PLAIN_GET_EXTRA_STATE = torch.nn.Module.get_extra_state


@dataclass(frozen=True)
class Entry:
    """One tensor of the model under one name; ``persistent``: ``state_dict()`` holds it."""

    key: str
    tensor: torch.Tensor
    is_parameter: bool
    persistent: bool = True


def has_state_dict_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module.state_dict()`` may differ from its persistent parameters and buffers."""
    if type(module).state_dict is not _PLAIN_STATE_DICT:
        return True
    return any(m._state_dict_hooks or m._state_dict_pre_hooks or type(m)._save_to_state_dict is not _PLAIN_SAVE
               for m in module.modules())


def extra_state_keys(module: torch.nn.Module) -> list[str]:
    """The keys of ``module.state_dict()`` that hold a module's extra state (``get_extra_state``:
    megatron-core's parallel linears, Transformer Engine's layers), not a tensor of the model."""
    return [f"{path}{'.' if path else ''}_extra_state" for path, mod in module.named_modules(remove_duplicate=False)
            if type(mod).get_extra_state is not _PLAIN_GET_EXTRA_STATE]


def model_entries(module: torch.nn.Module, non_persistent: bool = False) -> list[Entry]:
    """The tensors of ``module.state_dict()`` in its order, each tied name included (not the
    modules' extra states: ``extra_state_keys``); with ``non_persistent``, the non-persistent
    buffers after them (the slots' order when the model has no state-dict hooks)."""
    if not has_state_dict_hooks(module):
        return [Entry(fqn, t, kind == "_parameters",
                      kind == "_parameters" or name not in mod._non_persistent_buffers_set)
                for fqn, mod, kind, name, t in tensor_slots(module)
                if non_persistent or kind == "_parameters" or name not in mod._non_persistent_buffers_set]
    parameters = {id(p) for _, mod in module.named_modules(remove_duplicate=False) for p in mod._parameters.values()}
    extra = set(extra_state_keys(module))
    state = {k: v for k, v in module.state_dict(keep_vars=True).items() if k not in extra}
    other = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if other:
        raise DeferredInitError(
            f"this model's state_dict() holds entries that are not tensors ({', '.join(other[:4])}): fxinit writes "
            "checkpoints of tensors", hint="materialize the model and save its state_dict() with torch")
    out = [Entry(k, v, id(v) in parameters) for k, v in state.items()]
    if non_persistent:
        out += [Entry(fqn, t, False, False) for fqn, mod, kind, name, t in tensor_slots(module)
                if kind == "_buffers" and name in mod._non_persistent_buffers_set]
    return out
