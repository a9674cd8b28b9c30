"""``shardwise demo`` end to end: it launches its own ranks, shows a frozen tokenizer's
buffers identical on every rank (and the rank-0-only load caught), trains, checkpoints,
samples."""

import math
import os
import re
import subprocess
import sys

import pytest

from shardwise.demo.main import CharCodec, corpus

pytestmark = pytest.mark.slow


def _rank_lines(text: str, title: str) -> list[str]:
    """The ``  rank r: ...`` lines printed under the heading that starts with ``title``."""
    section = text.split("\n" + title, 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^  rank \d+: (.*)$", section, re.M)


def test_demo_trains_reports_and_samples_at_three_ranks(tmp_path):
    out = tmp_path / "ck"
    # -m shardwise.cli rather than the console script: the shardwise on sys.path is the one
    # under test, wherever the installed script points.
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "demo", "--nproc", "3",
                           "--steps", "40", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout

    # The frozen tokenizer: loaded on every rank, the same statistics and output everywhere.
    right = _rank_lines(text, "loaded the shardwise way")
    assert len(right) == 3 and len(set(right)) == 1, text
    assert "running_var 1.0000" not in right[0], text  # trained statistics, not defaults
    # Loaded on rank 0 only: ranks 1 and 2 keep the defaults, compute something else, and
    # the check names every BatchNorm3d statistic.
    naive = _rank_lines(text, "loaded on rank 0 only")
    assert naive[0] == right[0] and naive[1] == naive[2] != naive[0], text
    assert "running_mean +0.0000, running_var 1.0000" in naive[1], text
    error = text.split("raised sw.DivergenceError:", 1)[1].split("\n\n", 1)[0]
    for i in range(3):
        for stat in ("running_mean", "running_var"):
            assert f"blocks.{i}.bn.{stat}: ranks [0]" in error, text
    assert "conv.weight" not in error and "codebook" not in error, text  # params broadcast
    fixed = _rank_lines(text, "fixed with sw.sync_buffers")
    assert fixed == right, text

    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", text).groups())
    vocab = len(CharCodec(corpus()).chars)
    # A fresh model predicts about uniformly; 40 steps must get well below that.
    assert abs(first - math.log(vocab)) < 0.2 and last < first - 0.8, text
    assert re.search(r"largest gathered unit(\s+\d+){4}", text), text  # 3 ranks + unsharded
    assert "consistency check (sw.check_consistency): passed" in text
    assert (out / "checkpoint.json").is_file() and (out / "consolidated.safetensors").is_file()
    assert (out / "tokenizer.safetensors").is_file()
    sample = text.split("a sample:\n\n", 1)[1]
    assert sample.startswith("MACBETH.\n") and len(sample) > 300
    assert set(sample) <= set(corpus()) | {"\n"}


def _demo(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "demo", "--no-progress",
                           *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **env))


def test_demo_at_one_rank_and_its_usage_errors(tmp_path):
    """Issue 31 item 5: --nproc 1 failed with a 77-line traceback, --out <a file> with a
    FileExistsError traceback, --batch 0 inside a rank; a failed run left its folder."""
    done = _demo("--nproc", "1", "--steps", "1", "--out", str(tmp_path / "one"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "one rank: nothing can differ between ranks" in done.stdout
    afile = tmp_path / "afile"
    afile.write_text("")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)  # issue 41 item 10: a 70-line traceback from every rank
    for args, said in ((("--out", str(afile)), "not a folder"),
                       (("--out", str(loop)), "a symbolic link that leads nowhere (a loop"),
                       (("--out", str(afile / "sub")), "cannot create the folder"),
                       (("--batch", "0", "--out", str(tmp_path / "b")), "--batch must be")):
        done = _demo(*args)
        assert done.returncode == 1 and said in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, \
            done.stderr
    assert not (tmp_path / "b").exists()


def test_a_run_that_fails_after_creating_its_folder_removes_it(tmp_path):
    """Issue 31 item 5: each failed demo left its folder behind (/tmp/shardwise-demo-*
    without --out). Here every rank fails once the folder holds the tokenizer's weights:
    a sitecustomize, which every process of the run imports at its start (the ranks are
    spawned), makes training raise."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import shardwise.demo.main as demo\n\n\n"
        "def _fail(*args, **kwargs):\n"
        "    raise RuntimeError('a failure injected after the folder was written')\n\n\n"
        "demo._train = _fail\n")
    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    temp = tmp_path / "tmp"  # where the run's own folder goes without --out
    temp.mkdir()
    for out in (("--out", str(tmp_path / "new")), ()):
        done = _demo("--steps", "1", *out, PYTHONPATH=path, TMPDIR=str(temp))
        said = done.stdout + done.stderr
        assert done.returncode != 0 and "a failure injected" in said, said
        assert "loaded the shardwise way" in done.stdout, said  # the folder was written
        assert not (tmp_path / "new").exists()
        assert not list(temp.glob("shardwise-demo-*")), list(temp.iterdir())
