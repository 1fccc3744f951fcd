#!/usr/bin/env python3
"""The text encoder and the VAE as the official Wan checkpoints ship them (issue #35):
`models_t5_umt5-xxl-enc-bf16.pth` (Wan's own T5Encoder, its own tensor names) and
`Wan2.1_VAE.pth` (Wan's WanVAE_), both `torch.save`d state dicts. Tiny random ones made by the
wan22 wheel's own modules, with their outputs, for tests/tests/original_layout.rs:

  t5.pth         T5Encoder(vocab 256, dim 32, 4 heads, FFN 48, 2 layers, 8 buckets), f32
  vae.pth        WanVAE_ in Wan2.1's structure at base width 8 (z 16), f32
  t5_bf16.pth    the same T5 in bf16, as the official file is
  wav2vec2/      tests/fixtures/wav2vec2-tiny as a transformers directory that ships only
                 pytorch_model.bin (a torch.save'd state dict) beside its config.json
  reference.safetensors:
    ids, states        a prompt's ids and the encoder's states
    latents, frames    normalised latents (3 latent frames of 4 x 6) and Wan2_1_VAE's decode
                       (de-normalised with Wan2.1's mean and std, clamped to [-1, 1])
    pixels, encoded    9 frames of 32 x 48 in [-1, 1] and Wan2_1_VAE's encode (the mean,
                       normalised)
CPU, f32.

  python scripts/reference/reference_original_layout.py --wan22 DIR --out tests/fixtures/original-layout
  (DIR: the unpacked wan22 2.2.11 wheel)
"""
import argparse
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from wan22_modules import import_wan22


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--wan22", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    # t5.py's T5EncoderModel takes `device=torch.cuda.current_device()` as a default argument,
    # evaluated at import; only its T5Encoder is used here, on the CPU.
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    t5 = import_wan22(args.wan22, "modules.t5")
    vae = import_wan22(args.wan22, "modules.vae2_1")
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    out = {}
    with torch.no_grad():
        encoder = t5.T5Encoder(vocab=256, dim=32, dim_attn=32, dim_ffn=48, num_heads=4, num_layers=2,
                               num_buckets=8, shared_pos=False, dropout=0.0).eval()
        for name, p in encoder.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "pos_embedding" in name:
                p.copy_(torch.randn_like(p))
        ids = torch.tensor([[5, 77, 3, 250, 18, 9, 1]])
        out["ids"] = ids[0].to(torch.int64)
        out["states"] = encoder(ids, torch.ones_like(ids))[0].contiguous()
        torch.save(encoder.state_dict(), os.path.join(args.out, "t5.pth"))
        torch.save({k: v.to(torch.bfloat16) for k, v in encoder.state_dict().items()},
                   os.path.join(args.out, "t5_bf16.pth"))

        model = vae.WanVAE_(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                            temperal_downsample=[False, True, True], dropout=0.0).eval()
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(0.5 + torch.rand_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * (2 * torch.rand_like(p) - 1))
        torch.save(model.state_dict(), os.path.join(args.out, "vae.pth"))
        # Wan2_1_VAE's normalisation, without building it (it loads a file onto CUDA).
        mean = torch.tensor([-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                             0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921])
        std = torch.tensor([2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                            3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160])
        scale = [mean, 1.0 / std]
        latents = torch.randn(1, 16, 3, 4, 6)
        out["latents"] = latents[0].contiguous()
        out["frames"] = model.decode(latents, scale).clamp(-1, 1)[0].contiguous()
        pixels = 2 * torch.rand(1, 3, 9, 32, 48) - 1
        out["pixels"] = pixels[0].contiguous()
        out["encoded"] = model.encode(pixels, scale)[0].contiguous()
    save_file(out, os.path.join(args.out, "reference.safetensors"))
    tiny = os.path.join(os.path.dirname(os.path.abspath(args.out)), "wav2vec2-tiny")
    w2v = os.path.join(args.out, "wav2vec2")
    os.makedirs(w2v, exist_ok=True)
    shutil.copy(os.path.join(tiny, "config.json"), w2v)
    torch.save(load_file(os.path.join(tiny, "model.safetensors")), os.path.join(w2v, "pytorch_model.bin"))
    print({k: list(v.shape) for k, v in out.items()})


if __name__ == "__main__":
    main()
