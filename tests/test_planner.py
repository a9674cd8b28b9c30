"""The memory plan against what the engine allocates, at real and simulated world sizes."""

import json
import os
import subprocess
import sys

import pytest
import torch
from harness import run_ranks

import shardwise as sw
from shardwise.models import GPT, GPTConfig
from shardwise.planning.memory import state_bytes
from shardwise.planning.planner import plan

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layer=3, n_head=2, d_model=32)


def _measured(rank, world):
    with torch.device("meta"):
        planned = plan(GPT(CFG), world)  # no communication, no memory
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    model(x, x).backward()
    opt.step()
    return planned, state_bytes(model, opt)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_equals_what_the_engine_allocates(world):
    planned, got = run_ranks(_measured, world)[0]  # rank 0 holds the most rows
    assert (planned.parameters, planned.gradients, planned.optimizer) == \
        (got["params"], got["grads"], got["optimizer"])


SIMULATED = """
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import shardwise as sw
from shardwise.planning.memory import state_bytes
from shardwise.models import GPT, GPTConfig
from shardwise.planning.planner import plan
world = int(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
cfg = GPTConfig(vocab_size=96, seq_len=16, n_layer=3, n_head=2, d_model=32)
with torch.device("meta"):
    planned = plan(GPT(cfg), world)
model = sw.shard(GPT(cfg))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randint(0, 96, (2, 16))
model(x, x).backward()
opt.step()
got = state_bytes(model, opt)
print(json.dumps([planned.parameters, planned.gradients, planned.optimizer,
                  got["params"], got["grads"], got["optimizer"]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("world", [8, 64])
def test_plan_equals_the_engine_on_a_simulated_world(world):
    # torch's fake process group: collectives do nothing, shapes are real.
    out = subprocess.run([sys.executable, "-c", SIMULATED, str(world)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    values = json.loads(out.stdout.strip().splitlines()[-1])
    assert values[:3] == values[3:], values


@pytest.mark.slow
def test_plan_command_prints_a_table_and_json():
    cmd = [sys.executable, "-m", "shardwise.cli", "plan", "--world", "4"]
    table = subprocess.run(cmd + ["--params", "7e9", "--layers", "32"], capture_output=True,
                           text=True, check=True).stdout
    assert "optimizer state (shard)" in table and "world size 4" in table
    out = subprocess.run(cmd + ["--model", "shardwise.models:gpt", "--kwargs",
                                json.dumps({"n_layer": 3, "d_model": 32, "n_head": 2,
                                            "vocab_size": 96, "seq_len": 16}), "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["units"] == 4
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 1 and "--params and --layers" in bad.stderr


@pytest.mark.parametrize("argv, message", [
    ("plan --world 0 --params 1e6 --layers 2", "--world: must be at least 1, got 0"),
    ("plan --world -2 --params 1e6 --layers 2", "--world: must be at least 1, got -2"),
    ("plan --world 2 --params nan --layers 2", "--params: must be a finite number more"),
    ("plan --world 2 --params -5 --layers 2", "--params: must be a finite number more"),
    ("plan --world 2 --params 1e6 --layers 2 --activation-gib -3",
     "--activation-gib: must be a finite number at least 0"),
    ("plan --world 2 --params 1e6 --layers 2 --param-dtype nosuch",
     "'nosuch' is not a floating-point torch dtype"),
    ("consolidate CK out --max-shard-gb nan", "--max-shard-gb: must be a finite number more"),
    ("consolidate CK out --max-shard-gb 0", "--max-shard-gb: must be a finite number more"),
    ("consolidate CK CK", "is the checkpoint folder itself"),
    ("consolidate CK CK/", "is the checkpoint folder itself"),
    ("consolidate CK CK/checkpoint.json", "would overwrite the checkpoint's own "
                                          "checkpoint.json"),
    ("consolidate CK CK/data-0123/x.safetensors", "would overwrite the checkpoint's own "
                                                  "data-0123"),
    ("plan --world 2 --model shardwise.models:gpt --params 1e6",
     "--model and --params/--layers are two descriptions of the model"),
    ("plan --world 2 --model shardwise.models:gpt --layers 2", "give --model alone"),
    ("plan --world 2 --params 1e6 --layers 2 --kwargs {}", "--kwargs are the arguments of "
                                                           "--model's callable"),
])
def test_bad_command_lines_are_one_line_usage_errors(argv, message, tmp_path, capsys,
                                                     monkeypatch):
    """Each was a traceback, or a plan with negative bytes, or an export written into the
    checkpoint folder before."""
    from shardwise.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "CK").mkdir()
    with pytest.raises(SystemExit) as exit_:
        main(argv.split())
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert os.listdir(tmp_path / "CK") == []


def test_offload_tiers_are_read_and_refused_in_the_command_line_s_words(capsys):
    """Issue 51 item 6: `--offload None,cpu` was refused by a message offering None (the
    device, in Python) as the fix."""
    from shardwise.cli import main

    plan_gpt = ["plan", "--world", "2", "--model", "shardwise.models:gpt", "--kwargs",
                '{"n_layer": 1, "d_model": 32, "n_head": 2}', "--json", "--offload"]
    for spelled in ("None,cpu", "device,CPU", " none , cpu"):
        assert main([*plan_gpt, spelled]) == 0
        assert json.loads(capsys.readouterr().out)["offload"] == "params device, optimizer cpu"
    for bad, said in (("gpu,cpu", "'gpu' is not a tier; each of PARAMS,OPTIMIZER is device, "
                                  "cpu or disk"),
                      ("cpu", "expected PARAMS,OPTIMIZER; each of"),
                      ("disk,cpu", "offload the optimizer at least as far (disk,disk)")):
        with pytest.raises(SystemExit):
            main([*plan_gpt, bad])
        err = capsys.readouterr().err
        assert said in err and "None" not in err, err


def test_a_callable_that_builds_no_module_is_a_one_line_error(capsys):
    from shardwise.cli import main

    assert main(["plan", "--world", "2", "--model", "os:getcwd"]) == 1
    assert "'os:getcwd' built a str, not a torch.nn.Module" in capsys.readouterr().err


def test_a_model_of_negative_size_is_a_one_line_error(capsys):
    """Issue 41 item 10: n_layer=-1 built a GPT of no blocks, and the plan was printed."""
    from shardwise.cli import main

    assert main(["plan", "--world", "2", "--model", "shardwise.models:gpt", "--kwargs",
                 '{"n_layer": -1}']) == 1
    err = capsys.readouterr().err
    assert "GPTConfig: n_layer=-1: must be a positive int" in err and "Traceback" not in err


@pytest.mark.parametrize("output, said", [
    ("out", "the output 'out' already exists, as a file: an output without the "
            ".safetensors suffix (or ending in /) is written as a folder"),
    ("out/", "the output 'out/' already exists, as a file"),
    ("out/model.safetensors", "'out', in its path, is a file, not a folder"),
    ("out/a/b", "'out', in its path, is a file, not a folder"),
])
def test_consolidate_onto_a_file_says_so(output, said, tmp_path, capsys, monkeypatch):
    """Issue 51 item 6: `shardwise consolidate CK out` with a file named out printed
    "[Errno 17] File exists", with or without --force; the file is left alone."""
    from shardwise.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "CK").mkdir()
    (tmp_path / "out").write_text("mine")
    for force in ([], ["--force"]):
        with pytest.raises(SystemExit) as exit_:
            main(["consolidate", "CK", output, *force])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert said in err.replace(str(tmp_path) + os.sep, "") and "Errno" not in err, err
    with pytest.raises(sw.ShardwiseError, match="in its path|already exists, as a file"):
        sw.checkpoint.consolidate("CK", output)
    assert (tmp_path / "out").read_text() == "mine"


def test_consolidate_refuses_existing_weights_unless_forced(tmp_path, capsys):
    """Issue 41 item 10: an export replaced an existing file without a word."""
    import torch.nn as nn
    from safetensors.torch import load_file

    from shardwise.cli import main

    ck, out, folder = (str(tmp_path / n) for n in ("ck", "out.safetensors", "export"))
    model = nn.Linear(2, 2)
    sw.save_checkpoint(ck, model)
    open(out, "w").write("old")
    os.makedirs(folder)
    open(os.path.join(folder, "model.safetensors"), "w").write("old")
    open(os.path.join(folder, "tokenizer.json"), "w").write("{}")  # not weights: allowed
    for target in (out, folder):
        with pytest.raises(SystemExit) as exit_:
            main(["consolidate", ck, target])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "already exists; pass --force to replace it" in err, err
    assert open(out).read() == "old"
    for target, written in ((out, out), (folder, os.path.join(folder, "model.safetensors"))):
        assert main(["consolidate", ck, target, "--force", "--no-progress"]) == 0
        got = load_file(written)
        assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    with pytest.raises(sw.ShardwiseError, match="already exists"):  # the function's option
        sw.checkpoint.consolidate(ck, out, overwrite=False)


def _tiny_llama(folder):
    from transformers import LlamaConfig

    # A published config names its weights' dtype (float16 for Llama 2): the model the
    # docs build from it, LlamaForCausalLM(config), is float32 all the same.
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                dtype="float16").save_pretrained(folder)


def _built_as_the_docs_do(rank, world, folder):
    from transformers import AutoConfig, LlamaForCausalLM

    from shardwise.planning.planner import build_on_meta

    planned = plan(build_on_meta(folder), world)
    with sw.sharded_init():
        model = LlamaForCausalLM(AutoConfig.from_pretrained(folder))
    model = sw.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return planned, state_bytes(model, opt)


def test_a_config_folder_is_planned_as_the_docs_build_it(tmp_path, capsys):
    """Issue 51 item 4: a config saying float16 was planned in float16, half the bytes
    of the float32 model LlamaForCausalLM(config) builds under sw.sharded_init()."""
    from shardwise.cli import main

    folder = str(tmp_path / "llama")
    _tiny_llama(folder)
    planned, got = run_ranks(_built_as_the_docs_do, 2, folder)[0]
    assert (planned.parameters, planned.gradients, planned.optimizer) == \
        (got["params"], got["grads"], got["optimizer"])
    assert main(["plan", "--model", folder, "--world", "2", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert (cli["parameters"], cli["optimizer"], cli["dtype"]) == \
        (got["params"], got["optimizer"], "float32")
    # The dtype assumed is printed; --dtype plans a cast model, --param-dtype the gathers.
    assert main(["plan", "--model", folder, "--world", "2", "--param-dtype", "bfloat16"]) == 0
    assert "parameters stored in float32, gathered in bfloat16" in capsys.readouterr().out
    assert main(["plan", "--model", folder, "--world", "2", "--dtype", "bfloat16",
                 "--json"]) == 0
    half = json.loads(capsys.readouterr().out)
    assert half["dtype"] == "bfloat16" and 2 * half["parameters"] == cli["parameters"]


def test_a_command_s_first_lines_are_its_own(tmp_path):
    """Issue 51 item 7: `shardwise plan --model <config folder>` began with torchao's
    "Failed to load ..." lines and torch's pytree deprecations (transformers imports
    torchao when it is installed)."""
    folder = str(tmp_path / "llama")
    _tiny_llama(folder)
    env = {k: v for k, v in os.environ.items() if k != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"}
    env["OMP_NUM_THREADS"] = "1"
    for args, first in ((["--help"], "usage: shardwise"),
                        (["plan", "--model", folder, "--world", "2"], "per rank, world size 2")):
        out = subprocess.run([sys.executable, "-m", "shardwise.cli", *args], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout.startswith(first), out.stdout[:2000]


def test_a_model_path_that_is_no_config_folder_says_what_it_is(tmp_path, capsys):
    """Issue 51 item 6: a symbolic link loop was taken for a Hub id ("Repo id must be in
    the form ...")."""
    from shardwise.cli import main

    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    (tmp_path / "file").write_text("{}")
    (tmp_path / "empty").mkdir()
    for path, said in ((loop, "is a symbolic link that cannot be followed"),
                       (tmp_path / "file", "is a file; give the folder holding"),
                       (tmp_path / "empty", "holds no config.json"),
                       (tmp_path / "nosuch", "no such folder")):
        assert main(["plan", "--world", "2", "--model", str(path)]) == 1
        err = capsys.readouterr().err
        assert said in err and "Repo id" not in err and "Traceback" not in err, err
