"""Shared test setup.

Triton kernels run through Triton's interpreter on CPU tensors when there is no GPU;
the variable must be set before triton is first imported, hence here at the top.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
