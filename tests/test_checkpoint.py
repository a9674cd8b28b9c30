"""load_pretrained, save/load_checkpoint, consolidate: every rank right, atomic, reshardable."""

import contextlib
import copy
import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import forking, run_ranks
from loops import train_steps
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import shardwise as sw
from shardwise.checkpoint import consolidate, describe
from shardwise.checkpoint._schema import canonical_sha256
from shardwise.models import GPT, GPTConfig, SmallCNN

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, d_model=24)


def _gpt(seed):
    torch.manual_seed(seed)
    return GPT(CFG)


def _data(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
    return x, x.roll(-1, 1)


def _steps(model, opt, steps):
    rank = torch.distributed.get_rank()
    return train_steps(model, opt, (_data(rank, s) for s in steps))


EXTRA = {"epoch": 3, "note": "ünïcode", "nested": [1, 2.5, None, {"a": True}]}


def _save_then_continue(rank, world, ck):
    model = sw.shard(_gpt(rank))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(model, opt, range(3))
    sw.save_checkpoint(ck, model, opt, extra=EXTRA)
    noise_before = torch.rand(3)  # drawn from the RNG state the checkpoint holds
    sd = sw.full_state_dict(model)
    return sd, _steps(model, opt, range(3, 5)), noise_before


def _resume(rank, world, ck, out):
    model = sw.shard(_gpt(100 + rank))  # different weights: the checkpoint must win
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert sw.load_checkpoint(ck, model, opt) == EXTRA
    noise = torch.rand(3)  # RNG restored (same world size only)
    sd = sw.full_state_dict(model)
    sw.save_checkpoint(out, model, opt)
    return sd, _steps(model, opt, range(3, 5)), noise


class _Saved:
    """A checkpoint read straight from its documented files (docs/checkpoints.md):
    ``checkpoint.json`` and each rank's ``data-<id>/rank-R-of-N.safetensors``, whose
    pieces are flat ranges of the flattened tensors."""

    def __init__(self, folder):
        with open(os.path.join(folder, "checkpoint.json")) as f:
            self.meta = json.load(f)
        self.world_size = self.meta["world_size"]
        data = os.path.join(folder, self.meta["data"])
        self.files = [safe_open(os.path.join(data, f"rank-{r:05d}-of-{self.world_size:05d}"
                                                   f".safetensors"), framework="pt")
                      for r in range(self.world_size)]

    def assemble(self, key, pieces, numel, dtype):
        """The whole flattened tensor ``key`` from every rank's piece."""
        out = torch.empty(numel, dtype=dtype)
        for r, (offset, count) in enumerate(pieces):
            if count:
                out[offset:offset + count] = self.files[r].get_tensor(key).reshape(-1)
        return out


def _assert_same_checkpoint(a, b):
    # The public summary validates both (schema and checksum) and lists the same tensors.
    assert describe(a).split("\nname")[1] == describe(b).split("\nname")[1]
    ca, cb = _Saved(a), _Saved(b)
    assert ca.meta["params"].keys() == cb.meta["params"].keys()
    for main, e in ca.meta["params"].items():
        n = torch.Size(e["shape"]).numel()
        dtype = getattr(torch, e["dtype"])
        pa = ca.assemble(f"param/{main}", e["pieces"], n, dtype)
        pb = cb.assemble(f"param/{main}", cb.meta["params"][main]["pieces"], n, dtype)
        assert torch.equal(pa, pb), main
        for k, info in ca.meta["optimizer"]["state"][main].items():
            other = cb.meta["optimizer"]["state"][main][k]
            assert info["kind"] == other["kind"], (main, k)
            if info["kind"] == "sharded":
                oa = ca.assemble(f"optim/{main}/{k}", e["pieces"], n, torch.float32)
                ob = cb.assemble(f"optim/{main}/{k}", cb.meta["params"][main]["pieces"], n,
                                 torch.float32)
                assert torch.equal(oa, ob), (main, k)
            elif info["kind"] == "replicated":
                ta = ca.files[0].get_tensor(f"optim/{main}/{k}")
                tb = cb.files[0].get_tensor(f"optim/{main}/{k}")
                assert torch.equal(ta, tb), (main, k)  # AdamW's step count
            else:
                assert info == other, (main, k)


def test_round_trip_same_and_other_world_sizes(tmp_path):
    ck = str(tmp_path / "ck")
    saved = run_ranks(_save_then_continue, 2, ck)
    sd, continued = saved[0][0], [r[1] for r in saved]
    save_file(sd, str(tmp_path / "full.safetensors"))  # tied weight: separate tensors
    for world in (2, 1, 3, 4):
        out = str(tmp_path / f"again-{world}")
        got = run_ranks(_resume, world, ck, out)
        for k, v in sd.items():
            assert torch.equal(got[0][0][k], v), (world, k)
        _assert_same_checkpoint(ck, out)  # optimizer state survived the resharding
        if world == 2:
            # Same size: training continues exactly, RNG included.
            assert [r[1] for r in got] == continued
            assert all(torch.equal(g[2], s[2]) for g, s in zip(got, saved))
    assert "world size     2" in describe(ck) and "step           3" in describe(ck)


def _load_unsharded(rank, world, ck):
    model = _gpt(7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    assert sw.load_checkpoint(ck, model, opt) == EXTRA
    assert not sw.is_sharded(model)
    return {k: v.clone() for k, v in model.state_dict().items()}, len(opt.state)


def test_load_into_an_unsharded_model(tmp_path):
    ck = str(tmp_path / "ck")
    sd = run_ranks(_save_then_continue, 3, ck)[0][0]
    got, n_state = run_ranks(_load_unsharded, 1, ck)[0]
    assert n_state == len({id(p) for p in _gpt(0).parameters()})
    for k, v in sd.items():
        assert torch.equal(got[k], v), k


def _save_v1(rank, world, ck):
    model = sw.shard(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    x = torch.randn(4, 3, 16, 16)
    F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)).backward()
    opt.step()
    sw.save_checkpoint(ck, model, opt, extra={"version": 1})
    return sw.full_state_dict(model)


def _load_broken(rank, world, variants):
    model = sw.shard(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(model(torch.randn(4, 3, 16, 16)), torch.zeros(4, dtype=torch.long)).backward()
    opt.step()  # the optimizer has state of its own that a failed load must keep
    before = sw.full_state_dict(model, rank0_only=False)
    opt_before = copy.deepcopy(opt.state_dict())
    messages = {}
    for name, path in variants.items():
        try:
            sw.load_checkpoint(path, model, opt)
        except sw.ShardwiseError as e:
            messages[name] = str(e)
        else:
            raise AssertionError(f"{name} loaded")
        after = sw.full_state_dict(model, rank0_only=False)
        assert all(torch.equal(before[k], after[k]) for k in before), f"{name} changed the model"
        opt_after = opt.state_dict()
        assert opt_after["param_groups"] == opt_before["param_groups"], name
        for i, st in opt_before["state"].items():
            assert torch.equal(st["momentum_buffer"], opt_after["state"][i]["momentum_buffer"])
    return messages


def _damaged_copies(tmp_path):
    """A good checkpoint, its data folder's name, and ``variant(name, damage)``, which
    copies it and applies ``damage(copy, copy's data folder)``; the copies collect in
    the returned dict."""
    ck = str(tmp_path / "ck")
    run_ranks(_save_v1, 2, ck)
    data = json.load(open(os.path.join(ck, "checkpoint.json")))["data"]
    variants: dict[str, str] = {}

    def variant(name, damage):
        path = str(tmp_path / name)
        shutil.copytree(ck, path)
        damage(path, os.path.join(path, data))
        variants[name] = path

    return ck, data, variant, variants


def test_corrupt_truncated_missing_and_mismatched(tmp_path):
    ck, data, variant, variants = _damaged_copies(tmp_path)

    def truncate(p, d):
        f = os.path.join(d, "rank-00001-of-00002.safetensors")
        os.truncate(f, os.path.getsize(f) // 2)

    def flip(p, d):
        f = os.path.join(d, "rank-00000-of-00002.safetensors")
        raw = bytearray(open(f, "rb").read())
        raw[len(raw) - 3] ^= 0xFF
        open(f, "wb").write(bytes(raw))

    variant("truncated", truncate)
    variant("corrupt", flip)
    variant("missing_file", lambda p, d: os.remove(os.path.join(d, "buffers.safetensors")))
    variant("no_metadata", lambda p, d: os.remove(os.path.join(p, "checkpoint.json")))
    variant("bad_json", lambda p, d: open(os.path.join(p, "checkpoint.json"), "w").write("{"))
    messages = run_ranks(_load_broken, 2, variants)[0]
    assert "rank-00001-of-00002.safetensors: truncated" in messages["truncated"]
    assert "rank-00000-of-00002.safetensors: corrupt" in messages["corrupt"]
    assert "buffers.safetensors: missing" in messages["missing_file"]
    assert "a folder without checkpoint.json" in messages["no_metadata"]
    assert "unreadable" in messages["bad_json"]


def _mismatched_model(rank, world, ck):
    model = sw.shard(SmallCNN(channels=(3, 16, 32, 48)))
    with pytest.raises(sw.ShardwiseError, match=r"mismatched: blocks\.2\.conv\.weight"):
        sw.load_checkpoint(ck, model)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    ck = str(tmp_path / "ck")
    run_ranks(_save_v1, 2, ck)
    run_ranks(_mismatched_model, 2, ck)


def _trained_bn_state():
    torch.manual_seed(5)
    ref = SmallCNN()
    for m in ref.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
            m.num_batches_tracked.fill_(777)
    return {k: v.clone() for k, v in ref.state_dict().items()}


def _pretrained_checks(rank, world, path, folder):
    want = load_file(path)
    for source in (path, folder, want):
        torch.manual_seed(rank)  # every rank starts different
        model = sw.shard(SmallCNN())
        sw.load_pretrained(model, source)
        sw.check_consistency(model)  # identical buffers on every rank
        sd = sw.full_state_dict(model, rank0_only=False)
        for k, v in want.items():
            assert torch.equal(sd[k], v) and sd[k].dtype == v.dtype, k
    # Unsharded modules too.
    plain = SmallCNN()
    sw.load_pretrained(plain, path)
    assert torch.equal(plain.blocks[1].bn.running_var, want["blocks.1.bn.running_var"])

    model = sw.shard(SmallCNN())
    before = sw.full_state_dict(model, rank0_only=False)
    bad_shape = dict(want, **{"head.weight": torch.zeros(3, 3)})
    missing = {k: v for k, v in want.items() if k != "blocks.0.conv.weight"}
    extra = dict(want, **{"surprise": torch.zeros(1)})
    prefixed = {f"model.{k}": v for k, v in want.items()}
    for source, pattern in ((bad_shape, r"mismatched: head\.weight: source \[3, 3\]"),
                            (missing, r"missing from the source: \['blocks\.0\.conv\.weight'\]"),
                            (extra, r"not in the model: \['surprise'\]"),
                            (prefixed, r"no name in the source matched.*such as "
                                       r"'model\..*rename=\{'model\.': ''\} joins")):
        with pytest.raises(sw.ShardwiseError, match=pattern):
            sw.load_pretrained(model, source)
        after = sw.full_state_dict(model, rank0_only=False)
        assert all(torch.equal(before[k], after[k]) for k in before)
    sw.load_pretrained(model, missing, strict=False)
    sw.load_pretrained(model, prefixed, rename={"model.": ""})
    assert torch.equal(sw.full_state_dict(model, rank0_only=False)["head.weight"],
                       want["head.weight"])


def test_load_pretrained_advises_what_fits_the_problem():
    """Issue 51 item 6: a shape mismatch was told to pass rename= or strict=False, which
    cannot help it."""
    model = nn.Linear(4, 3)
    with pytest.raises(sw.ShardwiseError) as err:
        sw.load_pretrained(model, {"weight": torch.zeros(3, 5), "bias": torch.zeros(3)})
    said = str(err.value)
    assert "mismatched: weight: source [3, 5], model [3, 4]" in said, said
    assert "pass rename=" not in said and "strict=False to ignore" not in said, said
    assert "Build the model from the config saved with these weights" in said, said
    assert "this source may be another model's" in said, said
    with pytest.raises(sw.ShardwiseError) as err:  # a name missing: renaming may fit
        sw.load_pretrained(model, {"weight": torch.zeros(3, 4)})
    said = str(err.value)
    assert "missing from the source: ['bias']" in said and "pass rename=" in said, said
    assert "Build the model" not in said, said


def test_load_pretrained_sources_and_errors(tmp_path):
    state = _trained_bn_state()
    path = str(tmp_path / "cnn.safetensors")
    save_file(state, path)
    # Hugging Face sharded layout: two files and an index.
    folder = tmp_path / "hf"
    folder.mkdir()
    keys = list(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for fname, ks in halves.items():
        save_file({k: state[k] for k in ks}, str(folder / fname))
    json.dump({"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}},
              open(folder / "model.safetensors.index.json", "w"))
    run_ranks(_pretrained_checks, 2, path, str(folder))
    run_ranks(_pretrained_checks, 3, path, str(folder))


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def _pickles(rank, world, good, evil):
    model = sw.shard(SmallCNN())
    sw.load_pretrained(model, good)
    with pytest.raises(sw.ShardwiseError, match="refusing to load"):
        sw.load_pretrained(model, evil)


def test_pickles_load_only_weights_only(tmp_path):
    good, evil = str(tmp_path / "good.pt"), str(tmp_path / "evil.bin")
    torch.save(_trained_bn_state(), good)
    torch.save({"x": Evil()}, evil)
    run_ranks(_pickles, 2, good, evil)


@pytest.mark.slow
def test_consolidate_command(tmp_path):
    ck = str(tmp_path / "ck")
    sd = run_ranks(_save_then_continue, 3, ck)[0][0]
    out = str(tmp_path / "full.safetensors")
    cli = [sys.executable, "-m", "shardwise.cli"]
    subprocess.run(cli + ["consolidate", ck, out], check=True, capture_output=True)
    got = load_file(out)
    assert got.keys() == sd.keys()  # tied weight under both names
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    # Folder output, split into several files by a tiny shard size.
    folder = str(tmp_path / "export")
    files = consolidate(ck, folder + "/", max_shard_bytes=20_000)
    assert os.path.join(folder, "model.safetensors.index.json") in files and len(files) > 3
    info = subprocess.run(cli + ["inspect", ck], check=True, capture_output=True, text=True)
    assert "world size     3" in info.stdout and "tok_emb.weight" in info.stdout
    bad = subprocess.run(cli + ["inspect", str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1 and "a folder without checkpoint.json" in bad.stderr


def _cnn_ck(rank, world, ck):
    model = sw.shard(SmallCNN())
    sw.save_checkpoint(ck, model)
    return sw.full_state_dict(model)


def test_consolidate_keeps_integer_buffers(tmp_path):
    ck = str(tmp_path / "ck")
    sd = run_ranks(_cnn_ck, 2, ck)[0]
    out = str(tmp_path / "cnn.safetensors")
    consolidate(ck, out, progress=False)
    got = load_file(out)
    assert got["blocks.0.bn.num_batches_tracked"].dtype == torch.int64
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def _extra_and_local(rank, world, ck):
    model = sw.shard(SmallCNN(), buffers="local")
    with pytest.raises(sw.ShardwiseError, match="would not come back from JSON"):
        sw.save_checkpoint(ck, model, extra={"pair": (1, 2)})
    with pytest.raises(sw.ShardwiseError, match="NaN and infinity are not"):
        sw.save_checkpoint(ck, model, extra={"loss": float("nan")})
    model.blocks[0].bn.running_mean.fill_(float(rank))  # per-rank by design under "local"
    sw.save_checkpoint(ck, model, extra={"pair": [1, 2]})
    again = sw.shard(SmallCNN(), buffers="local")
    assert sw.load_checkpoint(ck, again) == {"pair": [1, 2]}
    assert torch.equal(again.blocks[0].bn.running_mean, torch.zeros(16))  # rank 0's


def test_extra_must_survive_json_and_local_buffers_save(tmp_path):
    run_ranks(_extra_and_local, 2, str(tmp_path / "ck"))


def test_checkpoint_metadata_cannot_point_outside_its_folder(tmp_path):
    ck, data, variant, variants = _damaged_copies(tmp_path)

    def set_data(value):
        def damage(path, _data_dir):
            meta_path = os.path.join(path, "checkpoint.json")
            meta = json.load(open(meta_path))
            meta["data"] = value
            meta["meta_sha256"] = canonical_sha256(meta)  # a writer that lies consistently
            json.dump(meta, open(meta_path, "w"))
        return damage

    def symlinked_data(path, _data_dir):  # the data folder links to another checkpoint's
        shutil.rmtree(os.path.join(path, data))
        os.symlink(os.path.join(ck, data), os.path.join(path, data))

    variant("absolute", set_data(os.path.join(ck, data)))
    variant("relative", set_data(os.path.join("..", "ck", data)))
    variant("symlink", symlinked_data)
    messages = run_ranks(_load_broken, 2, variants)[0]  # each loaded before the fix
    assert "field data: expected a data-<hex> folder name" in messages["absolute"]
    assert "field data: expected a data-<hex> folder name" in messages["relative"]
    assert "field 'data'" in messages["symlink"] and "leads outside" in messages["symlink"]


def _pretrained_folders(rank, world, refused, loads, per_rank):
    model = sw.shard(SmallCNN())
    before = sw.full_state_dict(model, rank0_only=False)
    out = {}
    for name, folder in refused.items():
        with pytest.raises(sw.ShardwiseError) as err:
            sw.load_pretrained(model, folder)
        out[name] = str(err.value)
    after = sw.full_state_dict(model, rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Different weights on different ranks: refused on every rank, nothing loaded.
    for name, sources in per_rank.items():
        with pytest.raises(sw.ShardwiseError, match="the ranks were given different weights"):
            sw.load_pretrained(model, sources[rank])
        after = sw.full_state_dict(model, rank0_only=False)
        assert all(torch.equal(before[k], after[k]) for k in before), name
    for folder, want in loads:
        sw.load_pretrained(model, folder)
        got = sw.full_state_dict(model, rank0_only=False)
        assert all(torch.equal(got[k], v) for k, v in want.items())
    return out


def _hub_cache(root, sd):
    """A model as the Hugging Face hub caches it: snapshots/<rev>/ holds symlinks into
    ../../blobs/<hash>, one folder with a single file, one with an index and two shards."""
    repo = root / "models--org--cnn"
    (repo / "blobs").mkdir(parents=True)
    keys = list(sd)
    halves = {"model-00001-of-00002.safetensors": keys[:4],
              "model-00002-of-00002.safetensors": keys[4:]}
    layouts = {"single": {"model.safetensors": keys}, "sharded": halves}
    folders = {}
    for rev, files in layouts.items():
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        for fname, ks in files.items():
            blob = repo / "blobs" / f"{rev}-{fname}-sha"
            save_file({k: sd[k] for k in ks}, str(blob))
            os.symlink(os.path.join("..", "..", "blobs", blob.name), snap / fname)
        if rev == "sharded":
            json.dump({"weight_map": {k: f for f, ks in files.items() for k in ks}},
                      open(blob.parent / "index-sha", "w"))
            os.symlink("../../blobs/index-sha", snap / "model.safetensors.index.json")
        folders[rev] = str(snap)
    return folders


def test_load_pretrained_folder_entries(tmp_path):
    """An entry's name must stay inside the folder and resolve to a regular file; a
    symlink may lead anywhere (the hub cache's layout, refused as "leads outside" before)."""
    sd = _trained_bn_state()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    save_file(sd, str(elsewhere / "x.safetensors"))
    refused = {}
    for name, target in (("relative", "../elsewhere/x.safetensors"),
                         ("absolute", str(elsewhere / "x.safetensors")),
                         ("device", "zero.safetensors"), ("dangling", "gone.safetensors")):
        folder = tmp_path / name
        folder.mkdir()
        if name == "device":
            os.symlink("/dev/zero", folder / "zero.safetensors")
        if name == "dangling":
            os.symlink(tmp_path / "nowhere", folder / "gone.safetensors")
        json.dump({"weight_map": {k: target for k in sd}},
                  open(folder / "model.safetensors.index.json", "w"))
        refused[name] = str(folder)
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(elsewhere / "x.safetensors", linked / "model.safetensors")
    hub = _hub_cache(tmp_path / "hub", sd)
    loads = [(str(linked), sd), (hub["single"], sd), (hub["sharded"], sd)]
    # Per-rank sources: two files of the same names and shapes but other values, and two
    # dicts built from different seeds.
    other = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    save_file(other, str(tmp_path / "other.safetensors"))
    per_rank = {"files": [str(elsewhere / "x.safetensors"), str(tmp_path / "other.safetensors")],
                "dicts": [sd, other]}
    messages = run_ranks(_pretrained_folders, 2, refused, loads, per_rank)[0]
    assert "leads outside" in messages["relative"]
    assert "is not a path relative to" in messages["absolute"]
    assert "zero.safetensors is not a regular file (it links to /dev/zero)" in \
        messages["device"]
    assert "gone.safetensors does not exist" in messages["dangling"]
    assert all("weight_map" in m for m in messages.values())


def test_load_pretrained_refuses_a_key_stored_in_two_files(tmp_path):
    sd = SmallCNN().state_dict()
    key, last = list(sd)[0], list(sd)[-1]
    save_file({k: v for k, v in sd.items() if k != last}, str(tmp_path / "a.safetensors"))
    save_file({key: sd[key], last: sd[last]}, str(tmp_path / "b.safetensors"))  # key again
    weight_map = {k: "b.safetensors" if k == last else "a.safetensors" for k in sd}
    json.dump({"weight_map": weight_map}, open(tmp_path / "model.safetensors.index.json", "w"))
    # Before the fix: "maps keys to files that do not hold them", naming the wrong fault.
    with pytest.raises(sw.ShardwiseError, match=f"{key!r} is stored twice, in .*a.safetensors "
                                                f"and in .*b.safetensors"):
        sw.load_pretrained(SmallCNN(), str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(sw.ShardwiseError, match="index.json: not a JSON object"):
        sw.load_pretrained(SmallCNN(), str(tmp_path))


@contextlib.contextmanager
def full_disk(rank: int, failing: int = 1, after: int = 3) -> Iterator[None]:
    """On rank ``failing``, a data file's writes fail with ENOSPC after ``after`` tensors
    reached it (the file half written, Note [streamed save])."""
    import shardwise.checkpoint.save as save

    real = save.Writer.write
    written = [0]

    def write(self, name, tensor):
        written[0] += 1
        if rank == failing and written[0] > after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, name, tensor)

    save.Writer.write = write
    try:
        yield
    finally:
        save.Writer.write = real


def _save_failures(rank, world, root):
    model = sw.shard(_gpt(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, range(1))
    good = os.path.join(root, "good")
    sw.save_checkpoint(good, model, opt, extra={"step": 1})
    messages = {}
    # A path that is a file: rank 0 cannot create the data folder.
    with pytest.raises(sw.ShardwiseError) as err:
        sw.save_checkpoint(os.path.join(root, "a_file"), model, opt)
    messages["file"] = str(err.value)
    # A value JSON cannot hold, on one rank only.
    with pytest.raises(sw.ShardwiseError) as err:
        sw.save_checkpoint(good, model, opt, extra={"loss": object() if rank == 1 else 1.0})
    messages["extra"] = str(err.value)
    # A full disk on rank 1: its data file, streamed a tensor at a time (Note [streamed
    # save]), fails half-way, after some tensors reached the file.
    with full_disk(rank), pytest.raises(sw.ShardwiseError) as err:
        sw.save_checkpoint(good, model, opt, extra={"step": 2})
    messages["disk"] = str(err.value)
    torch.distributed.barrier()
    # The last good checkpoint is intact and alone: the failed save left no data folder.
    assert sw.load_checkpoint(good, model, opt) == {"step": 1}
    data_dirs = [e for e in os.listdir(good) if e.startswith("data-")]
    assert len(data_dirs) == 1, data_dirs
    return messages


def test_save_failures_on_some_ranks_raise_everywhere_and_leave_no_debris(tmp_path):
    open(tmp_path / "a_file", "w").close()
    messages = run_ranks(_save_failures, 2, str(tmp_path), timeout=120)
    for m in messages:  # every rank got the same, named error (before: the others hung)
        assert "rank(s) [0]: cannot create" in m["file"]
        assert "rank(s) [1]" in m["extra"] and "extra" in m["extra"]
        assert "rank(s) [1]: OSError" in m["disk"] and "No space left" in m["disk"]


def _edit_meta(edit):
    """A damage that edits checkpoint.json and recomputes its checksum: a writer that lies
    consistently, which the schema and the data files' own records must catch."""
    def damage(path, _data_dir):
        meta_path = os.path.join(path, "checkpoint.json")
        meta = json.load(open(meta_path))
        edit(meta)
        meta["meta_sha256"] = canonical_sha256(meta)
        json.dump(meta, open(meta_path, "w"))
    return damage


def _even_param(meta):
    """A parameter whose two pieces have the same length (swapping them keeps every
    length check happy)."""
    return next(m for m, e in meta["params"].items()
                if e["pieces"][0][1] == e["pieces"][1][1] > 0)


def test_metadata_that_lies_with_a_recomputed_checksum_is_refused(tmp_path):
    """Each of these loaded wrong values silently, or failed later, before the fix."""
    ck, data, variant, variants = _damaged_copies(tmp_path)

    def swap_pieces(meta):
        e = meta["params"][_even_param(meta)]
        e["pieces"] = [e["pieces"][1], e["pieces"][0]]

    def state_dtype(meta):
        st = next(iter(meta["optimizer"]["state"].values()))
        st["momentum_buffer"]["dtype"] = "float16"

    def kind(meta):
        st = next(iter(meta["optimizer"]["state"].values()))
        st["momentum_buffer"]["kind"] = "replicated"

    def header_dtype(path, data_dir):
        f = os.path.join(data_dir, "rank-00000-of-00002.safetensors")
        raw = bytearray(open(f, "rb").read())
        at = raw.index(b'"dtype":"F32"')
        raw[at:at + 13] = b'"dtype":"I32"'  # the same bytes reinterpreted
        open(f, "wb").write(bytes(raw))
        import hashlib

        def rehash(meta):
            meta["files"]["rank-00000-of-00002.safetensors"]["sha256"] = \
                hashlib.sha256(bytes(raw)).hexdigest()
        _edit_meta(rehash)(path, data_dir)

    def rng(version=None, index=None, rank=1):
        def edit(meta):
            if version is not None:
                meta["python_rng"][rank][0] = version
            if index is not None:
                meta["python_rng"][rank][1][-1] = index
        return _edit_meta(edit)

    def hyper(key, value=KeyError):
        def edit(meta):
            g = meta["optimizer"]["param_groups"][0]
            if value is KeyError:
                del g[key]
            else:
                g[key] = value
        return _edit_meta(edit)

    variant("swapped_pieces", _edit_meta(swap_pieces))
    variant("state_dtype", _edit_meta(state_dtype))
    variant("kind", _edit_meta(kind))
    variant("header_dtype", header_dtype)
    variant("rng_version", rng(version=4))  # 2 and 3 are valid
    variant("rng_index", rng(index=625))
    variant("lr_missing", hyper("lr"))
    variant("lr_string", hyper("lr", "0.1"))
    variant("momentum_list", hyper("momentum", [0.5]))
    variant("weight_decay_none", hyper("weight_decay", None))
    variant("nesterov_int", hyper("nesterov", 0))
    messages = run_ranks(_load_broken, 2, variants)[0]  # nothing changed, on every rank
    assert "holds other pieces than the metadata says" in messages["swapped_pieces"]
    assert "momentum_buffer is F32 [" in messages["state_dtype"]
    assert "the metadata says F16" in messages["state_dtype"]
    assert "saved sharded, not replicated" in messages["kind"]
    assert "is I32" in messages["header_dtype"] and "says F32" in messages["header_dtype"]
    for name in ("rng_version", "rng_index"):
        assert "python_rng[1]: not a state Python's random accepts" in messages[name]
    assert "lacks the hyperparameter 'lr'" in messages["lr_missing"]
    assert "param_groups[0].lr: '0.1' where the optimizer has float" in messages["lr_string"]
    assert ".momentum: [0.5] where the optimizer has float" in messages["momentum_list"]
    assert ".weight_decay: None where" in messages["weight_decay_none"]
    assert ".nesterov: 0 where the optimizer has bool" in messages["nesterov_int"]


def test_bad_arguments_are_shardwise_errors(tmp_path):
    """Before: bare TypeErrors from os.path."""
    model = SmallCNN()
    with pytest.raises(sw.ShardwiseError, match="path must be a non-empty str or os.PathLike"):
        sw.save_checkpoint(b"ck", model)
    with pytest.raises(sw.ShardwiseError, match="path must be a non-empty str or os.PathLike"):
        sw.load_checkpoint(None, model)
    sw.save_checkpoint(tmp_path / "ck", model)  # a pathlib.Path is a path
    sw.load_checkpoint(tmp_path / "ck", model)


def test_a_path_without_a_checkpoint_says_what_it_is(tmp_path, capsys):
    """Issue 51 item 6: a typo'd path got the same "checkpoint.json is missing" as an
    empty folder."""
    from shardwise.cli import main

    model = nn.Linear(2, 2)
    sw.save_checkpoint(tmp_path / "run" / "step-2", model)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    cases = [("rnu", "rnu: no such checkpoint folder: check the path; did you mean 'run'?"),
             ("nope/deeper", "no such checkpoint folder (nor its parent, "),
             ("empty", "empty: a folder without checkpoint.json: not a shardwise checkpoint"),
             ("file", "file: a file, not a checkpoint folder"),
             ("run", "run: a folder without checkpoint.json, not a checkpoint itself; it "
                     "holds checkpoints (1, the last by name: 'step-2'): pass one of them")]
    for name, said in cases:
        with pytest.raises(sw.ShardwiseError) as err:
            sw.load_checkpoint(str(tmp_path / name), model)
        assert said in str(err.value), err.value
        assert main(["inspect", str(tmp_path / name)]) == 1
        assert said in capsys.readouterr().err


def test_invented_metadata_is_refused_quickly_and_briefly(tmp_path):
    """Invented entries (200,000 took 14.7 s to refuse, in a message listing them all)."""
    ck = str(tmp_path / "ck")
    model = SmallCNN()
    sw.save_checkpoint(ck, model)
    meta_path = os.path.join(ck, "checkpoint.json")
    meta = json.load(open(meta_path))
    entry = next(iter(meta["params"].values()))
    for i in range(20_000):
        meta["params"][f"invented.{i}"] = dict(entry, names=[f"invented.{i}"])
    meta["meta_sha256"] = canonical_sha256(meta)
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(sw.ShardwiseError) as err:
        sw.load_checkpoint(ck, model)
    message = str(err.value)
    n = len(model.state_dict()) - 3 * 3  # each BatchNorm has 3 buffers
    assert f"field params lists {20_000 + n} tensors, the model has {n + 9} in all" in message
    assert f"and {20_000 + n - 10} more" in message and len(message) < 1000, message


def _edited(path, edit, sign):
    """Apply ``edit`` to ``path``'s checkpoint.json; recompute the checksum (a writer that
    lies consistently) or delete it."""
    meta_path = os.path.join(path, "checkpoint.json")
    meta = json.load(open(meta_path))
    edit(meta)
    meta.pop("meta_sha256", None)
    if sign:
        meta["meta_sha256"] = canonical_sha256(meta)
    json.dump(meta, open(meta_path, "w"))


def _swap_pieces(meta):
    """Claim format 1 and swap two ranks' equal-length pieces of one parameter: each
    rank would load the other's rows (and momentum) if nothing compared the files."""
    meta["format_version"] = 1
    for entry in meta["params"].values():
        (o0, n0), (o1, n1) = entry["pieces"]
        if n0 == n1 > 0:
            entry["pieces"] = [[o1, n1], [o0, n0]]
            return
    raise AssertionError("no parameter with two equal pieces")


def _load_extra(rank, world, path):
    model = sw.shard(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    extra = sw.load_checkpoint(path, model, opt)
    return extra, opt.param_groups[0]["lr"], sw.full_state_dict(model)


def test_a_format_downgrade_or_a_missing_checksum_is_refused(tmp_path):
    """Issue 31 items 1-2: each of these loaded before, the first with two ranks' rows
    and momentum exchanged, the others with the edited values."""
    ck, data, variant, variants = _damaged_copies(tmp_path)
    variant("downgraded", lambda p, d: _edited(p, _swap_pieces, sign=True))
    variant("downgraded_unsigned", lambda p, d: _edited(p, _swap_pieces, sign=False))
    variant("unsigned_extra", lambda p, d: _edited(
        p, lambda m: m.update(extra={"step": 999999}), sign=False))

    def lr(meta):
        meta["optimizer"]["param_groups"][0]["lr"] = 123.0

    variant("unsigned_lr", lambda p, d: _edited(p, lr, sign=False))
    messages = run_ranks(_load_broken, 2, variants)[0]
    assert "holds other pieces than the metadata says" in messages["downgraded"]
    for name in ("downgraded_unsigned", "unsigned_extra", "unsigned_lr"):
        assert "field meta_sha256: missing" in messages[name], messages[name]
        assert "shardwise sign" in messages[name]
    assert "missing" in describe(variants["unsigned_lr"])  # inspect still describes it

    # A deliberate edit is signed explicitly, after the metadata was checked against the
    # data files; a lying one is refused by sign too, and nothing is written.
    from shardwise.cli import main

    before = open(os.path.join(variants["downgraded_unsigned"], "checkpoint.json")).read()
    assert main(["sign", variants["downgraded_unsigned"]]) == 1
    assert open(os.path.join(variants["downgraded_unsigned"], "checkpoint.json")).read() \
        == before
    assert main(["sign", variants["unsigned_lr"]]) == 0
    assert main(["sign", variants["unsigned_lr"]]) == 0  # matches now: nothing written
    extra, got_lr, state = run_ranks(_load_extra, 2, variants["unsigned_lr"])[0]
    assert extra == {"version": 1} and got_lr == 123.0
    original = run_ranks(_load_extra, 2, ck)[0][2]
    assert all(torch.equal(state[k], original[k]) for k in original)


def _lock_as_another_user(folder, queue):
    """In a child: take the folder's lock as a user who did not write the lock file
    (root drops to nobody; others cannot write a 0o444 file of their own either)."""
    from shardwise.checkpoint._lock import FolderLock

    if os.getuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    lock = FolderLock(folder)
    try:
        lock.acquire()
    except sw.ShardwiseError as e:
        queue.put(("refused", str(e)))
        return
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
        queue.put(("failed", f"{type(e).__name__}: {e}"))
        return
    lock.release()
    queue.put(("took", ""))


def _as_another_user(folder):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    p = ctx.Process(target=_lock_as_another_user, args=(folder, queue))
    with forking():  # Note [forking from pytest's process] in tests/harness.py
        p.start()
    try:
        return queue.get(timeout=120)  # generous: the machine may be loaded
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()


def test_a_stale_lock_never_blocks_a_later_writer():
    """Issue 31 item 4: a killed save's checkpoint.lock made another user's save fail
    with a bare PermissionError, and a FIFO of that name with OSError [Errno 22]."""
    import tempfile

    # Outside pytest's tmp_path, whose parents the other user may not search; the folder
    # may be written by the other user.
    folder = tempfile.mkdtemp(prefix="shardwise-lock-test-")
    os.chmod(folder, 0o777)
    try:
        _stale_locks(folder)
    finally:
        shutil.rmtree(folder)


def _stale_locks(folder):
    from shardwise.checkpoint._lock import FolderLock

    path = os.path.join(folder, "checkpoint.lock")
    open(path, "w").write('{"pid": 1, "host": "gone", "since": "then"}')  # holder killed
    FolderLock(folder).acquire()  # the same user: takes it as it is
    os.remove(path)
    open(path, "w").write("{}")
    os.chmod(path, 0o444)
    assert _as_another_user(folder) == ("took", "")  # stale: removed, then taken
    holder = FolderLock(folder)
    holder.acquire()  # alive this time
    os.chmod(path, 0o444)
    outcome, message = _as_another_user(folder)
    assert outcome == "refused" and "being written by another save" in message, message
    holder.release()
    os.mkfifo(path)
    with pytest.raises(sw.ShardwiseError, match=r"checkpoint.lock is not a regular file "
                                                r"\(a FIFO\).*rm "):
        FolderLock(folder).acquire()
