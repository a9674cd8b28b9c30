"""Where full state dicts come from: a dict, safetensors files, or weights-only pickles."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import ShardwiseError
from ._format import Reader

Rename = Mapping[str, str] | Callable[[str], str] | None


class Source:
    """Read-only access to named tensors, by whole tensor or by flat element range."""

    def __init__(self, description: str) -> None:
        self.description = description

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def dtype(self, key: str) -> torch.dtype:
        """The dtype ``key`` is stored in, without reading its data."""
        return self.read(key).dtype

    def read_flat(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor, reading as little as possible."""
        return self.read(key).reshape(-1)[lo:hi]

    def fingerprint(self) -> str:
        """A short hash that differs, in all likelihood, between two different sources:
        ranks compare it before loading (Note [one source])."""
        raise NotImplementedError


class DictSource(Source):
    def __init__(self, tensors: Mapping[str, torch.Tensor], description: str) -> None:
        super().__init__(description)
        bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ShardwiseError(f"{description}: values of {bad[:5]} are not tensors")
        self._t = dict(tensors)

    def keys(self) -> list[str]:
        return list(self._t)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._t[key].shape)

    def read(self, key: str) -> torch.Tensor:
        return self._t[key].detach().to("cpu")

    def dtype(self, key: str) -> torch.dtype:
        return self._t[key].dtype

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for k in sorted(self._t):
            flat = self._t[k].detach().reshape(-1)
            sample = torch.cat([flat[:_SAMPLE], flat[-_SAMPLE:]]).to("cpu").contiguous()
            h.update(f"{k}|{self._t[k].dtype}|{tuple(self._t[k].shape)}|".encode())
            h.update(sample.view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]


# Note [one source]
# ``load_pretrained`` given different weights on different ranks (a per-node copy that is
# out of date, a rank-dependent path, a state dict built from each rank's own seed) would
# load a mix of them without any error: each rank reads only its own rows. So every rank
# hashes what identifies its source (names, dtypes, shapes, file sizes, safetensors
# headers) and samples of its data (the first and last 64 KiB of each file's data, the
# first and last elements of each tensor of a dict), and ranks compare the hashes before
# anything is loaded. Two sources that agree on all of that are taken to be the same:
# the check catches mistakes, not a crafted file.
_SAMPLE = 16
_SAMPLE_BYTES = 64 * 2**10


class SafetensorsSource(Source):
    """One or more safetensors files, read through _format.py's ``Reader`` (the reader of
    a checkpoint's data files: a Hugging Face folder is read as a checkpoint is); each
    rank reads only the slices it asks for."""

    def __init__(self, files: dict[str, Reader], description: str) -> None:
        super().__init__(description)
        self._file_of = files  # key -> its file

    def keys(self) -> list[str]:
        return list(self._file_of)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._file_of[key].shape(key)

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor, read with plain file reads, not through a memory map: a
        mapped file's pages count in the reading process's RSS for as long as the file
        stays open, so reading a model weight by weight through one would grow a rank's
        RSS by everything it read (Note [quantize while loading] in engine/groups/quantize.py)."""
        return self._file_of[key].read(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._file_of[key].dtype(key)

    def read_flat(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self._file_of[key].read_flat(key, lo, hi)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        readers = {r.path: r for r in self._file_of.values()}
        for path in sorted(readers, key=os.path.basename):
            h.update(f"{os.path.basename(path)}|".encode())
            h.update(readers[path].sample(_SAMPLE_BYTES))
        return h.hexdigest()[:16]


def _safetensors_files(paths: list[str]) -> dict[str, Reader]:
    """Every key of the files ``paths``, each with its file, opened (Raises:
    ShardwiseError: a file does not read, or two hold one key)."""
    files: dict[str, Reader] = {}
    for path in paths:
        reader = Reader(path)
        for k in reader.keys():
            if k in files:
                raise ShardwiseError(
                    f"{k!r} is stored twice, in {files[k].path} and in {path}: which one to "
                    f"load is ambiguous. Remove it from one file (and from the index), or "
                    f"re-save the folder with save_pretrained")
            files[k] = reader
    return files


# Note [what shardwise reads]
# A pickle runs whatever code its author put in it, on every rank that loads it; a file
# in a checkpoint or weights folder is not trusted that far. So shardwise reads metadata
# as JSON (checkpoint.json, Resumable's failure records, a weights index, a Hugging Face
# config through transformers), tensors as safetensors (each header parsed as JSON), and
# Python state (a scheduler's, Lightning's loops and callbacks) as JSON inside
# checkpoint.json (integrations/_json.py), decoded into numbers, strings, containers and
# tensors of a torch dtype only. The only torch pickles it opens are formats others
# defined: a weights folder's pytorch_model.bin (load_pretrained), the Trainer's
# scheduler.pt, and the schedulers.pt an older ShardwiseAccelerator wrote; each goes
# through torch.load(weights_only=True), torch's allow-list of tensors and plain
# containers, and anything outside it is refused in words. Nowhere in src/ is
# weights_only=False, pickle.load or an allow-list beyond torch's own
# (tests/test_safety.py plants a pickle that would leave a file behind into every file of
# every folder shardwise reads). The one pickle.loads left, in comm/collectives.py,
# reads what the job's own ranks sent over its process group, never a file.
def load_weights_only(path: str, advice: str) -> Any:
    """``torch.load(path, weights_only=True)``, or a ``ShardwiseError`` saying that the
    file needs more than torch's allow-list (pickled code) and ``advice``: the one way a
    torch pickle is opened anywhere in shardwise."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - refuse anything that needs unpickling code
        raise ShardwiseError(
            f"{path}: refusing to load: it does not load with torch.load(weights_only=True), "
            f"which would mean running pickled code ({type(e).__name__}: {str(e)[:300]}). "
            f"{advice}") from None


def _weights_only(path: str) -> dict[str, torch.Tensor]:
    obj = load_weights_only(path, "Convert it to safetensors from a trusted environment "
                                  "first")
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ShardwiseError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    return dict(obj)


def open_source(source: object) -> Source:
    """A :class:`Source` for a dict, a file, or a Hugging Face style folder.

    Raises:
        ShardwiseError: for a path that does not exist or holds nothing loadable.
    """
    if isinstance(source, Mapping):
        return DictSource(source, "the given state dict")
    if not isinstance(source, (str, os.PathLike)):
        raise ShardwiseError(f"cannot load from a {type(source).__name__}: pass a state dict, "
                             f"a .safetensors file or a folder")
    path = os.fspath(source)
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f).get("weight_map")
            except (ValueError, AttributeError) as e:
                raise ShardwiseError(f"{index}: not a JSON object ({e})") from e
            if not isinstance(weight_map, dict):
                raise ShardwiseError(f"{index}: has no weight_map object")
            files = {k: _entry(path, v, f"{index}: weight_map[{k!r}]")
                     for k, v in weight_map.items()}
            actual = _safetensors_files(sorted(set(files.values())))
            absent = [k for k, p in files.items() if k not in actual or actual[k].path != p]
            if absent:
                raise ShardwiseError(f"{index} maps keys to files that do not hold them: "
                                     f"{absent[:10]}")
            return SafetensorsSource({k: actual[k] for k in files}, path)
        if os.path.lexists(single):
            return SafetensorsSource(
                _safetensors_files([_entry(path, "model.safetensors", path)]), single)
        for name in ("pytorch_model.bin", "model.pt"):
            if os.path.isfile(os.path.join(path, name)):
                p = os.path.join(path, name)
                return DictSource(_weights_only(p), p)
        raise ShardwiseError(f"{path}: no model.safetensors, model.safetensors.index.json or "
                             f"pytorch_model.bin in this folder")
    if not os.path.exists(path):
        raise ShardwiseError(f"{path}: no such file or folder")
    if path.endswith(".safetensors"):
        return SafetensorsSource(_safetensors_files([path]), path)
    if path.endswith((".bin", ".pt", ".pth")):
        return DictSource(_weights_only(path), path)
    raise ShardwiseError(f"{path}: unknown format; expected .safetensors (or a weights-only "
                         f".bin/.pt)")


def _entry(folder: str, name: object, what: str) -> str:
    """``folder/name``, for a file a folder of weights lists.

    Rule (Note [folder entries]): the *name* must stay inside the folder, and what it
    resolves to must be a regular file. The target of a symlink may lie elsewhere: the
    Hugging Face hub cache keeps ``snapshots/<revision>/model.safetensors`` as a link to
    ``../../blobs/<hash>``.

    Raises:
        ShardwiseError: an absolute name, one that climbs out with ``..``, or one that is
            missing or not a regular file once resolved (a folder, a device).
    """
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise ShardwiseError(f"{what}: {name!r} is not a path relative to {folder}")
    full = os.path.normpath(os.path.join(folder, name))
    root = os.path.normpath(folder)
    if os.path.commonpath([root, full]) != root:
        raise ShardwiseError(f"{what}: {name!r} leads outside {folder}")
    if not os.path.isfile(full):  # follows links; False for a folder, a device, a dangling link
        target = os.path.realpath(full)
        state = "does not exist" if not os.path.exists(target) else "is not a regular file"
        raise ShardwiseError(f"{what}: {full} {state}"
                             + (f" (it links to {target})" if target != full else ""))
    return full


# Note [folder entries]
# A folder of weights names its files (an index's weight_map, or model.safetensors
# itself). Names are confined to the folder, so a crafted index cannot make a load read
# /etc/passwd or another model's files by "../" or an absolute path. Symlinks inside the
# folder are followed wherever they lead, as long as they end at a regular file: that is
# how the Hugging Face hub cache lays out every downloaded model (snapshots/<rev>/ holds
# links into ../../blobs/). A device (/dev/zero) or a folder is refused.


def renamer(rename: Rename) -> Callable[[str], str]:
    """A function from source key to module key.

    ``rename`` is ``None`` (keys as they are), a mapping of prefixes (``{"model.": ""}``
    strips a leading ``model.``; the longest matching prefix wins), or a callable.
    """
    if rename is None:
        return lambda k: k
    if callable(rename):
        return rename
    prefixes = sorted(rename.items(), key=lambda kv: -len(kv[0]))

    def apply(key: str) -> str:
        for old, new in prefixes:
            if key.startswith(old):
                return new + key[len(old):]
        return key

    return apply
