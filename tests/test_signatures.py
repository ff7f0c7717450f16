"""The swap takes Horovod's arguments in Horovod's order with Horovod's defaults, so a script that passes
them by position means the same thing swapped; DS-Sync's own arguments come after them, by keyword.

Each check runs in a fresh process: importing an adapter sets Horovod's environment (dynamic process sets)
for the jobs launched after it, which must not leak into the test session's."""
import subprocess
import sys

import pytest

from multirank import ROOT

_CHECK = r'''
import inspect, sys
import importlib
ours = importlib.import_module(sys.argv[1]).DistributedOptimizer
horovods = importlib.import_module(sys.argv[2]).DistributedOptimizer
mine = list(inspect.signature(ours).parameters.values())
theirs = list(inspect.signature(horovods).parameters.values())
problems = []
if len(mine) < len(theirs):
    problems.append(f"the swap has {len(mine)} arguments, Horovod {len(theirs)}")
for position, (our, their) in enumerate(zip(mine, theirs)):
    where = f"argument {position} ({their.name!r})"
    if our.name != their.name:
        problems.append(f"{where}: the swap has {our.name!r}")
    elif our.kind != their.kind:
        problems.append(f"{where}: the swap's is {our.kind}, Horovod's {their.kind}")
    elif not (our.default is their.default or our.default == their.default):
        problems.append(f"{where}: the swap's default is {our.default!r}, Horovod's {their.default!r}")
for extra in mine[len(theirs):]:
    if extra.kind != inspect.Parameter.KEYWORD_ONLY:
        problems.append(f"DS-Sync's own argument {extra.name!r} must be keyword-only")
print("\n".join(problems) or "SIGNATURES MATCH")
'''


@pytest.mark.parametrize("ours,horovods", [("hvd_dssync.torch", "horovod.torch"),
                                           ("hvd_dssync.keras", "horovod.tensorflow.keras")], ids=["torch", "keras"])
def test_signature_matches_horovod(ours, horovods):
    result = subprocess.run([sys.executable, "-c", _CHECK, ours, horovods], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin",
                                                         "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "SIGNATURES MATCH", result.stdout
