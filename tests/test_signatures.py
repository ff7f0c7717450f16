"""The swap takes Horovod's arguments in Horovod's order with Horovod's defaults, so a script that passes
them by position means the same thing swapped; DS-Sync's own arguments come after them, by keyword."""
import inspect

import pytest


def _check_prefix(ours, horovods):
    mine = list(inspect.signature(ours).parameters.values())
    theirs = list(inspect.signature(horovods).parameters.values())
    assert len(mine) >= len(theirs)
    for position, (our, their) in enumerate(zip(mine, theirs)):
        where = f"argument {position} ({their.name!r})"
        assert our.name == their.name, f"{where}: the swap has {our.name!r}"
        assert our.kind == their.kind, f"{where}: the swap's is {our.kind}, Horovod's {their.kind}"
        assert our.default is their.default or our.default == their.default, \
            f"{where}: the swap's default is {our.default!r}, Horovod's {their.default!r}"
    for extra in mine[len(theirs):]:
        assert extra.kind == inspect.Parameter.KEYWORD_ONLY or extra.name == "num_groups", \
            f"DS-Sync's own argument {extra.name!r} must be keyword-only"


def test_torch_signature_matches_horovod():
    import horovod.torch as hvd

    import hvd_dssync.torch as dss

    _check_prefix(dss.DistributedOptimizer, hvd.DistributedOptimizer)


def test_keras_signature_matches_horovod():
    pytest.importorskip("tensorflow")
    import horovod.tensorflow.keras as hvd

    import hvd_dssync.keras as dss

    _check_prefix(dss.DistributedOptimizer, hvd.DistributedOptimizer)
