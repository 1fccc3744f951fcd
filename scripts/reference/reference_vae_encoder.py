#!/usr/bin/env python3
"""The Wan VAE encoder reference (issue #35): diffusers' AutoencoderKLWan.encode on a tiny
random VAE in Wan2.1's structure, as the S2V pipeline encodes its reference image and motion
frames: the posterior's mode, normalised as the DiT takes latents ((mu - mean) / std).
Written as tests/fixtures/vae-encoder/: under model/, the VAE's config.json and its
encoder's tensors (diffusion_pytorch_model.safetensors, diffusers' names); beside it,
cases.safetensors with a 9-frame video and a single image in [-1, 1] and their latents.
CPU, f32.

  python scripts/reference/reference_vae_encoder.py --out tests/fixtures/vae-encoder
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=5)
    args = p.parse_args()
    from diffusers import AutoencoderKLWan

    torch.manual_seed(args.seed)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, num_res_blocks=1).eval()
    z = vae.config.z_dim
    mean, std = (0.5 * torch.randn(z)).tolist(), (0.5 + 2.5 * torch.rand(z)).tolist()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            # Norms away from their identity init, small biases, convolutions at their init.
            if name.endswith("gamma"):
                p.copy_(0.5 + torch.rand_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * (2 * torch.rand_like(p) - 1))
        cases = {}
        for name, frames in [("video", 9), ("image", 1)]:
            pixels = (2 * torch.rand(1, 3, frames, 32, 48) - 1)
            mu = vae.encode(pixels).latent_dist.mode()
            normalised = (mu - torch.tensor(mean).view(1, z, 1, 1, 1)) / torch.tensor(std).view(1, z, 1, 1, 1)
            cases[f"{name}_pixels"] = pixels[0].contiguous()
            cases[f"{name}_latents"] = normalised[0].contiguous()
    model_dir = os.path.join(args.out, "model")
    os.makedirs(model_dir, exist_ok=True)
    config = dict(vae.config)
    config.update(latents_mean=mean, latents_std=std, _class_name="AutoencoderKLWan")
    config = {k: v for k, v in config.items() if not k.startswith("_") or k == "_class_name"}
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    encoder = {k: v.contiguous() for k, v in vae.state_dict().items() if k.startswith(("encoder.", "quant_conv."))}
    save_file(encoder, os.path.join(model_dir, "diffusion_pytorch_model.safetensors"))
    save_file(cases, os.path.join(args.out, "cases.safetensors"))
    print({k: list(v.shape) for k, v in cases.items()}, sum(v.numel() for v in encoder.values()), "encoder values")


if __name__ == "__main__":
    main()
