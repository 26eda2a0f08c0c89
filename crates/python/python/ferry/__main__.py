"""``python -m ferry``: ``bench`` (throughput against a peer or on loopback) and ``doctor``."""

import json
import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatches ``python -m ferry bench|doctor [...]``; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["bench"]:
        from ferry.bench import main as bench

        return bench(args[1:])
    if args[:1] == ["doctor"]:
        import ferry

        print(json.dumps(ferry.doctor(), indent=2))
        return 0
    print("usage: python -m ferry bench [options] | doctor  (bench --help for options)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
