"""Imported first by the tests of the Triton kernels: without a GPU they run under Triton's interpreter, which must be
switched on before engine.triton_kernels (and so triton's decorators) are first imported. The variable only changes
how `triton.jit` functions run; nothing else in the suite uses triton, and on the CPU the `auto` backend never
picks it."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
