"""The project's Horovod build (scripts/setup.sh, scripts/patch_horovod.py): the patch for dynamic process sets
is in the library, sets added and removed while training still agree with it, and a rank waiting for a
late peer leaves the core to the threads that do the work."""
import glob
import os

import pytest

from multirank import LAUNCHERS, run


def _horovod_library():
    import horovod

    (path,) = glob.glob(os.path.join(os.path.dirname(horovod.__file__), "torch", "mpi_lib_v2*.so"))
    return path


def test_the_built_horovod_agrees_on_dynamic_sets_every_few_cycles():
    with open(_horovod_library(), "rb") as f:
        assert b"HOROVOD_DYNAMIC_PROCESS_SETS_CHECK_EVERY" in f.read(), \
            "Horovod was built without scripts/patch_horovod.py's cycle patch: run scripts/setup.sh"


@pytest.mark.multirank
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_dynamic_sets_agree_when_checked_every_64_cycles(launcher):
    """Sets added and removed with one rank late to each registration: with the check every 64 cycles the
    ranks still register and remove every set together (an allreduce in each, unnamed ops between)."""
    output = run(launcher, 3, "dynamic_sets.py", timeout=120, env={"HOROVOD_DYNAMIC_PROCESS_SETS_CHECK_EVERY": "64"})
    assert output.count("all checks passed") == 3, output


@pytest.mark.multirank
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_waiting_rank_leaves_the_core(launcher):
    """Rank 0's main thread waits 3 s in ``hvd.allreduce`` for rank 1 using under a quarter of that in CPU time
    (a spinning wait uses all of it)."""
    output = run(launcher, 2, "wait_cpu.py", timeout=120)
    assert output.count("all checks passed") == 2, output
