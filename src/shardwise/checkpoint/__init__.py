"""Checkpoints and pretrained weights: safetensors data, JSON metadata, nothing pickled."""

from .background import SaveHandle
from .consolidation import consolidate, describe
from .load import load_checkpoint
from .pretrained import load_pretrained
from .resumable import Resumable
from .save import save_checkpoint
from .verify import sign_checkpoint

__all__ = ["consolidate", "describe", "load_checkpoint", "load_pretrained", "Resumable",
           "SaveHandle", "save_checkpoint", "sign_checkpoint"]
