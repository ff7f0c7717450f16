"""What an average in flight holds (``overlap``: :mod:`.averaging`), the fragments of a global average sent one a
step (:func:`hvd_dssync.fragments.fragment_ranges`), and the buffers they use."""
import time
from typing import NamedTuple

import horovod.torch as hvd
import torch

from ..plan import ring_allreduce_bytes

__all__ = ["InFlight", "Fragments", "send_fragment", "whole_moves", "agreed_with_parts", "fits", "copy_into"]


class InFlight(NamedTuple):
    """An average running behind the local steps (``overlap``), until :meth:`.averaging.Averaging.finish_pending`."""
    handle: int
    names: list  # what the tensors are, for the fold hooks
    tensors: list  # the live model's tensors, which the fold moves
    sent: list  # what this rank sent (for an exact bridge, the model it agreed on)
    received: list  # the average, once done
    signature: torch.Tensor
    action: object
    step: int
    process_set: object
    issued: float  # seconds the issue delayed the step
    nbytes: int
    bridge: object
    parts: list = None  # a fragment of a global average: (name, whole tensor, start, stop) of each part it sent


class Fragments(NamedTuple):
    """A global average in flight in fragments (:attr:`.averaging.Averaging.global_fragments`): fragment ``k``
    is sent at step ``step + k`` and folded in at the next."""
    action: object
    step: int
    process_set: object
    name: str
    ranges: list  # hvd_dssync.fragments.fragment_ranges of the tensors' elements
    sizes: list  # the tensors' elements when the first fragment was sent


def send_fragment(fragments, k, named, buffers, signature_of, step):
    """Send fragment ``k`` of ``fragments`` at ``step``: its parts of the model (``named``: ``(name, tensor)``,
    each one block of memory) copied into ``buffers`` (what this rank sends, what it receives: the model's
    shapes), averaged over the fragments' process set with ``signature_of(tensors)`` riding along. Returns it in
    flight (:class:`InFlight`: its parts, views of the model and the buffers, for the fold)."""
    started = time.perf_counter()
    copy, received = buffers
    parts = fragments.ranges[k]
    tensors = [named[i][1].view(-1)[a:b] for i, a, b in parts]
    sent = copy_into([copy[i].view(-1)[a:b] for i, a, b in parts], tensors)
    into = copy_into([received[i].view(-1)[a:b] for i, a, b in parts], sent)
    signature = signature_of(tensors)
    handle = hvd.grouped_allreduce_async_(into + [signature], name=f"{fragments.name}.{k}", op=hvd.Average,
                                          process_set=fragments.process_set)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return InFlight(handle, [named[i][0] for i, _, _ in parts], tensors, sent, into, signature, fragments.action,
                    step, fragments.process_set, time.perf_counter() - started,
                    ring_allreduce_bytes(len(fragments.action.group), nbytes), None,
                    [(named[i][0], named[i][1], a, b) for i, a, b in parts])


def whole_moves(parts, moves):
    """``(name, move)`` of a fragment's fold for the fold hooks: each tensor it touched, whole, zero outside its
    part (``parts``: :attr:`InFlight.parts`)."""
    whole = {}
    for (name, tensor, a, b), move in zip(parts, moves):
        whole.setdefault(name, torch.zeros_like(tensor)).view(-1)[a:b].copy_(move)
    return list(whole.items())


def agreed_with_parts(agreed, named, parts, averaged):
    """The model a rank's last average left (``agreed``: what its next exact bridge sends; None, or of other
    shapes, where nothing was kept yet: the model as it is now, ``named``'s ``(name, tensor)``) with a fragment's
    parts (:attr:`InFlight.parts`) set to their average, in place where it fits. Returns it."""
    if not fits(agreed, [t for _, t in named]):
        agreed = [t.detach().clone() for _, t in named]
    position = {name: k for k, (name, _) in enumerate(named)}
    with torch.no_grad():
        for (name, _, a, b), average in zip(parts, averaged):
            agreed[position[name]].view(-1)[a:b].copy_(average)
    return agreed


def fits(buffers, tensors):
    """Whether ``buffers`` (or None) can hold ``tensors``: as many, of the same shapes, dtypes and devices."""
    return buffers is not None and len(buffers) == len(tensors) and all(
        b.shape == t.shape and b.dtype == t.dtype and b.device == t.device for b, t in zip(buffers, tensors))


def copy_into(buffers, tensors):
    """``tensors`` copied into ``buffers``; returns the buffers."""
    with torch.no_grad():
        for b, t in zip(buffers, tensors):
            b.copy_(t)
    return buffers
