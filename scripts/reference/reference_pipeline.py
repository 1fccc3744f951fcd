#!/usr/bin/env python3
"""The whole Wan text-to-video pipeline's reference: diffusers' WanPipeline on a pipeline
directory in its layout (tpinfer's tiny one, `cargo run -p tpinfer-tests --example
tiny_wan_pipeline`, or random weights of any shape), from given starting latents, so that
`tpinfer generate --init-latents` can be held to its frames (issue #30). Runs on CPU (f32) or
CUDA; needs torch, transformers, diffusers and ftfy.

  latents --frames F --height H --width W [--z Z] [--seed S] --out FILE
                                     starting latents `latents` [Z, (F-1)/4+1, H/8, W/8]
  run --model DIR --init FILE --prompt P --frames F --size WxH --steps N --guide-scale G
      --shift S [--dtype f32|bf16] --out FILE
                                     WanPipeline's frames `frames` [F, H, W, 3], 8-bit, and on
                                     CUDA the call's wall time, its steps' and its peak memory;
                                     bf16: the transformer and umT5 in bf16, the VAE in f32, as
                                     diffusers' Wan examples load them
  compare --ref FILE --frames DIR    the largest difference, in 8-bit steps, of tpinfer's PNG
                                     frames (`--save-frames DIR`) against the reference's
"""
import argparse
import glob
import time

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def latents(args):
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.z, (args.frames - 1) // 4 + 1, args.height // 8, args.width // 8)
    save_file({"latents": torch.randn(*shape, generator=g)}, args.out)
    print(f"wrote {args.out}: latents {list(shape)}")


def vae(d):
    """The VAE of `d`: its decoder's weights (a checkpoint without its encoder loads too)."""
    from diffusers import AutoencoderKLWan

    model = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(d))
    missing = model.load_state_dict(load_file(f"{d}/diffusion_pytorch_model.safetensors"), strict=False).missing_keys
    if any(k.startswith(("decoder.", "post_quant_conv.")) for k in missing):
        raise SystemExit(f"{d}: the decoder's weights are incomplete: {missing}")
    return model.float().eval()


def run(args):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import T5TokenizerFast, UMT5EncoderModel

    torch.backends.cuda.matmul.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    d, f32 = args.model, torch.float32
    dtype = {"f32": f32, "bf16": torch.bfloat16}[args.dtype]
    tokenizer = T5TokenizerFast(tokenizer_file=f"{d}/tokenizer/tokenizer.json", pad_token="<pad>",
                                eos_token="</s>", unk_token="<unk>")
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=UMT5EncoderModel.from_pretrained(f"{d}/text_encoder", torch_dtype=dtype),
        transformer=WanTransformer3DModel.from_pretrained(f"{d}/transformer", torch_dtype=dtype),
        vae=vae(f"{d}/vae"),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                          num_train_timesteps=1000, flow_shift=args.shift),
    ).to(device)
    width, height = (int(v) for v in args.size.split("x"))
    init = load_file(args.init)["latents"][None].to(device)
    cuda = device == "cuda"
    step_ends = []

    def on_step_end(pipe, step, timestep, kwargs):
        if cuda:
            torch.cuda.synchronize()
        step_ends.append(time.perf_counter())
        print(f"step {step + 1}: {step_ends[-1] - (step_ends[-2] if len(step_ends) > 1 else start):.3f} s", flush=True)
        return kwargs

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        video = pipe(prompt=args.prompt, negative_prompt="", height=height, width=width,
                     num_frames=args.frames, num_inference_steps=args.steps,
                     guidance_scale=args.guide_scale, latents=init, output_type="np",
                     callback_on_step_end=on_step_end).frames[0]
    if cuda:
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        steps = [b - a for a, b in zip(step_ends, step_ends[1:])]
        print(f"diffusers {args.dtype}: {wall:.2f} s from prompt to frames; steps after the first: median "
              f"{sorted(steps)[len(steps) // 2] if steps else float('nan'):.3f} s; until the first step's end "
              f"{step_ends[0] - start:.2f} s; after the last {wall - (step_ends[-1] - start):.2f} s (decode, "
              f"frames to the host); peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated")
    frames = torch.from_numpy(np.round(np.clip(video, 0, 1) * 255).astype(np.uint8))
    save_file({"frames": frames.contiguous()}, args.out)
    print(f"wrote {args.out}: frames {list(frames.shape)}")


def compare(args):
    from PIL import Image

    ref = load_file(args.ref)["frames"].numpy().astype(np.int16)
    paths = sorted(glob.glob(f"{args.frames}/*.png"))
    ours = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in paths]).astype(np.int16)
    if ours.shape != ref.shape:
        raise SystemExit(f"tpinfer's frames {list(ours.shape)} are not the reference's {list(ref.shape)}")
    diff = np.abs(ours - ref)
    print(f"{len(paths)} frames: largest difference {diff.max()}/255, mean {diff.mean():.4f}/255, "
          f"{(diff > 2).mean() * 100:.3f}% of values beyond 2/255")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    l = sub.add_parser("latents")
    for name in ("frames", "height", "width"):
        l.add_argument(f"--{name}", type=int, required=True)
    l.add_argument("--z", type=int, default=16)
    l.add_argument("--seed", type=int, default=1)
    l.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--init", required=True)
    r.add_argument("--prompt", required=True)
    r.add_argument("--frames", type=int, required=True)
    r.add_argument("--size", required=True)
    r.add_argument("--steps", type=int, default=4)
    r.add_argument("--guide-scale", type=float, default=5.0)
    r.add_argument("--shift", type=float, default=5.0)
    r.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("--ref", required=True)
    c.add_argument("--frames", required=True)
    args = p.parse_args()
    {"latents": latents, "run": run, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
