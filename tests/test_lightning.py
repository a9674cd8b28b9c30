"""ShardwiseStrategy: a real Lightning Trainer on a sharded LightningModule, against
Lightning's own DDP strategy on the same model and data, then resumed at 1, 2 and 3 ranks.

The ranks come from the harness (gloo, process group already initialised); Lightning's
``LightningEnvironment`` reads them from the variables torchrun would set and reuses the
group. The global batch is 6 at every world size (6 // world per rank; Lightning's
DistributedSampler shuffles the same way at every size and deals rank r every world-th
index), so a run at 1 or 3 ranks continues the trajectory of one at 2, up to rounding.
"""

import os
import subprocess
import sys

import pytest
import torch
from harness import run_ranks
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.models import GPT, GPTConfig

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import (  # noqa: E402
    MixedPrecision as LightningMixedPrecision,
)

from shardwise.integrations.lightning import (  # noqa: E402
    ShardwiseStrategy,
    _from_json,
    _to_json,
)

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32)
GLOBAL_BATCH, EPOCHS, ACCUMULATE = 6, 3, 2
# 24 sequences: 4 global batches per epoch, 2 optimizer steps (accumulating 2 batches).
DATA = torch.randint(0, 64, (24, 17), generator=torch.Generator().manual_seed(5))
VAL = torch.randint(0, 64, (6, 17), generator=torch.Generator().manual_seed(6))


class LitGPT(L.LightningModule):
    def __init__(self, lr: float = 1e-2, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()  # hyper_parameters travel in the checkpoint's JSON
        torch.manual_seed(seed)
        self.model = GPT(CFG)
        self.losses: list[float] = []     # the global mean loss of every batch
        self.emb_dtypes: set = set()      # tok_emb's dtype while the step computes

    def forward(self, x, y):
        return self.model(x, y)

    def training_step(self, batch, batch_idx):
        loss = self(batch[:, :-1], batch[:, 1:])  # self(...): a root forward in the step
        self.emb_dtypes.add(self.model.tok_emb.weight.dtype)
        self.log("train_loss", loss, sync_dist=True)                       # strategy.reduce
        self.losses.append(self.all_gather(loss.detach()).mean().item())   # all_gather
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(batch[:, :-1], batch[:, 1:]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.model(batch[:, :-1]).argmax(-1)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        # Decays per step, so a resume that lost the scheduler's state would show.
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.8 ** step)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _env(rank: int, world: int) -> None:
    # What torchrun sets. LightningEnvironment deletes WORLD_SIZE at teardown, so this runs
    # before every Trainer.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29571")


def _trainer(rank: int, world: int, strategy, **kwargs) -> "L.Trainer":
    _env(rank, world)
    options = dict(accelerator="cpu", devices=world, max_epochs=EPOCHS, logger=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, accumulate_grad_batches=ACCUMULATE,
                   gradient_clip_val=0.5, enable_checkpointing=False)
    options.update(kwargs)
    return L.Trainer(strategy=strategy, **options)


def _loaders(world: int):
    batch = GLOBAL_BATCH // world
    return (torch.utils.data.DataLoader(DATA, batch_size=batch),
            torch.utils.data.DataLoader(VAL, batch_size=batch))


def _two_ranks(rank, world, root):
    train, val = _loaders(world)

    # Lightning's DDP on the unsharded model: the reference.
    ddp_lit = LitGPT()
    ddp = _trainer(rank, world, "ddp")
    ddp.fit(ddp_lit, train, val)
    ddp_metrics = {k: v.item() for k, v in ddp.callback_metrics.items()}
    ddp_state = {k: v.detach().clone() for k, v in ddp_lit.state_dict().items()}

    # The same run under strategy="shardwise", checkpointing every epoch.
    lit = LitGPT()
    ckpt = ModelCheckpoint(dirpath=f"{root}/ckpts", filename="{epoch}", save_top_k=-1,
                           monitor="val_loss")
    trainer = _trainer(rank, world, "shardwise", enable_checkpointing=True,
                       callbacks=[ckpt])
    assert isinstance(trainer.strategy, ShardwiseStrategy)
    trainer.fit(lit, train, val)
    assert sw.is_sharded(lit) and sw.inspect(lit).units  # the state lives on lit
    assert "forward" not in vars(lit)  # the steps' redirection left nothing behind
    opt = trainer.optimizers[0]
    params = [p for g in opt.param_groups for p in g["params"]]
    # configure_optimizers ran on the sharded module: the optimizer holds its DTensors.
    assert [id(p) for p in params] == [id(p) for p in lit.parameters()]
    assert all(isinstance(p, DTensor) for p in params)

    # Losses against DDP's. The first accumulation step sees identical weights, so its
    # losses must be identical. After it, clipping's global norm sums squares in another
    # order (whole gradients in DDP, each rank's rows and then across ranks here), which
    # can change the clip factor in its last bit (_clipping measures it). Measured here:
    # losses, logged metrics and final weights all identical to DDP's, bit for bit, the
    # clip factors of these 6 steps coming out alike. 1e-6 leaves room for a norm rounded
    # differently on another CPU (4.8e-7 over 16 steps in _clipping); the loss moves by
    # at least 4e-3 from one batch to the next.
    assert len(lit.losses) == len(ddp_lit.losses) == 12
    assert lit.losses[:ACCUMULATE] == ddp_lit.losses[:ACCUMULATE]
    assert lit.losses == pytest.approx(ddp_lit.losses, rel=1e-6, abs=0)
    metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
    assert metrics.keys() == ddp_metrics.keys() == {"train_loss", "val_loss"}
    assert metrics == pytest.approx(ddp_metrics, rel=1e-6, abs=0)
    full = sw.full_state_dict(lit, rank0_only=False)
    assert full.keys() == ddp_state.keys()
    for k, v in full.items():  # measured: identical
        torch.testing.assert_close(v, ddp_state[k], rtol=1e-6, atol=1e-7, msg=k)
    assert trainer.global_step == ddp.global_step == EPOCHS * 2
    assert lit.emb_dtypes == {torch.float32}

    # Collectives Lightning calls on the strategy.
    strategy = trainer.strategy
    assert strategy.broadcast(f"from {rank}") == "from 0"
    strategy.barrier()
    assert strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item() == 3.0
    assert strategy.reduce_boolean_decision(rank == 0, all=False)
    assert not strategy.reduce_boolean_decision(rank == 0)

    # After fit's teardown the module is still sharded and usable: validate re-enters
    # setup, which neither shards nor moves it again, and matches DDP's validation.
    val_ours = _trainer(rank, world, "shardwise").validate(lit, val, verbose=False)
    val_ddp = _trainer(rank, world, "ddp").validate(ddp_lit, val, verbose=False)
    assert val_ours[0]["val_loss"] == pytest.approx(val_ddp[0]["val_loss"], rel=1e-6, abs=0)

    # Each epoch's checkpoint is a shardwise checkpoint folder.
    for epoch in range(EPOCHS):
        assert os.path.isfile(f"{root}/ckpts/epoch={epoch}.ckpt/checkpoint.json")

    # Resume from the end of epoch 0 at the same world size: bit-identical to the run
    # that went on (weights, AdamW moments, scheduler, loops and RNG all restored).
    # Other initial weights and lr: the checkpoint's weights and optimizer state must win.
    again = LitGPT(lr=0.5, seed=1)
    resumed = _trainer(rank, world, "shardwise")
    resumed.fit(again, train, val, ckpt_path=f"{root}/ckpts/epoch=0.ckpt")
    assert again.losses == lit.losses[4:]
    assert resumed.global_step == EPOCHS * 2 and resumed.current_epoch == EPOCHS
    assert {k: v.item() for k, v in resumed.callback_metrics.items()} == metrics
    assert resumed.lr_scheduler_configs[0].scheduler.get_last_lr() == \
        trainer.lr_scheduler_configs[0].scheduler.get_last_lr()
    if rank == 0:
        torch.save(full, f"{root}/final.pt")

    # validate/predict(ckpt_path=...) load the weights alone (no optimizer outside fit).
    out = _trainer(rank, world, "shardwise").validate(
        LitGPT(seed=1), val, ckpt_path=f"{root}/ckpts/epoch={EPOCHS - 1}.ckpt", verbose=False)
    assert out == val_ours
    predicted = _trainer(rank, world, "shardwise").predict(
        LitGPT(seed=1), val, ckpt_path=f"{root}/ckpts/epoch={EPOCHS - 1}.ckpt")
    ddp_predicted = _trainer(rank, world, "ddp").predict(ddp_lit, val)
    assert len(predicted) == len(ddp_predicted) == 1
    assert torch.equal(predicted[0], ddp_predicted[0])

    for precision in ("bf16-mixed", "16-mixed"):
        _mixed_precision(rank, world, train, precision)
    _manual_optimization(rank, world, train)
    return lit.losses


def _mixed_precision(rank, world, train, precision):
    """precision="bf16-mixed" ("16-mixed") is sw.MixedPrecision(param_dtype=bf16 (fp16))
    under Lightning's autocast (and gradient scaler), with fp32 master weights: exactly a
    hand-written loop doing that."""
    steps, dtype = 3, {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[precision]
    # On CPU Lightning turns precision="16-mixed" into bf16; its plugin, passed as such,
    # keeps fp16 and its GradScaler.
    flag = ({"precision": precision} if precision == "bf16-mixed"
            else {"plugins": [LightningMixedPrecision(precision, "cpu")]})
    lit = LitGPT()
    trainer = _trainer(rank, world, "shardwise", max_steps=steps, accumulate_grad_batches=1,
                       gradient_clip_val=None, **flag)
    trainer.fit(lit, train)
    gathers = sw.inspect(lit).comm.calls["all_gather"]

    def by_hand(mixed):
        torch.manual_seed(0)
        model = sw.shard(GPT(CFG), mixed_precision=mixed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.8 ** step)
        scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
        losses = []
        # Rank r's batches, as Lightning's DistributedSampler deals them in epoch 0: it
        # shuffles training data (seed 0 + epoch) and gives rank r every world-th index.
        order = torch.randperm(len(DATA), generator=torch.Generator().manual_seed(0))
        for i in range(steps):
            x = DATA[order[i * GLOBAL_BATCH:(i + 1) * GLOBAL_BATCH][rank::world]]
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x[:, :-1], x[:, 1:])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
            everyone = [torch.zeros(()) for _ in range(world)]
            torch.distributed.all_gather(everyone, loss.detach().float())
            losses.append(torch.stack(everyone).mean().item())
        return losses, sw.inspect(model).comm.calls["all_gather"]

    ref, ref_gathers = by_hand(sw.MixedPrecision(param_dtype=dtype))
    assert lit.losses == ref
    if precision == "bf16-mixed":
        assert lit.losses != by_hand(None)[0]  # the comparison tells autocast alone apart
    assert lit.emb_dtypes == {dtype}  # gathered for compute in the low dtype
    opt = trainer.optimizers[0]
    assert all(p.dtype == torch.float32 for p in lit.parameters())  # fp32 master weights
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    # As many all-gathers as the hand loop: a step calling self(...) inside the root's
    # forward neither gathers the root twice nor loses the prefetch order.
    assert gathers == ref_gathers


class ManualGPT(LitGPT):
    """Manual optimization: two forward-backward-step rounds in each training_step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for half in (batch[:1], batch[1:]):
            loss = self(half[:, :-1], half[:, 1:])
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            self.losses.append(self.all_gather(loss.detach()).mean().item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _manual_optimization(rank, world, train):
    """The second round's forward needs the root gathered again after the first round's
    backward resharded it: the step's calls of self(...) are root forwards then."""
    losses = {}
    for strategy in ("ddp", "shardwise"):
        lit = ManualGPT()
        # max_steps counts optimizer steps: two training steps of two rounds each.
        _trainer(rank, world, strategy, max_steps=4, accumulate_grad_batches=1,
                 gradient_clip_val=None).fit(lit, train)
        losses[strategy] = lit.losses
    assert len(losses["shardwise"]) == 4
    assert losses["shardwise"] == losses["ddp"]  # measured identical


CLIP, CLIP_STEPS = 0.1, 16  # the gradients' norm is 0.6 to 1.3 here: every step clips


class ClipGPT(LitGPT):
    """Records, at every step, the norm Lightning's clipping computes and the norm of the
    whole gradients taken as DDP takes it; with ``exact``, clips by the latter instead."""

    def __init__(self, exact: bool = False) -> None:
        super().__init__()
        self.exact = exact
        self.norms: list[tuple[float, float]] = []  # (Lightning's norm, whole gradients')

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        # What torch.nn.utils.clip_grad_norm_ computes, as Lightning calls it on the
        # optimizer's parameters (the same, in the same order): on DTensor gradients, each
        # parameter's norm from its ranks' row norms, then the norm of those norms.
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        # DDP's arithmetic: each whole gradient's norm, then the norm of those norms.
        whole = torch.nn.utils.get_total_norm(
            [g.full_tensor() if isinstance(g, DTensor) else g for g in grads])
        self.norms.append((norm.item(), whole.item()))
        if not self.exact:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        coef = torch.clamp(gradient_clip_val / (whole + 1e-6), max=1.0)  # torch's formula
        for g in grads:
            g.to_local().mul_(coef)

    def configure_optimizers(self):  # a constant rate: the drift is the optimizer's own
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def _clipping(rank, world):
    train, _ = _loaders(world)
    runs = {}
    for name, strategy, exact in (("ddp", "ddp", False), ("ours", "shardwise", False),
                                  ("exact", "shardwise", True)):
        lit = ClipGPT(exact)
        _trainer(rank, world, strategy, max_steps=CLIP_STEPS, max_epochs=-1,
                 accumulate_grad_batches=1,
                 gradient_clip_val=CLIP).fit(lit, train)
        runs[name] = lit
    ddp, ours, exact = runs["ddp"], runs["ours"], runs["exact"]
    assert len(ddp.losses) == len(ours.losses) == len(exact.losses) == CLIP_STEPS
    assert all(n == w > CLIP for n, w in ddp.norms)  # DDP's norm is the whole gradients'

    # Clipped by the norm of the whole gradients, the sharded run is DDP's bit for bit:
    # the gradients are DDP's, and the norm's rounding is the only difference.
    assert exact.losses == ddp.losses
    assert [w for _, w in exact.norms] == [n for n, _ in ddp.norms]
    full = sw.full_state_dict(exact, rank0_only=False)
    ddp_state = ddp.state_dict()
    assert full.keys() == ddp_state.keys()
    assert all(torch.equal(v, ddp_state[k]) for k, v in full.items())

    # Lightning's clipping on the sharded gradients: the same global norm up to rounding.
    # Measured: within 2.2e-7 relative of the whole gradients' norm (2 ulp), differing
    # in 4 of the 16 steps (24 of 64). 1e-6 leaves room for other CPUs' rounding; the
    # norm of a rank's own rows is off by 18% or more.
    for n, w in ours.norms:
        assert abs(n - w) <= 1e-6 * w, (n, w)
    # A clip factor off in its last bit moves the steps after it: measured, the losses
    # within 4.8e-7 (1 ulp of 4.2) of DDP's over the 16 steps (7.2e-6 over 32, 6.8e-5
    # over 64), as DDP's own drift with its norm moved up 1 ulp at every step (4.8e-7,
    # 6.7e-6, 6.4e-5): docs/lightning.md. 1e-4 is 200x the measured drift; clipping each
    # rank by its own rows' norm, or not clipping, moves the losses by 3.9e-4 and 4.5e-4
    # within 3 steps and by 1.6e-2 and 3.7e-2 within the 16.
    assert ours.losses[0] == ddp.losses[0]  # the same forward on the same weights
    drift = max(abs(a - b) for a, b in zip(ours.losses, ddp.losses))
    assert drift < 1e-4, (ours.losses, ddp.losses)
    return {"norms differing": sum(n != w for n, w in ours.norms),
            "max relative norm difference": max(abs(n - w) / w for n, w in ours.norms),
            "max loss difference": drift,
            "loss differences": [a - b for a, b in zip(ours.losses, ddp.losses)]}


def _resume(rank, world, root, uninterrupted):
    train, val = _loaders(world)
    lit = LitGPT(lr=0.5, seed=1)
    trainer = _trainer(rank, world, "shardwise")
    trainer.fit(lit, train, val, ckpt_path=f"{root}/ckpts/epoch=0.ckpt")
    assert trainer.global_step == EPOCHS * 2 and len(lit.losses) == 8
    # Another world size adds each step's gradients in another order (and, at 1 rank,
    # averages one batch of 6 instead of two of 3). Measured over the four optimizer
    # steps after the resume, at 1 and at 3 ranks alike: losses within 1.2e-7 relative,
    # weights within 1.2e-7 absolute of the uninterrupted 2-rank run. The bounds leave
    # ~100x for other CPUs; a resume without the optimizer's moments or the scheduler's
    # step would be off by more than the 4e-3 a loss moves per batch.
    assert lit.losses == pytest.approx(uninterrupted[4:], rel=1e-5, abs=0)
    saved = torch.load(f"{root}/final.pt")
    full = sw.full_state_dict(lit, rank0_only=False)
    assert full.keys() == saved.keys()
    for k, v in full.items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=1e-5, msg=k)
    return lit.losses


@pytest.mark.slow
def test_strategy_matches_ddp_and_resumes_at_other_world_sizes(tmp_path):
    losses = run_ranks(_two_ranks, 2, str(tmp_path), timeout=300)[0]
    for world in (1, 3):
        run_ranks(_resume, world, str(tmp_path), losses, timeout=300)


@pytest.mark.slow
def test_clipping_matches_ddp_up_to_the_norms_rounding():
    print(run_ranks(_clipping, 2, timeout=300)[0])


def test_checkpoint_state_round_trips_through_json():
    state = {"epoch": 2, "callbacks": {"ModelCheckpoint{'monitor': 'val_loss'}": {
        "best_model_score": torch.tensor(1.5), "kth_value": torch.tensor(float("inf")),
        "best_k_models": {"a.ckpt": torch.tensor(2.0, dtype=torch.float64)}}},
        "loops": {"shape": (3, 4), 7: [float("-inf"), None, True], "__shardwise__": "x"},
        "empty": torch.zeros(0, 3, dtype=torch.bfloat16)}
    encoded = _to_json(state, "checkpoint")
    back = _from_json(encoded)
    scores = back["callbacks"]["ModelCheckpoint{'monitor': 'val_loss'}"]
    assert scores["kth_value"].item() == float("inf")
    assert scores["best_k_models"]["a.ckpt"].dtype == torch.float64
    assert back["loops"] == {"shape": (3, 4), 7: [float("-inf"), None, True],
                             "__shardwise__": "x"}
    assert back["empty"].shape == (0, 3) and back["empty"].dtype == torch.bfloat16
    with pytest.raises(sw.ShardwiseError, match=r"checkpoint\['hyper_parameters'\]\['cfg'\]"):
        _to_json({"hyper_parameters": {"cfg": object()}}, "checkpoint")


@pytest.mark.slow
def test_registered_by_import_and_never_imported_by_shardwise():
    from lightning.pytorch.strategies import StrategyRegistry

    from shardwise.integrations import ShardwiseStrategy as lazily

    assert lazily is ShardwiseStrategy
    assert StrategyRegistry["shardwise"]["strategy"] is ShardwiseStrategy
    code = ("import sys, shardwise, shardwise.integrations; "
            "assert 'lightning' not in sys.modules, 'import shardwise imported lightning'")
    subprocess.run([sys.executable, "-c", code], check=True)
