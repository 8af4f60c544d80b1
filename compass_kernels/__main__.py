"""python -m compass_kernels info  -- print what was built and what can run here."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compass_kernels")
    parser.add_argument("command", nargs="?", default="info", choices=["info"])
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    from compass_kernels._info import format_info, info

    d = info()
    print(json.dumps(d, indent=2) if args.json else format_info(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
