"""Consolidate a sharded checkpoint into full safetensors, one tensor at a time."""

from __future__ import annotations

import json
import os

import torch

from ..errors import ShardwiseError
from ._files import write_json_atomic
from ._format import Writer, checkpoint_entry
from ._lock import LOCK
from ._names import SUBCLASSES, dtype_from_name, param_key
from ._progress import Progress
from ._schema import CHECKSUM, canonical_sha256
from .verify import VerifiedCheckpoint


def _entries(ck: VerifiedCheckpoint) -> list[tuple[str, torch.dtype, tuple[int, ...], str, str]]:
    """(output name, dtype, shape, kind, source key) for every tensor, tied names included."""
    if ck.meta.get(SUBCLASSES):
        raise ShardwiseError(
            f"{ck.path} holds tensor-subclass weights, such as a QLoRA base's "
            f"({', '.join(list(ck.meta[SUBCLASSES])[:3])}, ...), which plain safetensors "
            f"cannot represent: load it with sw.load_checkpoint, or export the trainable "
            f"weights with sw.full_state_dict (docs/qlora.md)")
    out = []
    for main, e in ck.meta["params"].items():
        for name in e["names"]:
            out.append((name, dtype_from_name(e["dtype"]), tuple(e["shape"]), "param", main))
    for name, e in ck.meta.get("buffers", {}).items():
        out.append((name, dtype_from_name(e["dtype"]), tuple(e["shape"]), "buffer", name))
    return out


def output_problem(checkpoint: str, output: str) -> str | None:
    """Why ``output`` must not receive an export of ``checkpoint``, or None. The export
    may go beside the checkpoint's files, never over them: not the folder itself, not its
    metadata, lock or data folders (a later save would remove what lies in those)."""
    if os.path.islink(output.rstrip("/") or output) and not os.path.exists(output):
        return (f"the output {output!r} is a symbolic link that leads nowhere (a loop, or "
                f"a missing target); remove it or name another output")
    bare = output.rstrip(os.sep) or output
    if _as_folder(output) and os.path.exists(bare) and not os.path.isdir(bare):
        return (f"the output {output!r} already exists, as a file: an output without the "
                f".safetensors suffix (or ending in /) is written as a folder (the Hugging "
                f"Face layout), and a file is in its place. Name a .safetensors file to "
                f"write one file, or a folder, or move the file away (--force replaces "
                f"weights files, never a file by a folder)")
    blocking = _file_in_path(output)
    if blocking is not None:
        return (f"the output {output!r} cannot be made: {blocking!r}, in its path, is a "
                f"file, not a folder; name an output elsewhere")
    out, ck = os.path.realpath(output), os.path.realpath(checkpoint)
    if out == ck:
        return (f"the output {output!r} is the checkpoint folder itself; name a file or "
                f"folder beside or inside it")
    if os.path.commonpath([out, ck]) == ck:
        first = os.path.relpath(out, ck).split(os.sep)[0]
        if first == LOCK or checkpoint_entry(first):
            return (f"the output {output!r} would overwrite the checkpoint's own "
                    f"{first}; write it elsewhere")
    return None


def _file_in_path(output: str) -> str | None:
    """The first existing entry above ``output`` that is not a folder, or None."""
    parent = os.path.dirname(os.path.abspath(output))
    while not os.path.lexists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up
    return None if os.path.isdir(parent) else parent


def exists_problem(output: str) -> str | None:
    """Why an export must not go to ``output`` without ``--force``, or None."""
    found = existing_outputs(output)
    if not found:
        return None
    shown = ", ".join(repr(f) for f in found[:3]) + (" ..." if len(found) > 3 else "")
    return (f"{shown} already exist{'s' if len(found) == 1 else ''}; pass --force to "
            f"replace {'it' if len(found) == 1 else 'them'} (each file is replaced "
            f"atomically), or name another output")


def existing_outputs(output: str) -> list[str]:
    """The weights files an export to ``output`` would replace: the file itself, or in a
    folder its ``model.safetensors``, index and numbered shards (other files in a folder,
    a tokenizer's, are left alone and never refused)."""
    if _as_folder(output):
        if not os.path.isdir(output):
            return []
        return sorted(os.path.join(output, f) for f in os.listdir(output)
                      if f in ("model.safetensors", "model.safetensors.index.json")
                      or (f.startswith("model-") and f.endswith(".safetensors")))
    return [output] if os.path.lexists(output) else []


def _as_folder(output: str) -> bool:
    return (os.path.isdir(output) or output.endswith(os.sep)
            or not output.endswith(".safetensors"))


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def consolidate(checkpoint: str, output: str, max_shard_bytes: int = 5 * 2**30,
                progress: bool | None = None, *, overwrite: bool = True) -> list[str]:
    """Write a checkpoint's full parameters and buffers as safetensors.

    Memory stays at one tensor: each is assembled from its pieces and streamed out.
    Integer buffers keep their dtype; a tied weight is written under each of its names.

    Args:
        checkpoint: a folder written by ``sw.save_checkpoint``.
        output: a ``.safetensors`` file, or a folder (existing, or named with a trailing
            ``/``, or without the ``.safetensors`` suffix) to get the Hugging Face layout:
            ``model.safetensors`` (or numbered shards and ``model.safetensors.index.json``
            beyond ``max_shard_bytes``), plus ``config.json`` if the model had a
            Hugging Face config.
        max_shard_bytes: largest shard in folder output.
        progress: show a progress bar (default: when stderr is a terminal).
        overwrite: replace existing weights files at ``output`` (each file is replaced
            atomically, so a reader sees the old file or the new one). ``False`` (what
            ``shardwise consolidate`` passes without ``--force``) refuses them first.

    Returns:
        The files written.

    Raises:
        ShardwiseError: for a missing, truncated or corrupt checkpoint file, an
            output that is the checkpoint folder or one of its own entries, or, without
            ``overwrite``, weights already at ``output``.

    Example:
        >>> consolidate("ckpt/latest", "export/")   # then AutoModel.from_pretrained("export/")
    """
    problem = output_problem(checkpoint, output)
    if not problem and not overwrite:
        problem = exists_problem(output)
    if problem:
        raise ShardwiseError(f"consolidate: {problem}")
    ck = VerifiedCheckpoint(checkpoint)
    entries = _entries(ck)
    as_folder = _as_folder(output)
    bar = Progress(sum(_nbytes(d, s) for _, d, s, _, _ in entries), "consolidating",
                   enabled=progress)
    if not as_folder:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        _write(ck, output, entries, bar)
        bar.finish()
        return [output]
    os.makedirs(output, exist_ok=True)
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        n = _nbytes(entry[1], entry[2])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    written = []
    if len(shards) == 1:
        written.append(os.path.join(output, "model.safetensors"))
        _write(ck, written[0], shards[0], bar)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            written.append(os.path.join(output, name))
            _write(ck, written[-1], shard, bar)
            weight_map.update({e[0]: name for e in shard})
        total = sum(_nbytes(e[1], e[2]) for e in entries)
        index = os.path.join(output, "model.safetensors.index.json")
        write_json_atomic(index, {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append(index)
    if "hf_config" in ck.meta:
        config = os.path.join(output, "config.json")
        write_json_atomic(config, ck.meta["hf_config"])
        written.append(config)
    bar.finish()
    return written


def _write(ck: VerifiedCheckpoint, path: str, entries, bar: Progress) -> None:
    writer = Writer(path, [(n, d, s) for n, d, s, _, _ in entries], export=True)
    try:
        for name, dtype, shape, kind, key in entries:
            if kind == "param":
                e = ck.meta["params"][key]
                numel = torch.Size(shape).numel()
                t = ck.assemble(param_key(key), e["pieces"], 0, numel, dtype).view(shape)
            else:
                t = ck.buffers().read(key)
            writer.write(name, t)
            bar.advance(_nbytes(dtype, shape))
            del t
    except BaseException:
        writer.abort()
        raise
    writer.finish()


def describe(checkpoint: str) -> str:
    """A human-readable summary of a checkpoint (what ``shardwise inspect`` prints); an
    unsigned one is described too, and says so (``shardwise sign``)."""
    ck = VerifiedCheckpoint(checkpoint, signed=False)
    m = ck.meta
    entries = _entries(ck)
    total = sum(_nbytes(d, s) for _, d, s, _, _ in entries)
    files = sum(f["bytes"] for f in m["files"].values())
    lines = [
        f"checkpoint     {os.path.abspath(checkpoint)}",
        f"format         {m['format']} v{m['format_version']}",
        f"checksum       {_checksum_state(m)}",
        f"world size     {m['world_size']}",
        f"step           {m.get('step')}",
        f"module         {m.get('module_class')}",
        f"optimizer      {m['optimizer']['class'] if m.get('optimizer') else None}",
        f"tensors        {len(m['params'])} parameters, {len(m.get('buffers', {}))} buffers, "
        f"{total / 2**20:.2f} MiB consolidated",
        f"files          {len(m['files'])} in {m['data']}/, {files / 2**20:.2f} MiB",
        f"extra          {json.dumps(m.get('extra'))[:200]}",
        "",
        f"{'name':50s} {'dtype':10s} shape",
    ]
    for name, dtype, shape, kind, _ in entries:
        lines.append(f"{name:50s} {str(dtype).removeprefix('torch.'):10s} {list(shape)}"
                     + ("  (buffer)" if kind == "buffer" else ""))
    return "\n".join(lines)


def _checksum_state(meta: dict) -> str:
    if CHECKSUM not in meta:
        return "missing: loads refuse it until `shardwise sign` checks and signs it"
    if meta[CHECKSUM] != canonical_sha256(meta):
        return "does not match (edited): loads refuse it until `shardwise sign` signs it"
    return "matches"
