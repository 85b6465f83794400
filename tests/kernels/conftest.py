"""Kernel tests run on CUDA when present, else under Triton's interpreter.

TRITON_INTERPRET is read when @triton.jit decorates a kernel, so it must be
set before anything imports the kernels package: pytest loads this conftest
before it imports the test modules of this folder.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
