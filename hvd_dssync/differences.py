"""Lossy compression of an average by differences from a shared reference, the rule both adapters follow.

A lossy compression ``C`` (Horovod's ``Compression.fp16``) applied to the models themselves would round
away every update smaller than its resolution, step after step. So a group averages its members'
differences from a reference ``r`` that every rank of the scope holds alike:

- rank ``j`` sends ``C(x_j - r)`` (:func:`compress_difference`);
- it keeps ``r + mean_k C(x_k - r) + (x_j - r - C(x_j - r))`` (:func:`mix_difference`): the group's mean
  is kept exactly (up to the collective's own arithmetic on the compressed differences), and each rank
  stays within its own compression error of it, so an update below the compression's resolution is
  carried, never rounded away;
- ``r`` is set by an exact, uncompressed average over the scope once the warm-up is over (the same step on
  every rank, whatever its group), and moved by global averages only, each by the mean it received (the
  same on every rank), so that it stays the same on every rank. A group average leaves it as it is.

Framework-free: the values are tensors of any framework with ``+`` and ``-`` (PyTorch, TensorFlow, NumPy),
and ``compression`` is Horovod's (``compress(tensor) -> (compressed, context)``,
``decompress(compressed, context)``). The adapters run the collective and write the results back, in
place or in the graph.
"""

__all__ = ["compress_difference", "mix_difference"]


def compress_difference(value, reference, compression):
    """What a member sends of one tensor: ``(difference, compressed, context)``, where ``difference`` is
    ``value - reference`` and ``compressed, context = compression.compress(difference)``; the compressed
    differences are averaged over the group, the rest is kept for :func:`mix_difference`.

    Example::

        >>> import numpy as np
        >>> class Half:  # a lossy compression, as Horovod's Compression.fp16
        ...     compress = staticmethod(lambda t: (t.astype(np.float16), t.dtype))
        ...     decompress = staticmethod(lambda t, dtype: t.astype(dtype))
        >>> difference, compressed, context = compress_difference(np.array([1.0001]), np.array([1.0]), Half)
        >>> compressed.dtype, context
        (dtype('float16'), dtype('float64'))
    """
    difference = value - reference
    compressed, context = compression.compress(difference)
    return difference, compressed, context


def mix_difference(reference, averaged, difference, compressed, context, compression):
    """What a member keeps of one tensor once the group averaged the compressed differences: ``(kept,
    received)``.

    ``averaged`` is the group's mean of the compressed differences; ``difference``, ``compressed`` and
    ``context`` are this member's from :func:`compress_difference`. ``received`` is the mean decompressed, by
    which a global average moves the reference (a group average does not); ``kept`` is
    ``reference + received + (difference - decompressed own difference)``: the group's mean plus this
    member's own compression error.

    Example::

        >>> import numpy as np
        >>> class Half:
        ...     compress = staticmethod(lambda t: (t.astype(np.float16), t.dtype))
        ...     decompress = staticmethod(lambda t, dtype: t.astype(dtype))
        >>> reference = np.array([1.0])
        >>> sent = [compress_difference(np.array([x]), reference, Half) for x in (1.0001, 1.0003)]
        >>> mean = (sent[0][1] + sent[1][1]) / 2                          # the collective
        >>> kept = [mix_difference(reference, mean, *s, Half)[0] for s in sent]
        >>> round(float(kept[0][0] + kept[1][0]) / 2, 6)                  # the group's mean is kept
        1.0002
        >>> float(np.float16(1.0001) + np.float16(1.0003)) / 2            # the models compressed: it is lost
        1.0
    """
    received = compression.decompress(averaged, context)
    kept = reference + received + (difference - compression.decompress(compressed, context))
    return kept, received
