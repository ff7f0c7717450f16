"""The concurrent process sets' stress runs: ``tests/workers/sets_stress.py`` on 8 ranks, ``--runs`` times under
each launcher (horovodrun --gloo, mpirun), each launch once under its timeout. Prints one line per run and the
count of failures and hangs; exits non-zero on any. ``--ordered``: every set marked ordered (patch level 9).
``make stress`` runs it both ways (20 runs each, about 10 minutes a way).
"""
import argparse
import sys
import time

from multirank import LAUNCHERS, JobFailed, run


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--ordered", action="store_true", help="mark every set ordered")
    args = parser.parse_args()
    bad = {launcher: 0 for launcher in LAUNCHERS}
    hangs = {launcher: 0 for launcher in LAUNCHERS}
    for launcher in LAUNCHERS:
        for k in range(args.runs):
            started = time.monotonic()
            try:
                output = run(launcher, 8, "sets_stress.py", "--rounds", str(args.rounds),
                             *(("--ordered",) if args.ordered else ()), timeout=args.timeout)
                ok = output.count("all checks passed") == 8
                verdict = "ok" if ok else "wrong output"
            except JobFailed as error:
                ok, verdict = False, "hung" if "hung past" in str(error) else "failed"
                hangs[launcher] += verdict == "hung"
                print(str(error)[-3000:], flush=True)
            bad[launcher] += not ok
            print(f"{launcher} run {k + 1}/{args.runs}: {verdict} in {time.monotonic() - started:.1f} s", flush=True)
    for launcher in LAUNCHERS:
        print(f"{launcher}: {args.runs - bad[launcher]}/{args.runs} passed, {hangs[launcher]} hangs")
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
