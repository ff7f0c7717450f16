"""Patch an unpacked Horovod 0.28.1 sdist so that process sets honour HOROVOD_GLOO_IFACE.

As released, ``GlooContext::InitializeForProcessSet`` builds its device from the new context's
``gloo_iface_``, which is never set, so a process set's Gloo context binds to the address the hostname
resolves to (loopback on Debian's default /etc/hosts) instead of the interface the global context uses.
"""
import pathlib
import sys

BROKEN = "device_attr.iface = gloo_iface_;"
FIXED = "device_attr.iface = global_context.gloo_iface_;"


def main(source_dir):
    path = pathlib.Path(source_dir) / "horovod" / "common" / "gloo" / "gloo_context.cc"
    text = path.read_text()
    start = text.index("void GlooContext::InitializeForProcessSet")
    end = text.index("\n}\n", start)
    body = text[start:end]
    if FIXED in body:
        return
    if body.count(BROKEN) != 1:
        sys.exit(f"patch_horovod: expected one '{BROKEN}' in InitializeForProcessSet of {path}")
    path.write_text(text[:start] + body.replace(BROKEN, FIXED) + text[end:])


if __name__ == "__main__":
    main(sys.argv[1])
