"""How the adaptive policy's figures travel: in an average's own slots, exact in float32, and the drift of a
group read back from two numbers every member holds after the average. No communication here."""
import math

import numpy as np

from .decisions import FIGURES

__all__ = ["encode_figures", "decode_figures", "drift_of"]

# Figures travel as whole numbers of this unit (10 us, or 1e-5 of drift), each below 2**23, so that in
# float32 a slot holding one rank's number and zeros elsewhere sums to that number exactly in any order.
_UNIT, _CAP = 1e-5, 2 ** 23 - 1


def encode_figures(figures, rank, size):
    """``figures`` (one rank's row, :data:`FIGURES`' order) in this rank's slots of a vector of ``size``
    rows, zeros elsewhere: averaged (or summed) over the ranks, it holds every rank's row
    (:func:`decode_figures`), and every rank reads the same numbers. NaN travels as -1.

    Example::

        >>> v = sum(encode_figures([[0.01, 0.2, float("nan"), 0.003, 0.05]], r, 2) for r in range(2)) / 2
        >>> decode_figures(v, 2, averaged=True)[1].tolist()
        [0.01, 0.2, nan, 0.003, 0.05]
    """
    row = np.asarray(figures, dtype=np.float64).reshape(len(FIGURES))
    units = np.where(np.isfinite(row), np.minimum(np.round(np.nan_to_num(row) / _UNIT), _CAP), -1.0)
    out = np.zeros((size, len(FIGURES)))
    out[rank] = np.maximum(units, -1.0)
    return out.reshape(-1)


def decode_figures(vector, size, averaged=False):
    """Every rank's figures, ``(size, len(FIGURES))``, from the slots of :func:`encode_figures` summed over
    the ranks (``averaged``: divided by ``size``, as an average returns them).

    Example::

        >>> decode_figures(encode_figures([[0.5, float("nan"), 0.25, 0.0, 0.25]], 0, 1), 1).tolist()
        [[0.5, nan, 0.25, 0.0, 0.25]]
    """
    units = np.round(np.asarray(vector, dtype=np.float64).reshape(size, len(FIGURES)) * (size if averaged else 1))
    return np.where(units < 0, np.nan, units * _UNIT)


def drift_of(mean_square_norm, averaged_square_norm):
    """The relative distance of a group's models before they were averaged, from two numbers every
    member has after the average: the members' mean squared norm and the averaged model's squared norm.

    ``mean_i |x_i|^2 - |mean x|^2`` is the mean squared distance to the mean, so the drift is its root over
    ``|mean x|`` (float32 sums resolve about 3e-4). No communication.

    Example::

        >>> round(drift_of((1.0 + 9.0) / 2, 4.0), 3)   # models 1 and 3: mean 2, each 1 away
        0.5
    """
    spread = max(float(mean_square_norm) - float(averaged_square_norm), 0.0)
    return math.sqrt(spread) / max(math.sqrt(float(averaged_square_norm)), 1e-30)
