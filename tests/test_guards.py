"""The run-time guards of the core (no Horovod): the step signature's verdict, the NCCL decision."""
import numpy as np
import pytest

from hvd_dssync.guards import check_nccl_process_sets, describe_step_drift, step_signature, steps_differ


@pytest.mark.parametrize("members", [2, 3, 7, 64, 1000])
def test_step_signature_tells_equal_from_different_steps(members):
    rng = np.random.default_rng(members)
    for base in [0, 1, 5, 16383, 16384, 10**6, 2**31 + 12345, 2**32 - 2]:
        same = np.sum([step_signature(base)] * members, axis=0)
        averaged = same / members * members  # what an Average leaves after the adapter's rescaling
        assert not steps_differ(same, members) and not steps_differ(averaged, members), (base, members)
        for delta in (1, -1, 2**14, 2**28):
            other = base + delta
            if not 0 <= other < 2**32:
                continue
            steps = [base] * members
            steps[int(rng.integers(members))] = other
            total = np.sum([step_signature(s) for s in steps], axis=0)
            assert steps_differ(total, members) and steps_differ(total / members * members, members), \
                (base, delta, members)
    # Steps placed symmetrically around a rank's own step: the mean alone would not tell.
    assert steps_differ(np.sum([step_signature(s) for s in (4, 5, 6)], axis=0), 3)


def test_step_signature_range_is_checked():
    with pytest.raises(ValueError, match="out of range"):
        step_signature(-1)
    with pytest.raises(ValueError, match="out of range"):
        step_signature(2**32)


def test_drift_message_names_every_rank_and_step():
    message = describe_step_drift({1: 6, 0: 7, 2: 7})
    assert "rank 0 at step 7, rank 1 at step 6, rank 2 at step 7" in message


@pytest.mark.parametrize("window_steps,nccl_built,on_gpu,gpu_operations,refused", [
    (None, 2708, True, None, False),     # endless window: sets never removed, ids never reused
    (100, 0, True, None, False),         # no NCCL in this Horovod: GPU tensors go through MPI
    (100, 2708, False, None, False),     # CPU tensors: Gloo or MPI, no NCCL communicator
    (100, 2708, True, "MPI", False),     # Horovod built with MPI for GPU operations
    (100, 2708, True, None, True),
    (100, 2708, True, "NCCL", True),
    (100, 2708, True, "nccl ", True),
])
def test_nccl_with_finite_windows_is_refused(window_steps, nccl_built, on_gpu, gpu_operations, refused):
    if refused:
        with pytest.raises(ValueError, match=r"Arg ``schedule_options``.*every 100 steps.*NCCL"):
            check_nccl_process_sets(window_steps, nccl_built, on_gpu, gpu_operations)
    else:
        check_nccl_process_sets(window_steps, nccl_built, on_gpu, gpu_operations)
