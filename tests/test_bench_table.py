"""benchmarks/table.py's own logic: reading workloads.py's rows (measured and n/a),
the table's cells when a system or a run is missing, and the default run's estimate."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "bench_table", Path(__file__).resolve().parent.parent / "benchmarks" / "table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)


def test_rows():
    assert table.parse_row("| system | baseline | median s/step | ratio to baseline per round; "
                           "median | max abs loss diff from baseline |") is None
    assert table.parse_row("|---|---|---|---|---|") is None
    assert table.parse_row("  round 1 ddp        median 0.153 s/step") is None
    name, row = table.parse_row(
        "| shardwise_compiled | ddp_compiled | 4.3846 | 1.438 1.2; **1.438** | 9.54e-07 |")
    assert name == "shardwise_compiled"
    assert row == {"baseline": "ddp_compiled", "median": "1.438", "rounds": "1.438 1.2",
                   "loss": "9.54e-07"}
    name, row = table.parse_row(
        "| shardwise_reproducible | ddp | n/a | n/a (TypeError: shard() got an unexpected "
        "keyword argument 'reproducible') | n/a |")
    assert name == "shardwise_reproducible" and row["median"] is None
    assert row["rounds"].startswith("n/a (TypeError")


def test_table_shows_what_is_missing():
    ok = {"baseline": "ddp", "median": "1.100", "rounds": "1.1 1.0", "loss": "0.00e+00"}
    failed = {"baseline": "ddp", "median": None, "rounds": "n/a (TypeError)", "loss": "n/a"}
    results = [("gpt", {"shardwise": ok}, {"shardwise": ok, "shardwise_reproducible": ok},
                "not run", "not run"),
               ("cnn", {"shardwise_reproducible": failed}, {}, "not run",
                "run failed, exit 1")]
    lines = table.markdown(results, ["ddp", "shardwise", "shardwise_reproducible",
                                     "ddp_compiled", "shardwise_compiled"])
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in lines[2:]}
    assert len(rows) == 8  # every workload and system but ddp
    assert "| gpt | shardwise | ddp | 1.100x | **1.100x** | 1.1 1.0 | 0.00e+00 |" in lines
    assert "| n/a (not run) |" in rows["gpt", "shardwise_reproducible"]
    assert "| ddp_compiled | n/a (not run) |" in rows["gpt", "shardwise_compiled"]
    assert "| n/a (TypeError) | n/a (run failed, exit 1) |" in rows[
        "cnn", "shardwise_reproducible"]


def test_default_estimate():
    """The default table stays within the 25-35 minutes issue 54's command is sized for."""
    guess = table.estimate(list(table.WORKLOADS), list(table.SYSTEMS), 3, 5)
    assert set(guess) == set(table.WORKLOADS)
    assert 25 * 60 < sum(guess.values()) < 35 * 60
    assert table.baseline("fsdp2_compiled") == "ddp_compiled"
    assert table.baseline("ddp_compiled") == table.baseline("fsdp2") == "ddp"
