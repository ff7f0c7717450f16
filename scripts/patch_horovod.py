"""Patch an unpacked Horovod 0.28.1 sdist: two fixes to the Gloo contexts of process sets, a cheaper
cycle with dynamic process sets, and waits that do not starve Horovod's own threads.

The fixes are in ``GlooContext::InitializeForProcessSet`` (``horovod/common/gloo/gloo_context.cc``):

1. **The interface.** As released, a process set's device is built from the new context's ``gloo_iface_``,
   which is never set, so its Gloo context binds to the address the hostname resolves to (loopback on
   Debian's default /etc/hosts) instead of the interface the global context uses (HOROVOD_GLOO_IFACE).
2. **The cross-host context.** A process set's cross context joins the set's ranks that have the same
   *global* local rank (one per host), but its rendezvous scope was named by the rank's local rank *within
   the set*. Where a set holds different ranks of different hosts (ranks 1, 2 and 3 of hosts running
   ranks 0-1 and 2-3: rank 1 is the set's first rank on its host, rank 3 the second on its own), the two
   members wait in differently named scopes for each other until the Gloo timeout ("Wait timeout after
   ... seconds for key(s): 0"). The scope is named by the global local rank, which all its members share.

3. **Dynamic process sets, agreed every few cycles** (``horovod/common/operations.cc``). With
   ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` every cycle of Horovod's background loop begins with a global
   allgather in which the ranks agree on sets added or removed since; DS-Sync's steps are many short cycles,
   and that exchange crosses the slowest link each time. The patch runs it on one cycle in
   ``HOROVOD_DYNAMIC_PROCESS_SETS_CHECK_EVERY`` (default 16; 1 is Horovod's behaviour). Every rank runs the
   same cycles (each cycle negotiates the global set, a collective) and counts them from 0 at each start of
   the background loop, so all ranks still agree on the same cycles; a set added or removed waits up to
   that many cycles longer.

4. **Waiting without starving the workers** (``horovod/tensorflow/mpi_ops.cc``). TensorFlow's in-place
   broadcast waits for Horovod's background thread by calling ``sched_yield`` in a loop (as
   ``hvd.synchronize`` did, which scripts/patches/waiting-handles.patch makes block until woken). Where ranks outnumber cores (tests, CI, a laptop),
   the spinning Python threads keep the background and Gloo threads that do the work off the CPU: on a 2-core
   machine (Linux 6.18) a 3-rank job's background and Gloo threads waited 0.4-0.6 s of every second for a
   core, collectives that take milliseconds took seconds, and some ran past Gloo's 30 s timeout
   (docs/reliability.md). The patch yields 16 times, then sleeps between polls, 50 microseconds doubling up to 1 ms.
"""
import pathlib
import sys

PATCHES = [
    ("device_attr.iface = gloo_iface_;", "device_attr.iface = global_context.gloo_iface_;"),
    ("std::to_string(local_rank) + process_set_suffix",
     "std::to_string(global_context.local_ctx->rank) + process_set_suffix"),
]


# Dynamic process sets agreed every few cycles (see 3 above), in horovod/common/operations.cc.
CYCLE_PATCHES = [
    ("bool RunLoopOnce(HorovodGlobalState& state);\n",
     "bool RunLoopOnce(HorovodGlobalState& state);\n\n"
     "// Dynamic process sets are agreed on one cycle in dynamic_check_every (build patch, see above).\n"
     "static int dynamic_check_every = 1;\n"
     "static long long dynamic_check_cycle = 0;\n"),
    ("      GetBoolEnvOrDefault(HOROVOD_DYNAMIC_PROCESS_SETS, false);\n",
     "      GetBoolEnvOrDefault(HOROVOD_DYNAMIC_PROCESS_SETS, false);\n"
     "  dynamic_check_every =\n"
     "      GetIntEnvOrDefault(\"HOROVOD_DYNAMIC_PROCESS_SETS_CHECK_EVERY\", 16);\n"
     "  if (dynamic_check_every < 1) dynamic_check_every = 1;\n"
     "  dynamic_check_cycle = 0;\n"),
    ("  if (state.dynamic_process_sets) {\n    // Initialize any newly added",
     "  if (state.dynamic_process_sets &&\n"
     "      dynamic_check_cycle++ % dynamic_check_every == 0) {\n    // Initialize any newly added"),
]


# Waits: yield a few times, then sleep between polls (see 4 above).
BACKOFF_STATE = "int polls = 0, pause_us = 50;  // build patch: back off, see scripts/patch_horovod.py"
BACKOFF = ("if (++polls <= 16) { std::this_thread::yield(); } else { "
           "std::this_thread::sleep_for(std::chrono::microseconds(pause_us)); "
           "pause_us = pause_us < 1000 ? 2 * pause_us : 1000; }")
WAIT_PATCHES = {
    "tensorflow/mpi_ops.cc": [
        ("    while (!any_failures_and_tensors_done->first.load() &&\n"
         "           any_failures_and_tensors_done->second.load() < num_variables_) {\n"
         "      std::this_thread::yield();\n",
         "    " + BACKOFF_STATE + "\n"
         "    while (!any_failures_and_tensors_done->first.load() &&\n"
         "           any_failures_and_tensors_done->second.load() < num_variables_) {\n"
         "      " + BACKOFF + "\n"),
    ],
}

# Whole-file patches, by path under horovod/: (what the release has, what the patch makes it), each once.
FILE_PATCHES = {"common/operations.cc": CYCLE_PATCHES, **WAIT_PATCHES}


def _replace_once(text, patches, where):
    """``text`` with each ``(release, patched)`` pair applied: ``release`` must occur once, unless the
    text is patched already (the script may run twice on one tree)."""
    for release, patched in patches:
        if patched in text:
            continue
        if text.count(release) != 1:
            sys.exit(f"patch_horovod: expected one {release!r} in {where}")
        text = text.replace(release, patched)
    return text


def main(source_dir):
    for name, patches in FILE_PATCHES.items():
        path = pathlib.Path(source_dir) / "horovod" / name
        path.write_text(_replace_once(path.read_text(), patches, path))
    path = pathlib.Path(source_dir) / "horovod" / "common" / "gloo" / "gloo_context.cc"
    text = path.read_text()
    start = text.index("void GlooContext::InitializeForProcessSet")
    end = text.index("\n}\n", start)
    body = _replace_once(text[start:end], PATCHES, f"InitializeForProcessSet of {path}")
    path.write_text(text[:start] + body + text[end:])


if __name__ == "__main__":
    main(sys.argv[1])
