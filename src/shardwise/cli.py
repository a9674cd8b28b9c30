"""The ``shardwise`` command line."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any


# Argument types: a bad value is a one-line usage error (exit 2), never a traceback
# deep in the command, and never a silently negative plan.
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _number(text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "at least 0" if allow_zero else "more than 0"
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
    return value


def _positive(text: str) -> float:
    return _number(text, allow_zero=False)


def _non_negative(text: str) -> float:
    return _number(text, allow_zero=True)


def _mesh(text: str) -> tuple[int, int]:
    """``R,S``: R replicas of a shard group of S ranks (Note [hybrid sharding])."""
    parts = text.replace("x", ",").split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected R,S (replicas, shard size), got {text!r}")
    try:
        r, s = (_positive_int(part.strip()) for part in parts)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"expected R,S (two whole numbers, at least 1), "
                                         f"got {text!r}: {e}") from None
    return r, s


def _tp_plan(text: str) -> dict[str, str]:
    """``{"pattern": "colwise" | "rowwise"}`` (Note [planning tensor parallelism])."""
    import json

    try:
        rules = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(rules, dict) or not rules or any(
            not isinstance(k, str) or v not in ("colwise", "rowwise") for k, v in rules.items()):
        raise argparse.ArgumentTypeError(
            f'expected {{"pattern": "colwise" | "rowwise", ...}}, got {text!r}')
    return rules


def _offload(text: str):
    """``PARAMS,OPTIMIZER``, each ``device``, ``cpu`` or ``disk`` (any case; ``none``, as
    Python's ``Offload(None, ...)`` spells it, is the device). Refused in the command
    line's words: ``Offload``'s own messages speak of Python's ``None``."""
    from shardwise.engine.groups.offload import TIERS, Offload
    from shardwise.errors import ShardwiseError

    usage = "each of PARAMS,OPTIMIZER is device, cpu or disk, e.g. device,cpu or disk,disk"
    parts = [t.strip().lower() for t in text.split(",")]
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PARAMS,OPTIMIZER; {usage}")
    parts = ["device" if t == "none" else t for t in parts]
    for t in parts:
        if t not in TIERS:
            raise argparse.ArgumentTypeError(f"{text!r}: {t!r} is not a tier; {usage}")
    if TIERS.index(parts[0]) > TIERS.index(parts[1]):
        raise argparse.ArgumentTypeError(
            f"{text!r}: parameters on {parts[0]}, the optimizer nearer, on {parts[1]}: the "
            f"optimizer's tier holds the master shards the step updates, so parameters "
            f"farther away would only add a copy; offload the optimizer at least as far "
            f"({parts[0]},{parts[0]})")
    params, optimizer = (None if t == "device" else t for t in parts)
    try:  # the folder is the running job's choice; planning needs only the tiers
        return Offload(params, optimizer, "<folder>" if "disk" in parts else None)
    except ShardwiseError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _float_dtype(text: str):
    import torch

    dtype = getattr(torch, text, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise argparse.ArgumentTypeError(f"{text!r} is not a floating-point torch dtype "
                                         f"(e.g. bfloat16, float16, float32)")
    return dtype


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
                        progress=None if not args.no_progress else False,
                        overwrite=args.force)
    for f in files:
        print(f)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import describe

    print(describe(args.checkpoint))
    return 0


def _sign(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import sign_checkpoint

    print(sign_checkpoint(args.checkpoint))
    return 0


def _plan_command(args: argparse.Namespace) -> int:
    import json

    from shardwise.errors import ShardwiseError
    from shardwise.planning.planner import to_json

    # With --mesh R,S each rank holds 1/S of the state; flat ZeRO-3 over R*S is reported
    # next to it.
    replicas, shards = args.mesh or (1, args.world // args.tp)
    if args.model:
        result, mesh, note = _plan_model(args, replicas, shards)
    elif args.tp > 1:
        raise ShardwiseError("--tp needs --model: which parameters tensor parallelism "
                             "splits follows the model's modules")
    elif args.offload is not None:
        raise ShardwiseError("--offload needs --model: the bytes per tier follow the "
                             "engine's layout of the real parameters")
    elif args.params and args.layers:
        result, mesh, note = _plan_uniform(args, replicas, shards)
    else:
        raise ShardwiseError("give --model MODULE:CALLABLE (or a Hugging Face config folder), "
                             "or --params and --layers")
    text = (mesh.to_json() if args.json else mesh.table()) if args.mesh else \
        (to_json(result) if args.json else result.table())
    if args.json and getattr(args, "tp_split", None) is not None:
        text = json.dumps({**json.loads(text), "tp": args.tp_split}, indent=2)
    print(text)
    if note and not args.json:
        print(note)
    return 0


def _plan_model(args: argparse.Namespace, replicas: int, shards: int) -> tuple[Any, Any, str]:
    """``plan --model``: the plan of the model built on the meta device, the mesh's plan
    (with ``--mesh``) and a note on the dtype assumed."""
    import json

    import torch

    from shardwise.errors import ShardwiseError
    from shardwise.planning.planner import MeshPlan, build_on_meta, comm_plan, plan

    dtype, activations = args.param_dtype, int(args.activation_gib * 2**30)
    note = ""
    try:
        model = build_on_meta(args.model, json.loads(args.kwargs) if args.kwargs else None,
                              args.dtype)
    except (ImportError, AttributeError, TypeError, ValueError, OSError) as e:
        raise ShardwiseError(f"cannot build {args.model!r} on the meta device: {e}") from e
    if args.tp > 1 and isinstance(model, torch.nn.Module):
        # Note [planning tensor parallelism] in planning/tensor_parallel.py.
        from shardwise.planning.tensor_parallel import split_for_tp

        try:
            split = split_for_tp(model, args.tp, args.tp_plan)
        except ValueError as e:
            raise ShardwiseError(f"--tp {args.tp}: {e}") from e
        note = (note + "\n" if note else "") + split.describe(replicas * shards)
        args.tp_split = split.as_dict()
    if ":" not in args.model and args.dtype is None:  # Note [the dtype planned]
        note = ("  (a config folder is planned in float32, as LlamaForCausalLM(config) "
                "builds it; --dtype plans another, --param-dtype the gathered units')"
                + ("\n" + note if note else ""))
    if not isinstance(model, torch.nn.Module):
        raise ShardwiseError(f"{args.model!r} built a {type(model).__name__}, not a "
                             f"torch.nn.Module")
    result = plan(model, shards, args.optimizer, dtype, activation_bytes=activations,
                  offload=args.offload)
    mesh = None
    if args.mesh:
        world = replicas * shards
        mesh = MeshPlan(result, comm_plan(model, replicas, shards, dtype),
                        plan(model, world, args.optimizer, dtype,
                             activation_bytes=activations),
                        comm_plan(model, 1, world, dtype))
    return result, mesh, note


def _plan_uniform(args: argparse.Namespace, replicas: int,
                  shards: int) -> tuple[Any, Any, str]:
    """``plan --params --layers``: a model of equal layers, and the mesh's plan."""
    import torch

    from shardwise.planning.planner import MeshPlan, uniform_comm_plan, uniform_plan

    dtype, activations = args.param_dtype, int(args.activation_gib * 2**30)
    stored = args.dtype or torch.float32
    size = torch.empty(0, dtype=stored).element_size()
    compute = torch.empty(0, dtype=dtype).element_size() if dtype else None
    n, layers, world = int(args.params), args.layers, replicas * shards
    result = uniform_plan(n, layers, shards, size, args.optimizer, compute, activations)
    mesh = None
    if args.mesh:
        mesh = MeshPlan(result, uniform_comm_plan(n, layers, replicas, shards, size, compute),
                        uniform_plan(n, layers, world, size, args.optimizer, compute,
                                     activations),
                        uniform_comm_plan(n, layers, 1, world, size, compute))
    for p in (result, mesh.flat_memory) if mesh is not None else (result,):
        p.dtype = _dtype_name(stored)
        p.compute_dtype = _dtype_name(dtype or stored)
    return result, mesh, ""


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _demo(args: argparse.Namespace) -> int:
    from shardwise.demo.main import config_from, run

    run(config_from(args))
    return 0


def _plan_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``plan`` command's parser, added to the subcommands ``sub``."""
    p = sub.add_parser("plan", help="estimate memory per rank before building a model")
    p.add_argument("--model", help="package.module:callable building the model, or a "
                                   "folder holding a Hugging Face config.json")
    p.add_argument("--kwargs", help="JSON keyword arguments for the callable")
    p.add_argument("--params", type=_positive, help="parameter count, without --model")
    p.add_argument("--layers", type=_positive_int,
                   help="number of equal blocks, without --model")
    p.add_argument("--world", type=_positive_int,
                   help="ranks to shard over (with --mesh: optional, must be R*S)")
    p.add_argument("--mesh", type=_mesh, metavar="R,S",
                   help="hybrid sharding: R replicas of S ranks (a node) each; adds bytes "
                        "per step within and across nodes, and flat ZeRO-3 over R*S")
    p.add_argument("--tp", type=_positive_int, default=1, metavar="T",
                   help="tensor parallelism over T ranks, inside --world or beside --mesh "
                        "(R*S*T ranks); needs --model: the modules --tp-plan names are "
                        "split, as parallelize_module splits them")
    p.add_argument("--tp-plan", type=_tp_plan, metavar="JSON",
                   help='which modules tp splits: {"pattern": "colwise" | "rowwise"}, '
                        "fnmatch patterns over module names (default: Hugging Face "
                        "Llama's q/k/v/gate/up_proj colwise, o/down_proj rowwise)")
    p.add_argument("--optimizer", default="adamw",
                   choices=["adamw", "adam", "sgd", "sgd-momentum"])
    p.add_argument("--dtype", type=_float_dtype,
                   help="dtype the parameters are stored in (master shards, gradients, "
                        "optimizer state), as model.to(DTYPE) before sw.shard; default: "
                        "float32 for --params and a Hugging Face config folder (what "
                        "LlamaForCausalLM(config) builds), the callable's own otherwise")
    p.add_argument("--param-dtype", type=_float_dtype,
                   help="compute dtype of gathered units, MixedPrecision(param_dtype=...), "
                        "e.g. bfloat16")
    p.add_argument("--activation-gib", type=_non_negative, default=0.0,
                   help="activations per rank (depends on batch and sequence; default 0)")
    p.add_argument("--offload", type=_offload, metavar="PARAMS,OPTIMIZER",
                   help="with --model: tiers of sw.Offload, each device (or none), cpu or "
                        "disk (e.g. device,cpu or disk,disk); adds bytes per tier and bytes "
                        "moved per step")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_plan_command)
    return p


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser, and each command's own (for its usage errors)."""
    parser = argparse.ArgumentParser(prog="shardwise", description="shardwise utilities")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("env", help="print versions and available backends").set_defaults(func=_env)
    c = sub.add_parser("consolidate", help="write a checkpoint's full weights as safetensors")
    c.add_argument("checkpoint", help="folder written by sw.save_checkpoint")
    c.add_argument("output", help="a .safetensors file, or a folder for the Hugging Face layout")
    c.add_argument("--max-shard-gb", type=_positive, default=5.0,
                   help="largest file in folder output (default 5)")
    c.add_argument("--no-progress", action="store_true", help="never show a progress bar")
    c.add_argument("--force", action="store_true",
                   help="replace weights already at OUTPUT (atomically, file by file)")
    c.set_defaults(func=_consolidate)
    i = sub.add_parser("inspect", help="print a checkpoint's world size, step and tensors")
    i.add_argument("checkpoint", help="folder written by sw.save_checkpoint")
    i.set_defaults(func=_inspect)
    s = sub.add_parser("sign", help="check a hand-edited checkpoint.json against the data "
                                    "files, then write its checksum")
    s.add_argument("checkpoint", help="folder written by sw.save_checkpoint")
    s.set_defaults(func=_sign)
    p = _plan_parser(sub)
    from shardwise.demo.main import add_arguments

    # Listed for --help only: main() hands `run` to the launcher before parsing, since
    # its options are torchrun's (Note [launcher defaults] in shardwise/launcher.py).
    sub.add_parser("run", help="launch SCRIPT like torchrun, with the settings restarts "
                               "and elastic membership need set by default",
                   usage="shardwise run [torchrun options] SCRIPT [ARGS]")
    d = sub.add_parser("demo", help="train a small GPT on Shakespeare over local CPU ranks")
    add_arguments(d)
    d.set_defaults(func=_demo)
    return parser, {"consolidate": c, "inspect": i, "sign": s, "plan": p, "demo": d}


_MAX_LAYERS = 10**6  # far beyond any model; a uniform plan walks its layers one by one


def _check_plan_sizes(args: argparse.Namespace, plan: argparse.ArgumentParser) -> None:
    """Refuse sizes no model has: more layers than parameters, or than any model has (a
    uniform plan of 10**12 layers would run for hours)."""
    if args.layers is None:
        return
    if args.layers > _MAX_LAYERS:
        plan.error(f"--layers {args.layers}: more than {_MAX_LAYERS:,} equal blocks; give "
                   f"the model's real number of blocks")
    if args.params is not None and args.layers > args.params:
        plan.error(f"--layers {args.layers} exceeds --params {args.params:g}: every layer "
                   f"holds at least one parameter")


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
        $ shardwise plan --params 7e9 --layers 32 --world 8
        $ shardwise plan --params 7e9 --layers 32 --mesh 16,8
        $ shardwise run --nnodes 1:2 --nproc-per-node 8 --rdzv-endpoint node0:29400 train.py
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        from shardwise.launcher import main as launch

        return launch(argv[1:])
    parser, commands = _parser()
    args = parser.parse_args(argv)
    if args.version:
        from shardwise import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.command == "consolidate":
        from shardwise.checkpoint.consolidation import exists_problem, output_problem

        problem = output_problem(args.checkpoint, args.output)
        if not problem and not args.force:
            problem = exists_problem(args.output)
        if problem:
            commands["consolidate"].error(problem)
    if args.command == "plan":
        if args.model and (args.params is not None or args.layers is not None):
            commands["plan"].error("--model and --params/--layers are two descriptions of "
                                   "the model: give --model alone, or --params and --layers")
        if args.kwargs and not args.model:
            commands["plan"].error("--kwargs are the arguments of --model's callable: give "
                                   "--model too")
        _check_plan_sizes(args, commands["plan"])
        if args.mesh is None and args.world is None:
            commands["plan"].error("give --world N, or --mesh R,S for hybrid sharding")
        tp = args.tp
        if args.mesh is not None and args.world not in (None, args.mesh[0] * args.mesh[1] * tp):
            r, s = args.mesh
            with_tp = f" x --tp {tp}" if tp > 1 else ""
            commands["plan"].error(f"--world {args.world} does not match --mesh {r},{s}"
                                   f"{with_tp} ({r * s * tp} ranks); --world may be left "
                                   f"out with --mesh")
        if args.mesh is None and args.world % tp:
            commands["plan"].error(f"--tp {tp} does not divide --world {args.world}: the "
                                   f"ranks are dp x tp")
        if args.tp_plan is not None and tp == 1:
            commands["plan"].error("--tp-plan says which modules --tp splits: give --tp too")
    from shardwise.errors import ShardwiseError

    try:
        return args.func(args)
    except (ShardwiseError, OSError) as e:
        print(f"shardwise {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
