"""Checkpoints and pretrained weights: safetensors data, JSON metadata, nothing pickled."""

from .consolidation import consolidate, describe
from .io import load_checkpoint, save_checkpoint, sign_checkpoint
from .pretrained import load_pretrained

__all__ = ["consolidate", "describe", "load_checkpoint", "load_pretrained", "save_checkpoint",
           "sign_checkpoint"]
