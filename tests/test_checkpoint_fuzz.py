"""Mutated checkpoint metadata: a correct load, or one ShardwiseError on every rank with
the model and optimizer exactly as before. Never a silent wrong load, never a hang.

Hypothesis generates the mutations inside each rank, derandomized and without shrinking,
so both ranks draw the same mutations in the same order. Half of the mutated files get a
recomputed ``meta_sha256`` (a writer that lies consistently), so the schema checks behind
the checksum are exercised too.
"""

import json
import os
import re
import shutil

import pytest
import torch
from harness import run_ranks

import shardwise as sw
from shardwise.checkpoint._schema import CHECKSUM, canonical_sha256
from shardwise.models import GPT, GPTConfig

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)
EXAMPLES = 160

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(-1e3, 1e3),
                    st.text(max_size=8), st.just([]), st.just({}), st.just("../x"))


def _paths(obj, prefix=()):
    """Every path into the JSON tree (dict keys and list indices)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:4]):  # long lists (RNG states) add nothing new
            yield from _paths(v, prefix + (i,))


def _mutate(meta, path, op, value):
    meta = json.loads(json.dumps(meta))
    if not path:
        return value
    parent = meta
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if op == "delete":
        del parent[key]
    elif op == "replace":
        parent[key] = value
    elif op == "bump" and type(parent[key]) is int:
        parent[key] += 1
    elif op == "shrink" and isinstance(parent[key], list) and parent[key]:
        parent[key] = parent[key][:-1]
    elif op == "grow" and isinstance(parent[key], list) and parent[key]:
        parent[key] = parent[key] + [parent[key][-1]]
    elif op == "swap" and isinstance(parent[key], list) and len(parent[key]) > 1:
        parent[key] = [parent[key][1], parent[key][0], *parent[key][2:]]  # two ranks' pieces
    elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = (key + 1) % len(parent)
        parent[key], parent[other] = parent[other], parent[key]
    else:
        parent[key] = value
    return meta


def _state(model, opt):
    sd = sw.full_state_dict(model, rank0_only=False)
    moments = [v.to_local().clone() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sd, moments


def _same(a, b):
    return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(*[a[1], b[1]])))


def _fuzz(rank, world, root):
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    for _ in range(2):
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    good, other = os.path.join(root, "good"), os.path.join(root, "other")
    sw.save_checkpoint(good, model, opt)
    saved = _state(model, opt)
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    sw.save_checkpoint(other, model, opt)  # the state every example starts from
    before = _state(model, opt)
    meta = json.load(open(os.path.join(good, "checkpoint.json")))
    paths = [p for p in _paths(meta) if not (p and p[0] == CHECKSUM)]
    outcomes = {"loaded": 0, "refused": 0}
    counter = [0]

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(paths), op=st.sampled_from(["delete", "replace", "bump",
                                                            "shrink", "grow", "swap"]),
           value=SCALARS, consistent=st.booleans())
    def example(path, op, value, consistent):
        counter[0] += 1
        case = os.path.join(root, f"case{counter[0]}")
        if rank == 0:
            shutil.copytree(good, case)
            try:
                mutated = _mutate(meta, path, op, value)
            except (KeyError, IndexError, TypeError):
                mutated = meta
            if consistent and isinstance(mutated, dict):
                mutated[CHECKSUM] = canonical_sha256(mutated)
            json.dump(mutated, open(os.path.join(case, "checkpoint.json"), "w"))
        torch.distributed.barrier()
        try:
            sw.load_checkpoint(case, model, opt)
        except sw.ShardwiseError as e:
            assert str(e).strip(), "an error must say what is wrong"
            # Said in words, naming the field or file: not a bare exception from inside.
            assert not re.search(r"rank\(s\) \[[0-9, ]+\]: \w+(Error|Exception): ", str(e)), \
                (path, op, value, str(e))
            assert _same(_state(model, opt), before), f"a failed load changed state: {path}"
            outcomes["refused"] += 1
        else:
            assert _same(_state(model, opt), saved), f"loaded wrong values: {path} {op}"
            outcomes["loaded"] += 1
            sw.load_checkpoint(other, model, opt)  # back to the starting state
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(case)

    example()
    return outcomes


@pytest.mark.slow
def test_mutated_metadata_loads_right_or_fails_cleanly_everywhere(tmp_path):
    outcomes = run_ranks(_fuzz, 2, str(tmp_path), timeout=300)
    assert outcomes[0] == outcomes[1]  # every rank saw the same outcome each time
    print("fuzzed checkpoint.json:", outcomes[0])
    assert outcomes[0]["refused"] > 0
