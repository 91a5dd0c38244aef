"""What autograd keeps of the capture's tensors besides their ops: gradient hooks, writes it did not see.

Gradient hooks (``Tensor.register_hook``) of tensors computed with autograd, as torch keeps them:
a dict of hooks on the tensor, registered on its ``grad_fn`` of the moment. An in-place write
with autograd on gives the tensor another ``grad_fn`` and clears the dict; the old dict stays
with the old ``grad_fn``, so those hooks see the gradient of the value before the write. The
capture notes each dict on the node of its tensor with the position it was registered at
(``HOOK_DICTS``), so that ``fxinit.autograd_replay`` registers it there too.
"""

from __future__ import annotations

import torch
import torch.fx as fx

_BACKWARD_HOOKS = torch._C.TensorBase._backward_hooks

#: ``node.meta`` key: ``[(position, hook dict), ...]`` registered on that node's tensor while it had a ``grad_fn``
HOOK_DICTS = "hook_dicts"
#: ``node.meta`` key: an in-place write autograd did not see though it was on, none of its tensors
#: requiring grad: one through ``.data`` (``self.b.data.fill_(0)``, recorded on ``b``'s node), or
#: to a plain buffer. It changes no ``grad_fn``, in the replay either.
UNTRACKED = "untracked"


def backward_hooks(t: torch.Tensor) -> dict | None:
    """The dict of gradient hooks ``register_hook`` gave ``t`` (None: none, or an in-place write since)."""
    with torch._C.DisableTorchFunctionSubclass():
        return _BACKWARD_HOOKS.__get__(t)


def register_hook_dict(t: torch.Tensor, hooks: dict) -> None:
    """``hooks`` on ``t`` as ``register_hook`` puts them: on its ``grad_fn`` as it is now (a
    non-leaf's; an in-place write after gives it another, which they do not follow)."""
    with torch._C.DisableTorchFunctionSubclass():
        _BACKWARD_HOOKS.__set__(t, hooks)
        if t.grad_fn is not None:
            t.grad_fn._register_hook_dict(t)


def clear_hooks(t: torch.Tensor) -> None:
    """``t`` without gradient hooks of its own (those registered stay where they went)."""
    with torch._C.DisableTorchFunctionSubclass():
        _BACKWARD_HOOKS.__set__(t, None)


def note_new_hooks(t: torch.Tensor, before: dict | None, node: fx.Node, position: int) -> None:
    """Note on ``node`` the hook dict ``register_hook`` just gave ``t``, if it is a new one."""
    hooks = backward_hooks(t)
    if hooks is not None and hooks is not before:
        node.meta.setdefault(HOOK_DICTS, []).append((position, hooks))


def note_untracked(meta: dict, inputs: list[torch.Tensor]) -> None:
    """Mark the node of an in-place write autograd does not see (``UNTRACKED``)."""
    if meta.get("mutates") and torch.is_grad_enabled() and not any(t.requires_grad for t in inputs):
        meta[UNTRACKED] = True
