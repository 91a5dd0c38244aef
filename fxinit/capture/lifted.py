"""Real tensors that require grad, lifted as graph constants above autograd.

Real tensors next to deferred ones are lifted before the op runs (``capture.deferred``), where
composite functions check devices. A copy out of autograd's sight would cut eager's edge to
the real tensor: ``x @ w.t()`` (a closure over a traced model's weight) then gave a backward
that silently left ``x.grad`` empty. ``LiftedWithGrad`` makes the copy with that edge.
"""

from __future__ import annotations

from typing import Any

import torch


class LiftedWithGrad(torch.autograd.Function):
    """A real tensor that requires grad, lifted as a graph constant above autograd: the lifted
    copy keeps eager's edge to it, so that a backward through the deferred result reaches it,
    and refuses there: its gradient would be computed from values not materialized yet (eager's
    ``x @ w.t()`` gives ``x.grad``; fxinit's had silently given none)."""

    @staticmethod
    def forward(ctx: Any, real: torch.Tensor, recorder: Any) -> torch.Tensor:  # type: ignore[override]
        lifted = recorder.lift(real, with_grad=True)
        ctx.refusal = recorder.fail(
            "a backward through deferred tensors reached a real tensor that requires grad (handed to the "
            "constructor, or computed with after the trace): its gradient depends on values that are not "
            "materialized yet", op="backward",
            hint="materialize the deferred tensors before the backward (fxinit.materialize), or detach the real "
                 "tensor if it needs no gradient")
        return lifted

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        raise ctx.refusal


#: the ``grad_fn`` class of such a lifted copy: an edge that eager's graph does not have
#: (``grad_graphs`` passes through it)
LIFTED_WITH_GRAD = LiftedWithGrad._backward_cls
