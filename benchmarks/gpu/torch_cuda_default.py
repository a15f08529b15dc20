"""pytest plugin (-p torch_cuda_default): CUDA as torch's default device in every process."""

import torch

torch.set_default_device("cuda")
