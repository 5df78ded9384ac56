"""Where the kernels suite runs its kernels: the CUDA device when there is one (``make gpu-check``,
compiled triton), else the CPU (under the triton interpreter, conftest.py)."""

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
