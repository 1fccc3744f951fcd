"""The wan22 wheel's model modules without its pipeline, for the S2V reference scripts: the
package's __init__ imports the whole pipeline (decord, the TTS, ...), so its packages are
registered empty and only the modules asked for are imported. Its CUDA flash attention is
replaced by PyTorch's SDPA, which computes the same softmax attention on the CPU."""
import importlib
import os
import sys
import types

import torch.nn.functional as F


def sdpa(q, k, v, q_lens=None, k_lens=None, **_):
    # [B, L, N, D] in and out; every key is valid here (no lengths shorter than L).
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).contiguous()


def import_wan22(root, name):
    """`wan.<name>` from the unpacked wheel at `root`, its attention SDPA."""
    for package in ["wan", "wan.modules", "wan.modules.s2v", "wan.distributed", "wan.utils"]:
        module = types.ModuleType(package)
        module.__path__ = [os.path.join(root, *package.split("."))]
        sys.modules[package] = module
    for patched in ["wan.modules.attention", "wan.modules.model"]:
        importlib.import_module(patched).flash_attention = sdpa
    module = importlib.import_module(f"wan.{name}")
    if hasattr(module, "flash_attention"):
        module.flash_attention = sdpa
    return module
