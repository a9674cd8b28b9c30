"""The ``shardwise`` logger: rank 0 only, quiet by default, informative at INFO."""

import logging

import torch
from harness import LogCollector, run_ranks

import shardwise as sw
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)


def _logs(rank, world):
    log = logging.getLogger("shardwise")
    collect = LogCollector()
    log.addHandler(collect)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    sw.shard(GPT(CFG))(x, x).backward()
    quiet = list(collect.messages)  # default level: WARNING
    log.setLevel(logging.INFO)  # what SHARDWISE_LOG=info sets
    sw.shard(GPT(CFG))(x, x).backward()
    return quiet, collect.messages


def test_logs_speak_on_rank_0_only_and_only_when_asked():
    (quiet0, info0), (quiet1, info1) = run_ranks(_logs, 2)
    assert quiet0 == [] and quiet1 == []
    assert info1 == []
    assert any("sharded" in m and "3 units" in m for m in info0), info0
    assert any("unit blocks.0" in m for m in info0)
    assert any(m.startswith("step communication: all_gather") for m in info0)
