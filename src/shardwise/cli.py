"""The ``shardwise`` command line."""

from __future__ import annotations

import argparse
import sys


def _env(_: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import shardwise

    print(f"shardwise {shardwise.__version__}")
    print(f"torch {torch.__version__}")
    print(f"cuda available: {torch.cuda.is_available()}")
    print(f"backends: gloo={dist.is_gloo_available()} nccl={dist.is_nccl_available()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardwise`` console script."""
    parser = argparse.ArgumentParser(prog="shardwise", description="shardwise utilities")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("env", help="print versions and available backends").set_defaults(func=_env)
    args = parser.parse_args(argv)
    if args.version:
        from shardwise import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
