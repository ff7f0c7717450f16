"""Print training results (JSON files written by the examples) side by side."""
import json
import sys


def main(paths):
    results = [json.load(open(p)) for p in paths]
    print()
    print(f"{'optimizer':<12}{'ranks':>6}{'epochs':>8}{'wall time':>12}{'final accuracy':>17}")
    for r in results:
        print(f"{r['optimizer']:<12}{r['ranks']:>6}{r['epochs']:>8}{r['wall_seconds']:>11.1f}s"
              f"{r['final_accuracy'] * 100:>16.2f}%")
    if len(results) == 2:
        a, b = results
        print(f"\n{a['optimizer']} vs {b['optimizer']}: {b['wall_seconds'] / a['wall_seconds']:.2f}x the speed, "
              f"accuracy {100 * (a['final_accuracy'] - b['final_accuracy']):+.2f} points")


if __name__ == "__main__":
    main(sys.argv[1:])
