#!/usr/bin/env python3
"""The Wan VAE decoder reference: diffusers' AutoencoderKLWan on the same weights and latents
as tpinfer (issue #30), decoding as WanPipeline does (latents · std + mean, then decode).
Runs on any host with torch and diffusers (CUDA for the timings).

  make    [--tiny] [--seed S] --out DIR              random weights in Wan2.1's VAE shape (or a
                                                     tiny one), saved as diffusers saves them
  latents --frames F --height H --width W [--z Z] [--seed S] --out FILE
                                                     normalised latents `latents` [Z, F, H, W]
  decode  --model DIR --latents FILE --dtype f32|bf16 --out FILE [--repeats N] [--tiled]
                                                     frames `frames` [T, 3, 8H, 8W] in [-1, 1], f32
  compare --ref FILE [--out-json FILE] name=FILE ...  ‖x − ref‖ / ‖ref‖, and the largest pixel
                                                     difference in 8-bit steps, of each run
"""
import argparse
import json
import time

import torch
from safetensors.torch import load_file, save_file

TINY = dict(base_dim=8, z_dim=4, num_res_blocks=1)


def make(args):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(args.seed)
    vae = AutoencoderKLWan(**(TINY if args.tiny else {}))
    with torch.no_grad():
        z = vae.config.z_dim
        vae.register_to_config(latents_mean=(0.5 * torch.randn(z)).tolist(),
                               latents_std=(0.5 + 2.5 * torch.rand(z)).tolist())
        for name, p in vae.named_parameters():
            # Norms away from their identity init, small biases, convolutions at their init.
            if name.endswith("gamma"):
                p.copy_(0.5 + torch.rand_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * (2 * torch.rand_like(p) - 1))
    vae.save_pretrained(args.out, safe_serialization=True)
    print(f"wrote {args.out}: {sum(p.numel() for p in vae.parameters()) / 1e6:.1f} M params")


def latents(args):
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.z, args.frames, args.height, args.width, generator=g)
    save_file({"latents": x}, args.out)
    print(f"wrote {args.out}: latents {list(x.shape)}")


def decode(args):
    from diffusers import AutoencoderKLWan

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vae = AutoencoderKLWan.from_pretrained(args.model, torch_dtype=dtype).to(device).eval()
    if args.tiled:
        vae.enable_tiling()
    z = load_file(args.latents)["latents"][None].to(device, dtype)
    # WanPipeline: latents / (1 / std) + mean.
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(device, dtype)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(device, dtype)
    z = z / inv_std + mean
    times = []
    with torch.no_grad():
        for _ in range(args.repeats + 1):
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            frames = vae.decode(z, return_dict=False)[0]
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    save_file({"frames": frames[0].permute(1, 0, 2, 3).float().cpu().contiguous()}, args.out)
    times = sorted(times[1:]) or times
    print(f"diffusers {args.dtype}{' tiled' if args.tiled else ''}: {list(frames.shape)} in "
          f"{times[len(times) // 2]:.3f} s (median of {len(times)}), peak {peak:.2f} GiB")


def compare(args):
    ref = load_file(args.ref)["frames"].double()
    results = {}
    for item in args.runs:
        name, path = item.split("=", 1)
        x = load_file(path)["frames"].double()
        if x.shape != ref.shape:
            raise SystemExit(f"{name}: shape {list(x.shape)} is not the reference's {list(ref.shape)}")
        rel = ((x - ref).norm() / ref.norm()).item()
        to8 = lambda t: ((t / 2 + 0.5).clamp(0, 1) * 255).round()
        steps = (to8(x) - to8(ref)).abs().max().item()
        results[name] = {"rel": rel, "max_8bit_steps": steps}
        print(f"{name}: rel {rel:.3e}, largest pixel difference {steps:.0f}/255")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(results, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--tiny", action="store_true")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", required=True)
    l = sub.add_parser("latents")
    for name in ("frames", "height", "width"):
        l.add_argument(f"--{name}", type=int, required=True)
    l.add_argument("--z", type=int, default=16)
    l.add_argument("--seed", type=int, default=1)
    l.add_argument("--out", required=True)
    d = sub.add_parser("decode")
    d.add_argument("--model", required=True)
    d.add_argument("--latents", required=True)
    d.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    d.add_argument("--out", required=True)
    d.add_argument("--repeats", type=int, default=0)
    d.add_argument("--tiled", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("--ref", required=True)
    c.add_argument("--out-json")
    c.add_argument("runs", nargs="+")
    args = p.parse_args()
    {"make": make, "latents": latents, "decode": decode, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
