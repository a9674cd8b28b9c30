"""``shardwise plan --mesh R,S``: its bytes per step within and across nodes against what
the engine counts under hybrid sharding (Note [hybrid sharding] in comm/mesh.py), and its
usage errors."""

import json
import os
import subprocess
import sys

import pytest
import torch
from harness import run_ranks

import shardwise as sw
from shardwise.cli import main
from shardwise.models import GPT, GPTConfig
from shardwise.planning.planner import comm_plan, mesh_plan

CFG = dict(vocab_size=96, seq_len=16, n_layer=3, n_head=2, d_model=32)

# One process plays rank 0 of 8 on torch's fake process group: collectives move nothing,
# but the engine counts every input as it would on a real mesh. Layouts: hybrid (2, 4),
# hybrid (4, 2) in bf16 compute, flat over 8; the step measured is the second (the first
# records the order the last unit's skipped gather depends on).
SIMULATED = """
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
import shardwise as sw
from shardwise.models import GPT, GPTConfig
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
cfg = GPTConfig(**json.loads(sys.argv[1]))
x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
out = {}
for name, shape, dtype in (("2,4", (2, 4), None), ("4,2 bf16", (4, 2), torch.bfloat16),
                           ("flat", None, None)):
    mesh = init_device_mesh("cpu", shape) if shape else None
    model = sw.shard(GPT(cfg), mesh=mesh, mixed_precision=sw.MixedPrecision(param_dtype=dtype))
    model(x, x).float().backward()
    before = sw.inspect(model)
    model(x, x).float().backward()
    after = sw.inspect(model)
    within = after.comm.since(before.comm).bytes
    across = after.comm_across.since(before.comm_across).bytes if shape else {}
    out[name] = [within["all_gather"], within["reduce_scatter"], across.get("all_reduce", 0),
                 sum(across.values())]
print(json.dumps(out))
"""


def _meta_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(**CFG))


@pytest.fixture(scope="module")
def measured() -> dict:
    out = subprocess.run([sys.executable, "-c", SIMULATED, json.dumps(CFG)],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _planned(c) -> list[int]:
    return [c.all_gather, c.reduce_scatter, c.all_reduce, c.all_reduce]


def test_comm_plan_equals_what_the_engine_counts_on_a_simulated_mesh(measured):
    model = _meta_gpt()
    assert _planned(comm_plan(model, 2, 4)) == measured["2,4"]
    assert _planned(comm_plan(model, 4, 2, torch.bfloat16)) == measured["4,2 bf16"]
    assert _planned(comm_plan(model, 1, 8)) == measured["flat"]
    # Across nodes only the gradient shards: P/S of fp32 bytes, up to padding (64-element
    # alignment: 12% of this tiny model).
    p_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert p_bytes / 4 <= measured["2,4"][2] <= p_bytes / 4 * 1.25


def test_plan_command_with_a_mesh_reports_the_engines_bytes(measured, capsys):
    args = ["plan", "--model", "shardwise.models:gpt", "--kwargs", json.dumps(CFG),
            "--mesh", "2,4", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    comm, flat = report["comm"], report["flat"]
    ag, rs, ar, _ = measured["2,4"]
    assert (comm["all_gather"], comm["reduce_scatter"], comm["all_reduce"]) == (ag, rs, ar)
    assert comm["across_wire"] == ar  # a ring all-reduce over R=2 sends 2(R-1)/R = 1x
    assert (flat["comm"]["all_gather"], flat["comm"]["reduce_scatter"]) == \
        tuple(measured["flat"][:2])
    assert (report["mesh"], report["world_size"], flat["world_size"]) == ([2, 4], 4, 8)
    # Memory per rank is the plan over the shard group.
    assert main(args[:-3] + ["--world", "4", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert {k: report[k] for k in alone} == alone
    # The table says the same, in MiB; --world may be given if it is R*S.
    assert main(args[:-1] + ["--world", "8"]) == 0
    table = capsys.readouterr().out
    assert "mesh (2, 4) = 8 ranks, sharded over 4" in table
    row = next(line for line in table.splitlines() if "all-reduce across replicas" in line)
    assert row.split()[3:] == [f"{ar / 2**20:.1f}", "MiB", "0.0", "MiB"], row


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "2"], "expected R,S"),
    (["--mesh", "2,0"], "at least 1"),
    (["--mesh", "a,4"], "whole number"),
    (["--mesh", "2,4,1"], "expected R,S"),
    (["--mesh", "2,4", "--world", "6"], "--world 6 does not match --mesh 2,4"),
    ([], "give --world N, or --mesh R,S"),
])
def test_plan_mesh_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--params", "1e9", "--layers", "8", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_by_size_on_a_mesh():
    # 8 equal blocks of 1e9/8: the last is gathered once, the rest twice.
    assert main(["plan", "--params", "1e9", "--layers", "8", "--mesh", "16,8"]) == 0
    gpt = mesh_plan(_meta_gpt(), 16, 8)
    assert gpt.comm.world_size == gpt.flat_comm.world_size == 128
    assert gpt.flat_memory.parameters < gpt.memory.parameters


def _real(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    model = sw.shard(GPT(GPTConfig(**CFG)), mesh=mesh)
    x = torch.randint(0, CFG["vocab_size"], (2, CFG["seq_len"]))
    model(x, x).backward()
    before = sw.inspect(model)
    model(x, x).backward()
    after = sw.inspect(model)
    within = after.comm.since(before.comm)
    across = after.comm_across.since(before.comm_across)
    return (within.bytes["all_gather"], within.bytes["reduce_scatter"],
            across.bytes["all_reduce"])


def test_comm_plan_equals_the_engine_on_four_gloo_ranks():  # about 2 s
    planned = comm_plan(_meta_gpt(), 2, 2)
    for ag, rs, ar in run_ranks(_real, 4, timeout=120):
        assert (ag, rs, ar) == (planned.all_gather, planned.reduce_scatter,
                                planned.all_reduce)


@pytest.mark.parametrize("argv, message", [
    (["--params", "7e9", "--layers", "1000000000000", "--world", "8"], "more than 1,000,000"),
    (["--params", "100", "--layers", "1000", "--world", "2"], "exceeds --params 100"),
])
def test_plan_refuses_sizes_no_model_has(argv, message, capsys):
    """Issue 31 item 8: --layers 10**12 was accepted (and the plan walked its layers)."""
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_consolidate_into_a_symlink_loop_is_a_usage_error(tmp_path, capsys):
    """Issue 31 item 8: it said [Errno 17] File exists."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(SystemExit) as e:
        main(["consolidate", str(tmp_path / "no-checkpoint"), str(loop)])
    assert e.value.code == 2
    assert "symbolic link that leads nowhere" in capsys.readouterr().err


GPT_TP = {"*.qkv": "colwise", "*.proj": "rowwise", "*.fc": "colwise", "*.out": "rowwise"}


def test_plan_with_tensor_parallelism(capsys):
    """``--tp T`` (Note [planning tensor parallelism] in planning/tensor_parallel.py):
    the plan of the model whose tp-split modules hold one tp rank's local tensors,
    sharded over the dp ranks (world / T, or the mesh's R*S). Exact against the engine
    at (dp, tp) = (2, 2) in tests/test_tensor_parallel_checkpoint.py."""
    from shardwise.planning.planner import plan
    from shardwise.planning.tensor_parallel import split_for_tp

    base = ["plan", "--model", "shardwise.models:gpt", "--kwargs", json.dumps(CFG)]
    assert main([*base, "--world", "8", "--tp", "2", "--tp-plan", json.dumps(GPT_TP),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = _meta_gpt()
    split = split_for_tp(model, 2, GPT_TP)
    assert report["tp"] == split.as_dict() and report["world_size"] == 4
    assert report["parameters"] == plan(model, 4).parameters
    assert split.modules == {"colwise": ["blocks.0.qkv", "blocks.0.fc", "blocks.1.qkv",
                                         "blocks.1.fc", "blocks.2.qkv", "blocks.2.fc"],
                             "rowwise": ["blocks.0.proj", "blocks.0.out", "blocks.1.proj",
                                         "blocks.1.out", "blocks.2.proj", "blocks.2.out"]}
    # With a mesh: R*S dp ranks beside T tp ranks; the table says so.
    assert main([*base, "--mesh", "2,2", "--world", "8", "--tp", "2", "--tp-plan",
                 json.dumps(GPT_TP)]) == 0
    assert "tensor parallel: 4 dp x 2 tp = 8 ranks; 6 colwise and 6 rowwise" in \
        capsys.readouterr().out
    # A rule that names none of the model's modules, or a module tp cannot split.
    assert main([*base, "--world", "4", "--tp", "2"]) == 1
    assert "no module of the model matches the tp rule" in capsys.readouterr().err
    assert main([*base, "--world", "4", "--tp", "2", "--tp-plan", '{"*.ln1": "colwise"}']) == 1
    assert "not LayerNorm" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--world", "8", "--tp", "3"], "--tp 3 does not divide --world 8"),
    (["--mesh", "2,2", "--world", "4", "--tp", "2"], "--world 4 does not match --mesh 2,2 x"),
    (["--world", "8", "--tp-plan", '{"*.q": "colwise"}'], "give --tp too"),
    (["--world", "8", "--tp", "2", "--tp-plan", '{"*.q": "sideways"}'], "expected {"),
])
def test_plan_tp_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--params", "1e9", "--layers", "8", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_plan_tp_needs_a_model(capsys):
    assert main(["plan", "--params", "1e9", "--layers", "8", "--world", "8", "--tp", "2"]) == 1
    assert "--tp needs --model" in capsys.readouterr().err
