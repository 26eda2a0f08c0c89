"""``python -m ferry``: ``bench`` (throughput against a peer or on loopback, the options of
``ferry bench`` that the Python API has) and ``doctor`` (the capability matrix as JSON)."""

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    import ferry

    p = argparse.ArgumentParser(
        prog="python -m ferry",
        description="Ferry from Python: bench (python -m ferry bench --help) and doctor.",
    )
    p.add_argument("--version", action="version", version=f"ferry {ferry.__version__}")
    sub = p.add_subparsers(dest="command", metavar="{bench,doctor}")
    sub.add_parser("bench", help="throughput and latency through the Python API", add_help=False)
    sub.add_parser("doctor", help="the capability matrix (ferry.doctor()) as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Dispatches ``python -m ferry bench|doctor [...]``; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["bench"]:
        from ferry.bench import main as bench

        return bench(args[1:])
    parser = _parser()
    ns = parser.parse_args(args)
    if ns.command == "doctor":
        import ferry

        print(json.dumps(ferry.doctor(), indent=2))
        return 0
    parser.print_usage(sys.stderr)
    return 2


def _run() -> int:
    """``main``, with a reader that closed the pipe early (``python -m ferry doctor | head``)
    ending the output quietly, as a command-line tool's does."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        import os

        # Python's own flush at exit would meet the closed pipe again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(_run())
