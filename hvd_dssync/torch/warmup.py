"""The warm-up's bulk-synchronous step in the PyTorch adapter: the gradients allreduced over the optimizer's
ranks, as Horovod's optimizer does, with the step's signature riding along."""
import horovod.torch as hvd
import torch

from . import collectives

__all__ = ["average_gradients"]


def average_gradients(world, step, named_parameters, compression, guard, name, op, gradient_predivide_factor,
                      sparse_as_dense):
    """The warm-up's bulk-synchronous step: the gradients allreduced over the scope, as Horovod does, with
    Horovod's ``op``, ``gradient_predivide_factor`` and ``sparse_as_dense``."""
    params = [p for _, p in named_parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            # Every rank must reduce the same tensors; a parameter unused here contributes zeros.
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse and not sparse_as_dense:
            raise ValueError("sparse gradients need sparse_as_dense=True during hvd_dssync's warm-up")
    sparse_dims = [p.grad.sparse_dim() if p.grad.is_sparse else None for p in params]
    grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params]
    prescale, postscale = 1.0, 1.0
    if op == hvd.Average and gradient_predivide_factor != 1.0:
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor
    compressed = [compression.compress(g) for g in grads]
    action = world.plan.action(step)
    signature = guard.signature(world, grads, step)
    with guard.bounded(world, action, step):
        *reduced, signature = collectives.grouped_allreduce([c for c, _ in compressed] + [signature],
                                                            name=f"{name}.bsp", op=op,
                                                            prescale_factor=prescale, postscale_factor=postscale,
                                                            process_set=world.process_set)
    guard.check(world, signature * (world.scope.world_size if op == hvd.Average else 1), action,
                     world.process_set, step)
    for p, g, r, (_, ctx), sparse_dim in zip(params, grads, reduced, compressed, sparse_dims):
        g.copy_(compression.decompress(r, ctx))
        if sparse_dim is not None:
            # The layout the optimizer saw before (an embedding's rows), or its sparse momentum buffer
            # could not add the gradients of later steps.
            p.grad = g.to_sparse(sparse_dim)
