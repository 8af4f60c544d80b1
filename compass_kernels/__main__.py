"""python -m compass_kernels info  -- print what was built and what can run here."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compass_kernels",
        description="What was built and what can run here (at most 25 lines).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("command", nargs="?", default="info", choices=["info"])
    parser.add_argument("--json", action="store_true", help="everything, as JSON")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="every key and the per-op evidence"
    )
    args = parser.parse_args(argv)
    from compass_kernels._info import format_info, info

    d = info()
    print(json.dumps(d, indent=2) if args.json else format_info(d, verbose=args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
