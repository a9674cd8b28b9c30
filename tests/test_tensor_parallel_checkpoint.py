"""Checkpoints of tensor-parallel models (issue 53 item 1): saved at (dp, tp) = (2, 2),
loaded at (2, 2), (4, 1) and (1, 2) and without sharding, and continued; a checkpoint
saved without tensor parallelism loaded at (2, 2) (Note [tensor-parallel checkpoints] in
checkpoint/_tensor_parallel.py).

Every continuation sees the same global batch per step, split over the dp ranks (equal
parts, so the mean of the dp ranks' mean losses is the global mean), so that each is the
same computation as the unsharded one, up to the order of its sums. Two spawned groups
in all: every rank costs a torch import.
"""

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from safetensors.torch import load_file
from test_tensor_parallel import SEQ, VOCAB, Llama, tensor_parallel
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import shardwise as sw
from shardwise.checkpoint._tensor_parallel import TpPlace
from shardwise.checkpoint.consolidation import consolidate
from shardwise.engine.groups.tensor_parallel import TpSpec
from shardwise.planning.memory import state_bytes
from shardwise.planning.planner import comm_plan, plan
from shardwise.planning.tensor_parallel import split_for_tp

GLOBAL_BATCH = 4
SAVED_AT = 3  # steps before the save
AFTER = 3     # steps after it


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _steps(model, opt, first: int, count: int, dp_rank: int = 0, dp: int = 1,
           dp_group=None) -> list[float]:
    """``count`` AdamW steps from step ``first``; the global mean loss of each."""
    losses = []
    for step in range(first, first + count):
        x, y = _global_batch(step)
        n = GLOBAL_BATCH // dp
        x, y = x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(mean, group=dp_group)
            mean /= dp
        losses.append(float(mean))
    return losses


def _tp_model(mesh, seed: int, sequence_parallel: bool = True):
    torch.manual_seed(seed)
    model = sw.shard(tensor_parallel(Llama(), mesh["tp"], sequence_parallel), mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _state(model, opt) -> tuple[dict, dict]:
    """The full parameters and the full optimizer state, keyed by parameter name."""
    names = [n for n, _ in model.named_parameters()]
    if sw.is_sharded(model):
        osd = sw.full_optimizer_state_dict(model, opt, rank0_only=False)
    else:
        osd = opt.state_dict()
    states = {f"{names[i]}.{k}": v.detach().clone() for i, st in osd["state"].items()
              for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if sw.is_sharded(model):
        return sw.full_state_dict(model, rank0_only=False), states
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, states


def _diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _at_four(rank: int, world: int, folder: str, sequence_parallel: bool):
    """Save at (2, 2); resume at (2, 2), (4, 1) and unsharded; a checkpoint of the model
    sharded at dp = 4 without tp, and one of hybrid sharding with tp, (replicate, shard,
    tp) = (2, 1, 2), each loaded at (2, 2)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    out: dict = {}

    # Trained at (2, 2), saved (and in the background), then on without interruption.
    model, opt = _tp_model(mesh, 0, sequence_parallel)
    _steps(model, opt, 0, SAVED_AT, dp_rank, 2, dp_group)
    out["saved"] = saved = _state(model, opt)
    out["state bytes"] = state_bytes(model, opt)  # what `shardwise plan --tp` plans
    full_osd = sw.full_optimizer_state_dict(model, opt, rank0_only=False)
    sw.save_checkpoint(f"{folder}/tp", model, opt, extra={"step": SAVED_AT})
    background = sw.save_checkpoint(f"{folder}/background", model, opt, background=True)
    before = sw.inspect(model)
    out["uninterrupted"] = _steps(model, opt, SAVED_AT, AFTER, dp_rank, 2, dp_group)
    out["dp bytes"] = sw.inspect(model).comm.since(before.comm).bytes
    background.wait()  # written while the model trained on
    out["uninterrupted_state"] = _state(model, opt)

    def resume(name: str, model, opt, dp_rank: int, dp: int, group) -> None:
        """``model`` and ``opt`` as loaded (against the saved state) and continued."""
        out[f"{name} loaded"] = _state(model, opt)
        out[name] = _steps(model, opt, SAVED_AT, AFTER, dp_rank, dp, group)
        out[f"{name}_state"] = _state(model, opt)

    # At (2, 2) again, from either save, into models initialised otherwise.
    model, opt = _tp_model(mesh, 1, sequence_parallel)
    out["extra"] = sw.load_checkpoint(f"{folder}/tp", model, opt)
    resume("2x2", model, opt, dp_rank, 2, dp_group)
    model, opt = _tp_model(mesh, 1, sequence_parallel)
    sw.load_checkpoint(f"{folder}/background", model, opt)
    resume("2x2 background", model, opt, dp_rank, 2, dp_group)
    # The same state through load_pretrained and a full optimizer state dict.
    model, opt = _tp_model(mesh, 1, sequence_parallel)
    nan = {k: v.clone() for k, v in saved[0].items()}
    nan["blocks.0.attn.o.weight"][0] = float("nan")  # one row: half on each tp rank
    with pytest.raises(sw.ShardwiseError, match=r"'blocks.0.attn.o.weight' \(16 of its 256"):
        sw.load_pretrained(model, nan)
    sw.load_pretrained(model, saved[0])
    opt.load_state_dict(full_osd)
    resume("2x2 pretrained", model, opt, dp_rank, 2, dp_group)

    # At (4, 1): sharded over the 4 ranks, without tensor parallelism.
    torch.manual_seed(1)
    model = sw.shard(Llama())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sw.load_checkpoint(f"{folder}/tp", model, opt)
    resume("4x1", model, opt, rank, 4, None)

    # Unsharded (every rank alike, no collective): the reference continuation.
    torch.manual_seed(1)
    plain = Llama()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    sw.load_checkpoint(f"{folder}/tp", plain, opt)
    resume("plain", plain, opt, 0, 1, None)

    # The checkpoint read without a model: consolidated, it is the full state dict.
    if rank == 0:
        consolidate(f"{folder}/tp", f"{folder}/consolidated.safetensors", progress=False)
        out["consolidated"] = _diff(load_file(f"{folder}/consolidated.safetensors"), saved[0])
        with open(f"{folder}/tp/checkpoint.json") as f:
            out["world_size"] = json.load(f)["world_size"]

    # Saved without tensor parallelism (dp = 4), loaded at (2, 2).
    torch.manual_seed(2)
    flat = sw.shard(Llama())
    opt = torch.optim.AdamW(flat.parameters(), lr=1e-2)
    _steps(flat, opt, 0, SAVED_AT, rank, 4, None)
    out["flat saved"] = _state(flat, opt)
    sw.save_checkpoint(f"{folder}/flat", flat, opt)
    model, opt = _tp_model(mesh, 1, sequence_parallel)
    sw.load_checkpoint(f"{folder}/flat", model, opt)
    out["flat at 2x2 loaded"] = _state(model, opt)

    # Hybrid sharding with tp, (replicate, shard, tp) = (2, 1, 2): replica 0 saves.
    hsdp = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    torch.manual_seed(3)
    model = sw.shard(tensor_parallel(Llama(), hsdp["tp"], sequence_parallel),
                     mesh=hsdp["replicate", "shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, 0, SAVED_AT, hsdp["replicate"].get_local_rank(), 2,
           hsdp["replicate"].get_group())
    out["hybrid saved"] = _state(model, opt)
    sw.save_checkpoint(f"{folder}/hybrid", model, opt)
    model, opt = _tp_model(mesh, 1, sequence_parallel)
    sw.load_checkpoint(f"{folder}/hybrid", model, opt)
    out["hybrid at 2x2 loaded"] = _state(model, opt)
    return out


def _at_two(rank: int, world: int, folder: str, sequence_parallel: bool):
    """The (2, 2) checkpoint loaded at (1, 2) and continued; and sw.Resumable at (1, 2),
    stopped after its save at step 2 and resumed by a new one."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model, opt = _tp_model(mesh, 1, sequence_parallel)
    sw.load_checkpoint(f"{folder}/tp", model, opt)
    out = _state(model, opt), _steps(model, opt, SAVED_AT, AFTER), _state(model, opt)
    runs = []
    for total in (2, 4):
        model, opt = _tp_model(mesh, 0, sequence_parallel)
        with sw.Resumable(f"{folder}/run", model, opt, every=2) as run:
            start = run.step
            for step in run.steps(total):
                _steps(model, opt, step, 1)
        runs.append((start, _state(model, opt)))
    model, opt = _tp_model(mesh, 0, sequence_parallel)
    _steps(model, opt, 0, 4)
    assert [start for start, _ in runs] == [0, 2]
    assert _diff(runs[1][1][0], _state(model, opt)[0]) == 0.0
    assert _diff(runs[1][1][1], _state(model, opt)[1]) == 0.0
    return out


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_a_checkpoint_at_2x2_loads_at_2x2_4x1_1x2_and_unsharded(tmp_path, sequence_parallel):
    """Saved at (2, 2) (with sequence-parallel norms: every parameter a DTensor, tp
    shards dims 0 and 1 and replicates the norms; without them, the embedding, norms and
    head are parameters tp leaves alone), loaded at (2, 2), (4, 1), (1, 2) and into an
    unsharded model, and continued three steps on the same global batches.

    Every load gives the saved parameters and AdamW state bit for bit, and so do
    load_pretrained with a full optimizer state dict, the background save, a checkpoint
    of dp = 4 without tp and one of hybrid sharding with tp, each loaded at (2, 2); the
    consolidated checkpoint is the full state dict. At (2, 2) the continuation is
    bit-equal to the uninterrupted run. At the other layouts each step sums in another
    order (the dp sum over 4, 2 or 1 ranks; tp's partial sums, or none): measured against
    the unsharded continuation, losses within 2.4e-7 (1 ulp of values near 3.6),
    parameters within 2.4e-7 (2 ulps near 1), AdamW moments within 3.7e-9. The bounds,
    1e-6, 1e-6 and 1.5e-8, are about 4x those, far below the ~1e-2 a wrong row would move
    a parameter by in one step of lr=1e-2. (At (1, 2) the losses were the unsharded
    ones, bit for bit.)"""
    folder = str(tmp_path)
    runs = run_ranks(_at_four, 4, folder, sequence_parallel, timeout=300)
    (loaded, losses, state), *_ = run_ranks(_at_two, 2, folder, sequence_parallel,
                                            timeout=300)
    r = runs[0]
    assert r["world_size"] == 4 and r["consolidated"] == 0.0
    assert all(out["extra"] == {"step": SAVED_AT} for out in runs)
    r["1x2 loaded"], r["1x2"], r["1x2_state"] = loaded, losses, state
    for out in runs:
        for name in ("2x2", "2x2 background", "2x2 pretrained", "4x1", "plain"):
            assert _diff(out[f"{name} loaded"][0], r["saved"][0]) == 0.0, name
            assert _diff(out[f"{name} loaded"][1], r["saved"][1]) == 0.0, name
        for name in ("flat", "hybrid"):
            assert _diff(out[f"{name} at 2x2 loaded"][0], out[f"{name} saved"][0]) == 0.0
            assert _diff(out[f"{name} at 2x2 loaded"][1], out[f"{name} saved"][1]) == 0.0
        for name in ("2x2", "2x2 background", "2x2 pretrained"):
            assert out[name] == r["uninterrupted"], name
            assert _diff(out[f"{name}_state"][0], r["uninterrupted_state"][0]) == 0.0
            assert _diff(out[f"{name}_state"][1], r["uninterrupted_state"][1]) == 0.0
    _check_plan(sequence_parallel, r["state bytes"], r["dp bytes"])
    assert _diff(r["1x2 loaded"][0], r["saved"][0]) == 0.0
    assert _diff(r["1x2 loaded"][1], r["saved"][1]) == 0.0
    plain = r["plain_state"]
    for name in ("uninterrupted", "4x1", "1x2"):
        assert max(abs(a - b) for a, b in zip(r[name], r["plain"])) <= 1e-6, name
        assert _diff(r[f"{name}_state"][0], plain[0]) <= 1e-6, name
        assert _diff(r[f"{name}_state"][1], plain[1]) <= 1.5e-8, name


def _check_plan(sequence_parallel: bool, measured: dict, dp_bytes: dict) -> None:
    """``shardwise plan --tp 2`` (Note [planning tensor parallelism] in
    planning/tensor_parallel.py) of the model planned at (2, 2): the bytes rank 0 holds
    and feeds into the dp collectives, exactly as the engine counted them over the
    three steps after the save (each a forward and a backward)."""
    rules = {f"blocks.*.{m}": "colwise" for m in ("attn.q", "attn.k", "attn.v", "mlp.gate",
                                                  "mlp.up")}
    rules.update({"blocks.*.attn.o": "rowwise", "blocks.*.mlp.down": "rowwise"})
    if sequence_parallel:
        rules.update({"embed": "rowwise", "head": "colwise"})
    with torch.device("meta"):
        model = Llama()
    split = split_for_tp(model, 2, rules)
    assert len(split.modules["colwise"]) == 10 + sequence_parallel
    planned = plan(model, 2)
    # (Measured after zero_grad: the gradient shards, freed, are the parameters' bytes.)
    assert (planned.parameters, planned.gradients, planned.optimizer) == \
        (measured["params"], measured["params"], measured["optimizer"])
    c = comm_plan(model, 1, 2)
    assert (AFTER * c.all_gather, AFTER * c.reduce_scatter) == \
        (dp_bytes["all_gather"], dp_bytes["reduce_scatter"])


@pytest.mark.parametrize("shape,placement,tp,dp", [
    ((6, 4), Shard(0), 2, 4),      # rows 3 per tp rank over 4 dp ranks: one without rows
    ((5, 6), Shard(1), 3, 2),      # uneven dp rows (3 and 2) of a dim-1 shard
    ((5, 6), Shard(1), 2, 8),      # more dp ranks than rows
    ((3, 4, 6), Shard(2), 2, 2),   # a 3-D parameter sharded on its last dim
    ((7,), Shard(0), 1, 3),        # a 1-D one, tp of one
    ((7, 3), Replicate(), 2, 3),   # replicated over tp
    ((7, 3), None, 3, 2),          # a parameter tp leaves alone
])
def test_the_pieces_tile_the_global_tensor_and_each_rank_reads_its_rows(shape, placement,
                                                                         tp, dp):
    """Note [tensor-parallel checkpoints], without processes: for every rank (dp, tp)
    of a layout, the ranges the ranks save tile the global tensor exactly, the ones saved
    without an exchange are those elements of the global tensor, and each rank reads
    exactly its local rows back from the global tensor. (The exchange over tp of a
    dim other than 0 runs in the spawned tests above.)"""
    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    spec = None if placement is None else TpSpec(
        "w", None, (placement,), torch.Size(shape), full.stride())  # type: ignore[arg-type]
    spans = []
    for k in range(tp):
        local = full.chunk(tp, placement.dim)[k] if isinstance(placement, Shard) else full
        rows, row = -(-local.shape[0] // dp), math.prod(local.shape[1:])  # Note [row sharding]
        for d in range(dp):
            place = TpPlace(tp, k, spec, tuple(local.shape))
            mine = local[d * rows:(d + 1) * rows].reshape(-1)
            lo, n = min(d * rows, local.shape[0]) * row, mine.numel()
            off, count = place.saved_range(lo, n)
            spans.append((off, count))
            if place.dim in (None, 0):
                assert torch.equal(place.saved_values(mine, lo, n),
                                   full.reshape(-1)[off:off + count])
            got = place.read_local(lambda a, m: full.reshape(-1)[a:a + m].clone(), lo, n)
            assert torch.equal(got, mine), (k, d)
    cursor = 0
    for off, count in sorted(s for s in spans if s[1]):
        assert off == cursor
        cursor += count
    assert cursor == full.numel()
