"""``shardwise demo`` end to end: it launches its own ranks, trains, checkpoints, samples."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.demo import CharCodec, corpus

pytestmark = pytest.mark.slow


def test_demo_trains_reports_and_samples_at_three_ranks(tmp_path):
    out = tmp_path / "ck"
    shardwise = Path(sys.executable).parent / "shardwise"
    done = subprocess.run([str(shardwise), "demo", "--nproc", "3", "--steps", "40",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", text).groups())
    vocab = len(CharCodec(corpus()).chars)
    # A fresh model predicts about uniformly; 40 steps must get well below that.
    assert abs(first - math.log(vocab)) < 0.2 and last < first - 0.8, text
    assert re.search(r"largest gathered unit(\s+\d+){4}", text), text  # 3 ranks + unsharded
    assert "consistency check (sw.check_consistency): passed" in text
    assert (out / "checkpoint.json").is_file() and (out / "consolidated.safetensors").is_file()
    sample = text.split("a sample:\n\n", 1)[1]
    assert sample.startswith("MACBETH.\n") and len(sample) > 300
    assert set(sample) <= set(corpus()) | {"\n"}
