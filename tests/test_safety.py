"""What shardwise reads never runs code, and what it deletes is only its own (issue 51).

Reads: a pickle whose ``__reduce__`` would leave a marker file behind is planted into
every file of every folder shardwise reads (a checkpoint, a ``Resumable`` run folder,
``ShardwiseAccelerator.save_state``'s folder, a Lightning checkpoint, a Trainer
checkpoint, Hugging Face weights folders), one file at a time (the same file of every
rank at once), and the load is tried on every rank: it may load (a file it does not
read) or fail, but the marker must never appear. Before the fix,
``ShardwiseAccelerator.load_state`` unpickled ``schedulers.pt`` with
``weights_only=False`` and ran the planted code on every rank.

Deletes: every place shardwise deletes from (Note [what shardwise deletes] in _fs.py) is
pointed at a symbolic link to a folder of someone else's files, and at a real folder of
someone else's files; each file must survive. Before the fix, a ``failures`` link made
``Resumable`` empty the folder it led to, and ``Offload(folder=F)`` deleted every
``*.bin`` in ``F/rank<r>``, through a link too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

import shardwise as sw
from shardwise.checkpoint.consolidation import consolidate as consolidate_checkpoint
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


# -- reads ---------------------------------------------------------------------------------

class Planted:
    """Unpickled by anything but torch's weights-only unpickler, it creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "a"))


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder)
                  for d, _, files in os.walk(folder) for f in files)


def _groups(folder: str) -> dict[str, list[str]]:
    """The files of ``folder``, those that differ only by rank together: every rank
    reads its own, and a failure on one rank only would leave the others waiting."""
    groups: dict[str, list[str]] = {}
    for rel in _files(folder):
        groups.setdefault(re.sub(r"(rank-|rng_state_)\d+", r"\1*", rel), []).append(rel)
    return groups


def _plant_each(rank: int, folder: str, marker: str, attempt: Callable[[], object],
                ) -> dict[str, str]:
    """Plant the pickle into each file (group) of ``folder`` in turn, on a fresh copy of
    it, and call ``attempt`` on every rank; what each attempt did, by file."""
    pristine = folder + ".pristine"
    if rank == 0:
        shutil.copytree(folder, pristine, symlinks=True)
    dist.barrier()
    outcomes = {}
    for key, members in _groups(pristine).items():
        if rank == 0:
            shutil.rmtree(folder)
            shutil.copytree(pristine, folder, symlinks=True)
            for rel in members:
                torch.save(Planted(marker), os.path.join(folder, rel))
        dist.barrier()
        try:
            attempt()
            outcomes[key] = "loaded"
        except Exception as e:  # noqa: BLE001 - what happened is the result
            outcomes[key] = f"{type(e).__name__}: {str(e)[:120]}"
        dist.barrier()
        if os.path.exists(marker):
            raise AssertionError(f"{folder}/{key}: the planted pickle ran ({outcomes[key]})")
    if rank == 0:
        shutil.rmtree(folder)
        os.rename(pristine, folder)
    dist.barrier()
    return outcomes


def _model_and_optimizer():
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt) -> None:
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(x, torch.roll(x, -1, 1)).backward()
    opt.step()
    opt.zero_grad()


def _core_reads(rank, world, root):
    marker = f"{root}/marker"
    model, opt = _model_and_optimizer()
    _step(model, opt)
    seen = {}

    # sw.load_checkpoint, and consolidate (shardwise consolidate), which reads the same.
    ckpt = f"{root}/ckpt"
    sw.save_checkpoint(ckpt, model, opt, extra={"epoch": 1})
    seen["load_checkpoint"] = _plant_each(
        rank, ckpt, marker, lambda: sw.load_checkpoint(ckpt, model, opt))

    def consolidate():
        if rank == 0:
            consolidate_checkpoint(ckpt, f"{root}/consolidated.safetensors")

    seen["consolidate"] = _plant_each(rank, ckpt, marker, consolidate)

    # Resumable: two step folders, and failure records of an attempt that failed.
    run = f"{root}/run"
    with pytest.raises(RuntimeError), sw.Resumable(run, model, opt, every=1) as r:
        for _ in r.steps(2):
            _step(model, opt)
        raise RuntimeError("the first attempt failed")
    with pytest.raises(RuntimeError), sw.Resumable(run, model, opt, every=1):
        raise RuntimeError("and so did the second")  # failures.json and new records

    def resume():
        sw.Resumable(run, model, opt, every=1).close()

    seen["Resumable"] = _plant_each(rank, run, marker, resume)
    return seen


def test_no_file_in_a_checkpoint_or_run_folder_is_unpickled(tmp_path):
    seen = run_ranks(_core_reads, 2, str(tmp_path), timeout=240)[0]
    # Every file shardwise reads was read and refused in words.
    assert "checkpoint.json" in seen["load_checkpoint"]
    assert any(k.endswith("rank-*-of-00002.safetensors") for k in seen["load_checkpoint"])
    for what in ("load_checkpoint", "consolidate"):
        for key, outcome in seen[what].items():
            assert outcome.startswith("ShardwiseError"), (what, key, outcome)
    resumable = seen["Resumable"]
    assert any(k.startswith("failures/") for k in resumable), resumable
    assert "failures.json" in resumable
    # A damaged newest checkpoint is skipped and the older one loads; a damaged record
    # is skipped.
    assert all(o == "loaded" or o.startswith("ShardwiseError") for o in resumable.values())


def _hf_env(rank: int, world: int, port: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=32, tie_word_embeddings=False)


def _hf_reads(rank, world, root):
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM, TrainingArguments

    from shardwise.checkpoint._files import read_json, write_json_atomic
    from shardwise.checkpoint._format import META
    from shardwise.checkpoint._schema import CHECKSUM, canonical_sha256
    from shardwise.integrations.accelerate import ShardwiseAccelerator
    from shardwise.integrations.transformers import ShardwiseTrainer

    marker = f"{root}/marker"
    seen = {}

    # ShardwiseAccelerator.save_state / load_state, with a scheduler.
    _hf_env(rank, world, "29581")

    def prepared():
        torch.manual_seed(0)
        model = GPT(CFG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        acc = ShardwiseAccelerator(cpu=True)
        return (acc, *acc.prepare(model, opt, sched))

    acc, model, opt, sched = prepared()
    _step(model, opt)
    sched.step()
    state = f"{root}/state"
    acc.save_state(state)
    saved_lr = sched.get_last_lr()

    def load_state():
        acc, _, _, sched = prepared()
        acc.load_state(state)
        assert sched.get_last_lr() == saved_lr

    load_state()  # the schedulers come back (from the checkpoint's JSON)
    seen["accelerate"] = _plant_each(rank, state, marker, load_state)

    # A folder an older ShardwiseAccelerator wrote: the schedulers in schedulers.pt.
    legacy = f"{root}/legacy"
    if rank == 0:
        shutil.copytree(state, legacy)
        meta_path = f"{legacy}/shardwise/{META}"
        meta = read_json(meta_path)
        if "schedulers" in meta["extra"]:  # (before the fix, save_state wrote this)
            states = meta["extra"].pop("schedulers")
            del meta[CHECKSUM]
            meta[CHECKSUM] = canonical_sha256(meta)
            write_json_atomic(meta_path, meta)
            torch.save(states, f"{legacy}/schedulers.pt")  # plain values: weights-only
    dist.barrier()

    def load_legacy():
        acc, _, _, sched = prepared()
        acc.load_state(legacy)
        assert sched.get_last_lr() == saved_lr

    load_legacy()
    seen["accelerate, older folder"] = _plant_each(rank, legacy, marker, load_legacy)

    # ShardwiseTrainer: resume from its checkpoint folder (the Trainer's files beside
    # shardwise's checkpoint/).
    _hf_env(rank, world, "29582")
    data = [{"input_ids": x, "labels": x.clone()}
            for x in torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))]

    def args(out, steps):
        return TrainingArguments(out, per_device_train_batch_size=2, max_steps=steps,
                                 save_steps=2, save_strategy="steps", report_to=[],
                                 disable_tqdm=True, use_cpu=True, seed=0,
                                 lr_scheduler_type="linear", learning_rate=1e-3)

    def llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(_llama_config())

    ShardwiseTrainer(model=llama(), args=args(f"{root}/trainer", 2),
                     train_dataset=data).train()
    checkpoint = f"{root}/trainer/checkpoint-2"

    def resume():
        ShardwiseTrainer(model=llama(), args=args(f"{root}/resumed", 3),
                         train_dataset=data).train(resume_from_checkpoint=checkpoint)

    seen["Trainer"] = _plant_each(rank, checkpoint, marker, resume)

    # Hugging Face folders: safetensors, an index with two shards, pytorch_model.bin.
    folder, sharded, pickled = f"{root}/hf", f"{root}/hf-sharded", f"{root}/hf-bin"
    if rank == 0:
        model = llama()
        model.save_pretrained(folder)
        model.save_pretrained(sharded, max_shard_size="20KB")
        os.makedirs(pickled)
        _llama_config().save_pretrained(pickled)
        torch.save(model.state_dict(), f"{pickled}/pytorch_model.bin")
        save_file({"unused": torch.zeros(1)}, f"{root}/unused.safetensors")
    dist.barrier()
    assert any(f.endswith(".index.json") for f in os.listdir(sharded))
    for name, path in (("from_pretrained", folder), ("from_pretrained, sharded", sharded),
                       ("from_pretrained, pytorch_model.bin", pickled)):
        seen[name] = _plant_each(
            rank, path, marker, lambda p=path: sw.from_pretrained(LlamaForCausalLM, p))

    def load_pretrained():
        with sw.sharded_init():
            model = LlamaForCausalLM(_llama_config())
        sw.load_pretrained(sw.shard(model), pickled)

    seen["load_pretrained, pytorch_model.bin"] = _plant_each(rank, pickled, marker,
                                                             load_pretrained)
    return seen


@pytest.mark.slow
def test_no_file_of_an_integration_or_weights_folder_is_unpickled(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    seen = run_ranks(_hf_reads, 2, str(tmp_path), timeout=400)[0]
    # shardwise's own reads refuse in words; so does the older folder's schedulers.pt
    # (before: unpickled with weights_only=False, the planted code ran on every rank).
    assert seen["accelerate, older folder"]["schedulers.pt"].startswith("ShardwiseError")
    assert "schedulers.pt" not in seen["accelerate"]  # no pickle written any more
    for what in ("accelerate", "accelerate, older folder", "from_pretrained",
                 "from_pretrained, sharded", "from_pretrained, pytorch_model.bin",
                 "load_pretrained, pytorch_model.bin"):
        for key, outcome in seen[what].items():
            if key not in ("config.json", "generation_config.json"):  # transformers'
                assert outcome.startswith("ShardwiseError"), (what, key, outcome)
    trainer = seen["Trainer"]
    assert trainer["scheduler.pt"].startswith("ShardwiseError"), trainer
    # transformers' own reads: rng_state_*.pth weights-only (refused), trainer_state.json
    # as JSON; training_args.bin and the exported model are not read on resume.
    assert trainer["rng_state_*.pth"].startswith("UnpicklingError"), trainer
    assert trainer["training_args.bin"] == "loaded", trainer
    assert all(o.startswith("ShardwiseError") for k, o in trainer.items()
               if k.startswith("shardwise/")), trainer
    assert "trainer_state.json" in trainer and "config.json" in seen["from_pretrained"]


def _lightning_reads(rank, world, root):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(CFG)

        def training_step(self, batch, batch_idx):
            return self.model(batch[:, :-1], batch[:, 1:])

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": sched}

    data = torch.utils.data.DataLoader(
        torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0)),
        batch_size=2)

    def trainer(epochs, **kw):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), NODE_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29583")
        return L.Trainer(strategy="shardwise", accelerator="cpu", devices=world,
                         max_epochs=epochs, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **kw)

    import shardwise.integrations.lightning  # noqa: F401 - registers the strategy

    ckpts = f"{root}/ckpts"
    trainer(1, callbacks=[ModelCheckpoint(dirpath=ckpts, filename="last")]).fit(Lit(), data)
    path = f"{ckpts}/last.ckpt"

    def resume():
        trainer(1, enable_checkpointing=False).fit(Lit(), data, ckpt_path=path)

    return _plant_each(rank, path, f"{root}/marker", resume)


@pytest.mark.slow
def test_no_file_of_a_lightning_checkpoint_is_unpickled(tmp_path):
    pytest.importorskip("lightning")
    seen = run_ranks(_lightning_reads, 2, str(tmp_path), timeout=240)[0]
    assert seen and all(o.startswith("ShardwiseError") for o in seen.values()), seen


# -- deletions -----------------------------------------------------------------------------

FOREIGN = {"pytorch_model.bin": b"weights", "training_args.bin": b"args",
           "notes.txt": b"mine", "0000001-master.bin": b"named like offload's",
           "rank-00000-of-00002.safetensors": b"named like a checkpoint's",
           "buffers.safetensors": b"likewise",
           "rank0-1.json": b'{"named": "like a failure record"}'}


def _foreign(folder: str) -> str:
    """A folder of someone else's files (some named as shardwise names its own)."""
    os.makedirs(f"{folder}/sub", exist_ok=True)
    for name, data in FOREIGN.items():
        for where in (folder, f"{folder}/sub"):
            with open(f"{where}/{name}", "wb") as f:
                f.write(data)
    return folder


def _damage(folder: str, allowed: frozenset = frozenset()) -> list[str]:
    """What is missing, changed or added in a folder made by :func:`_foreign`."""
    lost = []
    for where in (folder, f"{folder}/sub"):
        if not os.path.isdir(where):
            lost.append(f"{where} deleted, with everything in it")
            continue
        for name, data in FOREIGN.items():
            path = f"{where}/{name}"
            if not os.path.isfile(path):
                lost.append(f"{path} deleted")
            elif open(path, "rb").read() != data:
                lost.append(f"{path} changed")
        added = set(os.listdir(where)) - set(FOREIGN) - {"sub"} - allowed
        lost += [f"{where}/{name} added" for name in sorted(added)]
    return lost


def _link(target: str, name: str) -> None:
    os.makedirs(os.path.dirname(name), exist_ok=True)
    os.symlink(target, name)


def _deletions(rank, world, root):
    model, opt = _model_and_optimizer()
    victims: dict[str, str] = {}  # what was pointed at a foreign folder -> that folder
    outcomes: dict[str, str] = {}  # what shardwise did where it could not work

    def foreign(what: str) -> str:
        victims[what] = _foreign(f"{root}/foreign/{len(victims)}")
        return victims[what]

    def copied(what: str, where: str) -> None:
        shutil.copytree(_foreign(f"{root}/foreign/{len(victims)}"), where)
        victims[what] = where

    def attempt(what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
            outcomes[what] = "done"
        except Exception as e:  # noqa: BLE001 - what happened is the result
            outcomes[what] = f"{type(e).__name__}: {e}"

    # Resumable: its failures folder (records written, then read and removed), and its
    # step folders (pruned beyond keep=1, and every later step); a link each, and a
    # folder of others' files each.
    for case in ("failures link", "step links", "folders"):
        run = f"{root}/run-{case.replace(' ', '-')}"
        if rank == 0:
            os.makedirs(run)
            if case == "failures link":
                _link(foreign("Resumable failures -> link"), f"{run}/failures")
            elif case == "step links":
                _link(foreign("Resumable step-00000000 -> link"), f"{run}/step-00000000")
                _link(foreign("Resumable step-00000099 -> link"), f"{run}/step-00000099")
            else:
                copied("Resumable failures, a folder", f"{run}/failures")
                copied("Resumable step-00000000, a folder", f"{run}/step-00000000")
                copied("Resumable step-00000099, a folder", f"{run}/step-00000099")
        victims = _shared(victims)

        def resumable(run=run):
            with pytest.raises(RuntimeError, match="recorded"), \
                    sw.Resumable(run, model, opt, every=1, keep=1) as r:
                for _ in r.steps(3):
                    _step(model, opt)
                raise RuntimeError("a failure, recorded")
            sw.Resumable(run, model, opt, every=1, keep=1).close()  # reports, removes

        attempt(f"Resumable, {case}", resumable)

    # save_checkpoint's tidying: data folders of earlier saves and temporary metadata, a
    # link each and a folder of others' files each; a link where rank 0's temporary
    # metadata is written.
    ckpt = f"{root}/ckpt"
    if rank == 0:
        _link(foreign("data-0badc0de -> link"), f"{ckpt}/data-0badc0de")
        copied("data-0badbeef, a folder", f"{ckpt}/data-0badbeef")
        target = foreign("checkpoint.json.tmp-<pid> -> link to a file")
        _link(f"{target}/notes.txt", f"{ckpt}/checkpoint.json.tmp-1")
        _link(f"{target}/pytorch_model.bin", f"{ckpt}/checkpoint.json.tmp-{os.getpid()}")
    victims = _shared(victims)
    attempt("save_checkpoint", lambda: sw.save_checkpoint(ckpt, model, opt))
    attempt("save_checkpoint again", lambda: sw.save_checkpoint(ckpt, model, opt,
                                                                 keep_previous=False))
    # A lock file of others' data (a hard link: the lock would be written into it), and
    # a checkpoint.json of another tool (the commit would replace it).
    locked, elsewhere = f"{root}/locked", f"{root}/not-ours"
    if rank == 0:
        target = foreign("checkpoint.lock, a hard link")
        os.makedirs(locked)
        os.link(f"{target}/notes.txt", f"{locked}/checkpoint.lock")
        os.makedirs(elsewhere)
        with open(f"{elsewhere}/checkpoint.json", "w") as f:
            json.dump({"format": "another tool's"}, f)
    victims = _shared(victims)
    attempt("save_checkpoint, checkpoint.lock", lambda: sw.save_checkpoint(locked, model))
    attempt("save_checkpoint, checkpoint.json", lambda: sw.save_checkpoint(elsewhere, model))
    with open(f"{elsewhere}/checkpoint.json") as f:
        outcomes["checkpoint.json of another tool"] = f.read()

    # Offload(folder=F): F/rank<r> a link, or a folder of others' files; and F itself a
    # folder of others' files (its rank<r> made by shardwise beside them).
    for case in ("link", "folder", "F"):
        offload = f"{root}/offload-{case}"
        if rank == 0:
            if case == "F":
                copied("Offload folder=F", offload)
            for r in range(world):
                if case == "link":
                    _link(foreign(f"Offload rank{r} -> link"), f"{offload}/rank{r}")
                elif case == "folder":
                    copied(f"Offload rank{r}, a folder", f"{offload}/rank{r}")
        victims = _shared(victims)

        def offloaded(offload=offload):
            torch.manual_seed(0)
            m = sw.shard(GPT(CFG), offload=sw.Offload(params="disk", optimizer="disk",
                                                       folder=offload))
            _step(m, torch.optim.AdamW(m.parameters(), lr=1e-2))

        attempt(f"Offload, {case}", offloaded)
        dist.barrier()
    return victims, outcomes


def _shared(victims: dict[str, str]) -> dict[str, str]:
    box = [victims]
    dist.broadcast_object_list(box, src=0)  # also keeps the ranks together
    return box[0]


def test_nothing_shardwise_did_not_write_is_deleted(tmp_path):
    victims, outcomes = run_ranks(_deletions, 2, str(tmp_path), timeout=240)[0]
    allowed = {"Offload folder=F": frozenset({"rank0", "rank1"})}
    damage = [f"{what}: {d}" for what, folder in victims.items()
              for d in _damage(folder, allowed.get(what, frozenset()))]
    assert not damage, "\n".join(damage)
    # Where shardwise cannot have a folder of its own, it refuses in words.
    assert "failures is a symbolic link" in outcomes["Resumable, failures link"], outcomes
    assert "is a symbolic link" in outcomes["Offload, link"], outcomes
    assert "not made by shardwise" in outcomes["Offload, folder"], outcomes
    assert "not a lock file shardwise wrote" in outcomes["save_checkpoint, checkpoint.lock"]
    assert "not a shardwise checkpoint's metadata" in outcomes[
        "save_checkpoint, checkpoint.json"]
    assert json.loads(outcomes["checkpoint.json of another tool"]) == {
        "format": "another tool's"}
    for what in ("Resumable, step links", "Resumable, folders", "save_checkpoint",
                 "save_checkpoint again", "Offload, F"):
        assert outcomes[what] == "done", (what, outcomes[what])
    # What shardwise wrote is gone: pruned checkpoints, reported failure records, the
    # data folders of earlier saves.
    for case in ("step-links", "folders"):
        run = tmp_path / f"run-{case}"
        assert sorted(e for e in os.listdir(run) if e.startswith("step-")) == [
            "step-00000000", "step-00000003", "step-00000099"]
        assert not [e for e in os.listdir(run / "failures") if re.fullmatch(
            r"rank\d+-\d+\.json", e) and e != "rank0-1.json"]
    with open(tmp_path / "ckpt" / "checkpoint.json") as f:
        data = json.load(f)["data"]
    # (Sorted on both sides: the save's own folder has a random hex name.)
    assert sorted(e for e in os.listdir(tmp_path / "ckpt") if e.startswith("data-")) == sorted(
        ["data-0badbeef", "data-0badc0de", data])


def test_lightning_removes_only_what_it_wrote(tmp_path):
    """ModelCheckpoint drops checkpoints beyond save_top_k through the strategy;
    Lightning's own removal deletes the whole tree at that path, through a link too."""
    pytest.importorskip("lightning")
    from lightning.fabric.plugins import TorchCheckpointIO

    from shardwise.integrations.lightning import ShardwiseStrategy

    main = SimpleNamespace(is_global_zero=True, checkpoint_io=TorchCheckpointIO())
    link, folder = tmp_path / "link.ckpt", tmp_path / "folder.ckpt"
    os.symlink(_foreign(str(tmp_path / "a")), link)
    _foreign(str(folder))
    for path in (link, folder):
        ShardwiseStrategy.remove_checkpoint(main, str(path))
    damage = _damage(str(tmp_path / "a")) + _damage(str(folder))
    assert not damage, "\n".join(damage)
    assert os.path.islink(link)
    # A checkpoint it wrote is removed whole.
    torch.manual_seed(0)
    model = GPT(CFG)
    sw.save_checkpoint(str(tmp_path / "ours.ckpt"), model,
                       torch.optim.AdamW(model.parameters(), lr=1e-2))
    ShardwiseStrategy.remove_checkpoint(main, str(tmp_path / "ours.ckpt"))
    assert not os.path.exists(tmp_path / "ours.ckpt")
