"""No second derivative, said out loud: the bridge's gradients under create_graph=True.

The kernels have no derivative of their own. A gradient that looked constant to autograd
would drop a second-order term without a word (a gradient penalty, a Hessian-vector
product), so under create_graph=True the bridge's backward returns its gradients behind
a node that raises when it is differentiated. `torch.autograd.function.once_differentiable`
does this only when the incoming gradients require grad, which those of a plain loss do
not; here the node also hangs on the op's inputs, so every path from a gradient back to
them runs into it."""

from __future__ import annotations

import torch

_MESSAGE = (b"the bridge's ops have no second derivative: their gradients cannot be "
            b"differentiated again (create_graph=True)")


def no_second_derivative(grads, inputs):
    """`grads` (tensors or None) as they are, each behind an error node that depends on
    `inputs` (the tensors the op differentiates; at least one requires grad)."""
    present = [g for g in grads if g is not None]
    if not present:
        return tuple(grads)
    error = torch._C._functions.DelayedError(_MESSAGE, len(present) + len(inputs))
    guarded = iter(error(*(g.detach() for g in present), *inputs)[:len(present)])
    return tuple(None if g is None else next(guarded) for g in grads)


def first_order_backward(backward, ctx, *cotangents, num_inputs: int):
    """`backward(ctx, *cotangents)`, the body of an autograd.Function's backward. Under
    create_graph=True its gradients come behind the guard, hung on the first
    `num_inputs` saved tensors (the differentiable inputs)."""
    if not torch.is_grad_enabled():
        return backward(ctx, *cotangents)
    with torch.no_grad():
        grads = backward(ctx, *cotangents)
    return no_second_derivative(grads, ctx.saved_tensors[:num_inputs])
