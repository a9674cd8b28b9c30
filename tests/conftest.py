import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# transformers imports torchao when it is installed (the quant extra, docs/qlora.md); on a
# machine without CUDA its CUDA-only libraries only fail to load, noisily.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
# The reproducible mode's fused kernels (Note [fused kernels]) compile with inductor, whose
# compile workers do not survive a fork: pytest's process forks every test's ranks, so
# neither it nor they compile. test_exact_sum checks the kernels in a fresh interpreter.
os.environ.setdefault("SHARDWISE_FUSED", "0")
sys.path.insert(0, os.path.dirname(__file__))
