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


def _consolidate(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import consolidate

    files = consolidate(args.checkpoint, args.output,
                        max_shard_bytes=int(args.max_shard_gb * 2**30),
                        progress=None if not args.no_progress else False)
    for f in files:
        print(f)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import describe

    print(describe(args.checkpoint))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardwise`` console script.

    Args:
        argv: arguments (default: the command line).

    Returns:
        The exit status: 0 on success, 1 when the command failed (the reason is printed
        on stderr), 2 for a usage error.

    Example:
        $ shardwise inspect ckpt/latest
        $ shardwise consolidate ckpt/latest export/
    """
    parser = argparse.ArgumentParser(prog="shardwise", description="shardwise utilities")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("env", help="print versions and available backends").set_defaults(func=_env)
    c = sub.add_parser("consolidate", help="write a checkpoint's full weights as safetensors")
    c.add_argument("checkpoint", help="folder written by sw.save_checkpoint")
    c.add_argument("output", help="a .safetensors file, or a folder for the Hugging Face layout")
    c.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="largest file in folder output (default 5)")
    c.add_argument("--no-progress", action="store_true", help="never show a progress bar")
    c.set_defaults(func=_consolidate)
    i = sub.add_parser("inspect", help="print a checkpoint's world size, step and tensors")
    i.add_argument("checkpoint", help="folder written by sw.save_checkpoint")
    i.set_defaults(func=_inspect)
    args = parser.parse_args(argv)
    if args.version:
        from shardwise import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from shardwise.errors import ShardwiseError

    try:
        return args.func(args)
    except (ShardwiseError, OSError) as e:
        print(f"shardwise {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
