"""An adaptive policy: the ranks measure what their averages cost, and change mode and period together.

While the network is fast, every averaging step averages over all ranks (the models stay identical);
when a global average costs much more than a group average (a contended link, a slow host), the steps
average inside the schedule's groups instead; the averaging period (``average_every``) grows when an
average costs well above the least it has cost and shrinks back when it no longer does. When the models
drift apart beyond a bound, the next window ends with a global average.

Every rank must take each decision at the same step, so decisions are taken only at the last step of a
*window* of ``decide_every`` steps that ends with a global average, from every rank's figures, by
:func:`decide`, a pure function of those figures and the previous decision. Under global averaging every
window ends so, and the figures ride along in that global average (:func:`encode_figures`: each rank
fills its own slots, the others are zeros, so every rank reads the same numbers): the policy adds no
collective of its own. Under group averaging one window in ``probe_every`` does (a *probe* window, whose
last average is global): the probe's own time is the fresh global figure, so the ranks gather their
figures after it, in one small collective (:meth:`AdaptiveState.end_step` keeps the two apart; the
last rank to arrive at the probe waits for nobody, so the least time over the ranks is the collective's
cost). The ranks start with group averages, every ``first_period`` steps (the longest period by default:
few averages, whose cost they do not know yet; the schedule starts where the last of them is a bridge:
:func:`hvd_dssync.plan.first_crossing`), and gather their figures at the end of the first window, with
no global average in it: before any global average was measured, it is taken to cost what the costliest
group average that crossed the racks cost on the ranks that crossed (a global average crosses every link
that any group crosses, the slow one between racks included, which the topology-aware schedule's bridge
steps cross), and on a fast network, where every group average costs alike, that says: global averages
from then on. Under global averaging the last group figure is kept, and the policy switches when the
global average's measured cost makes that figure worth it.

The schedule advances once per average, global ones included, so that a window of ``decide_every /
period`` averages, a multiple of the topology-aware schedule's cycle (``intra_steps + 1``), ends where
the schedule crosses the racks: a probe takes the place of a bridge step, which crossed the slow links
anyway, and costs only what a global average costs more than a bridge.

A window counted in steps lasts long when steps become slow (a slowed link makes every global average
slow), so under global averaging every global average inside a window is an *early check*
(``switch_early``): the figures of the last period reach every rank there, and the ranks switch to group
averages when they say so twice in a row, or once by far (:meth:`AdaptiveState.check_early`). By default
they ride along that global average (no collective of the policy's own) and the switch takes effect after
it: a slowed link costs two slow global averages, the one that measured it and the one that carried its
figures. With ``switch_early="exchange"`` the ranks exchange them just before it, in one small allreduce
of their own, and switch that very average: one slow global average, for a small collective before every
global average inside a window (docs/tuning.md says what it cost on the bench). Everything else
waits for the window's end. The PyTorch adapter does this; the Keras adapter, whose traced steps follow a
table made for the whole window, decides at windows' ends only.

The period follows the cost of an average as it moves: it doubles when the chosen mode's average costs
``raise_ratio`` times the least it has cost in this job (per doubling already made), and halves back when
the cost falls to ``lower_ratio`` times it. The optimizer's ``average_every`` is the user's choice for the
network at its best, so the policy keeps it while the network stays as fast as it has been.

Where things are: :mod:`~hvd_dssync.adaptive.settings` (:class:`AdaptivePolicy`),
:mod:`~hvd_dssync.adaptive.decisions` (:data:`FIGURES`, :class:`Decision`, :func:`decide`),
:mod:`~hvd_dssync.adaptive.state` (:class:`AdaptiveState`), :mod:`~hvd_dssync.adaptive.wire` (how the
figures travel). Every name is imported from here.
"""
from .decisions import FIGURES, Decision, decide, initial_decision
from .settings import AdaptivePolicy
from .state import AdaptiveState
from .wire import decode_figures, drift_of, encode_figures

__all__ = ["AdaptivePolicy", "Decision", "decide", "AdaptiveState", "FIGURES", "encode_figures", "decode_figures",
           "initial_decision", "drift_of"]
