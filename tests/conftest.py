import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
# transformers imports torchao when it is installed (the quant extra, docs/qlora.md); on a
# machine without CUDA its CUDA-only libraries only fail to load, noisily.
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
sys.path.insert(0, os.path.dirname(__file__))
