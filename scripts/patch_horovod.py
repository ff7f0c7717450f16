"""Patch an unpacked Horovod 0.28.1 sdist: two fixes to the Gloo contexts of process sets.

Both are in ``GlooContext::InitializeForProcessSet`` (``horovod/common/gloo/gloo_context.cc``):

1. **The interface.** As released, a process set's device is built from the new context's ``gloo_iface_``,
   which is never set, so its Gloo context binds to the address the hostname resolves to (loopback on
   Debian's default /etc/hosts) instead of the interface the global context uses (HOROVOD_GLOO_IFACE).
2. **The cross-host context.** A process set's cross context joins the set's ranks that have the same
   *global* local rank (one per host), but its rendezvous scope was named by the rank's local rank *within
   the set*. Where a set holds different ranks of different hosts (ranks 1, 2 and 3 of hosts running
   ranks 0-1 and 2-3: rank 1 is the set's first rank on its host, rank 3 the second on its own), the two
   members wait in differently named scopes for each other until the Gloo timeout ("Wait timeout after
   ... seconds for key(s): 0"). The scope is named by the global local rank, which all its members share.
"""
import pathlib
import sys

PATCHES = [
    ("device_attr.iface = gloo_iface_;", "device_attr.iface = global_context.gloo_iface_;"),
    ("std::to_string(local_rank) + process_set_suffix",
     "std::to_string(global_context.local_ctx->rank) + process_set_suffix"),
]


def main(source_dir):
    path = pathlib.Path(source_dir) / "horovod" / "common" / "gloo" / "gloo_context.cc"
    text = path.read_text()
    start = text.index("void GlooContext::InitializeForProcessSet")
    end = text.index("\n}\n", start)
    body = text[start:end]
    for broken, fixed in PATCHES:
        if fixed in body:
            continue
        if body.count(broken) != 1:
            sys.exit(f"patch_horovod: expected one '{broken}' in InitializeForProcessSet of {path}")
        body = body.replace(broken, fixed)
    path.write_text(text[:start] + body + text[end:])


if __name__ == "__main__":
    main(sys.argv[1])
