"""Checkpoints and pretrained weights: safetensors data, JSON metadata, nothing pickled."""

from .consolidation import consolidate, describe
from .io import load_checkpoint, save_checkpoint, sign_checkpoint
from .pretrained import load_pretrained
from .resumable import Resumable

__all__ = ["consolidate", "describe", "load_checkpoint", "load_pretrained", "Resumable",
           "save_checkpoint", "sign_checkpoint"]
