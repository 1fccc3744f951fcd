#!/usr/bin/env python3
"""The Wan2.2-S2V-14B DiT's denoising step as the wan22 wheel runs it (issue #35), the
reference for `tpinfer-bench dit --guided-steps`: the wheel's own WanModel_S2V in its published
14B shape (wan/configs/wan_s2v_14B.py) on random weights, bf16 with autocast as its `generate`
runs it, a clip of FRAMES frames with its motion frames, reference, pose and audio.

  make:   the checkpoint (config.json and diffusion_pytorch_model.safetensors in the original
          names, bf16) and the inputs tpinfer-bench takes (latents, text, negative, timestep,
          reference, motion, pose, audio), made on the GPU.
  time:   guided UniPC steps (shift 3, guidance 4.5: a conditional and an unconditional
          forward each, the latter with the negative prompt and silent audio), as `generate`
          runs them; prints each step's time.

  python reference_s2v_speed.py make --wan22 DIR --out MODEL --inputs IN.st [--frames 80 --size 832x480]
  python reference_s2v_speed.py time --wan22 DIR --model MODEL --inputs IN.st --steps 3
(DIR: the unpacked wan22 2.2.11 wheel. Its CUDA flash attention is replaced by PyTorch's SDPA,
which runs a flash kernel on the GPU.)
"""
import argparse
import json
import os
import time

import torch
from safetensors.torch import load_file, save_file
from wan22_modules import import_wan22

CONFIG = {
    "_class_name": "WanModel_S2V", "model_type": "s2v",
    "dim": 5120, "ffn_dim": 13824, "freq_dim": 256, "num_heads": 40, "num_layers": 40,
    "in_dim": 16, "out_dim": 16, "text_dim": 4096, "text_len": 512, "patch_size": [1, 2, 2],
    "audio_dim": 1024, "num_audio_token": 4, "cond_dim": 16,
    "audio_inject_layers": [0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39],
    "enable_adain": True, "adain_mode": "attn_norm", "enable_framepack": True,
    "framepack_drop_mode": "padd", "enable_motioner": False, "zero_timestep": True,
    "zero_init": True, "add_last_motion": True, "trainable_token": False,
    "enable_tsm": False, "motion_frames": 73, "window_size": [-1, -1],
    "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
}
MOTION, LAT_MOTION, STATES, TEXT_TOKENS = 73, 19, 25, 40


def dtype(args):
    return {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]


def build(wan22, device):
    model_s2v = import_wan22(wan22, "modules.s2v.model_s2v")
    kwargs = {k: v for k, v in CONFIG.items() if k not in ("_class_name", "trainable_token", "motion_frames")}
    kwargs["window_size"] = tuple(kwargs["window_size"])
    kwargs["patch_size"] = tuple(kwargs["patch_size"])
    with torch.device(device):
        return model_s2v.WanModel_S2V(**kwargs).eval()


def make(args):
    torch.manual_seed(3)
    model = build(args.wan22, args.device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Small weights in every tensor (the zero inits too), so that no stage is skipped
            # or saturates.
            if "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else p[0].numel() ** -0.5))
    weights = {k: v.to(dtype(args)).contiguous() for k, v in model.state_dict().items()}
    del model
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    save_file(weights, os.path.join(args.out, "diffusion_pytorch_model.safetensors"))
    del weights
    w, h = map(int, args.size.split("x"))
    frames = args.frames
    lat = (frames + 3 + MOTION) // 4 - LAT_MOTION
    shape = (16, lat, h // 8, w // 8)

    def text(tokens):
        return torch.cat([torch.randn(tokens, 4096), torch.zeros(512 - tokens, 4096)])

    inputs = {
        "latents": torch.randn(*shape), "text": text(TEXT_TOKENS), "negative": text(TEXT_TOKENS // 2),
        "timestep": torch.tensor([742.5]), "reference": torch.randn(16, 1, h // 8, w // 8),
        "motion": torch.randn(16, LAT_MOTION, h // 8, w // 8), "pose": torch.randn(*shape),
        "audio": torch.randn(frames, STATES, 1024),
    }
    save_file(inputs, args.inputs)
    print({k: list(v.shape) for k, v in inputs.items()})


def time_steps(args):
    # Built in place (its RoPE tables are buffers it computes), then given the weights.
    model = build(args.wan22, args.device).to(dtype(args))
    model.load_state_dict(load_file(os.path.join(args.model, "diffusion_pytorch_model.safetensors"), device=args.device))
    solvers = import_wan22(args.wan22, "utils.fm_solvers_unipc")
    i = {k: v.to(args.device) for k, v in load_file(args.inputs).items()}
    bf = lambda t: t.to(dtype(args))
    audio = bf(i["audio"]).permute(1, 2, 0).unsqueeze(0)  # [1, states, dim, frames]
    f, h, w = i["latents"].shape[1:]
    seq_len = f * h * w // 4

    def velocity(latents, t, context, audio_input):
        return model([latents], t=torch.stack([t]), context=[bf(context)], seq_len=seq_len,
                     ref_latents=[bf(i["reference"])], motion_latents=[bf(i["motion"])],
                     cond_states=[bf(i["pose"])], audio_input=audio_input,
                     motion_frames=[MOTION, LAT_MOTION], drop_motion_frames=False)[0]

    def run(steps):
        scheduler = solvers.FlowUniPCMultistepScheduler(num_train_timesteps=1000, shift=1, use_dynamic_shifting=False)
        scheduler.set_timesteps(steps, device=args.device, shift=3.0)
        latents = bf(i["latents"])
        times = []
        for t in scheduler.timesteps:
            start = time.perf_counter()
            cond = velocity(latents, t, i["text"], audio)
            uncond = velocity(latents, t, i["negative"], 0.0 * audio)
            guided = uncond + 4.5 * (cond - uncond)
            latents = scheduler.step(guided.unsqueeze(0), t, latents.unsqueeze(0), return_dict=False)[0].squeeze(0)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return times

    # As the wheel's `generate` runs it: bf16 weights under autocast (which keeps its f32
    # stages f32); f32 (a CPU check of this script) plain.
    autocast = torch.amp.autocast(args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    with autocast, torch.no_grad():
        run(1)  # warm-up
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = run(args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else 0
    ms = sorted(t * 1e3 for t in times)
    print(f"wheel guided steps: {args.steps}, ms per step median {ms[len(ms) // 2]:.1f}, "
          f"each {[round(t * 1e3, 1) for t in times]}, peak allocated "
          f"{peak:.0f} MiB")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--wan22", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--inputs", required=True)
    m.add_argument("--frames", type=int, default=80)
    m.add_argument("--size", default="832x480")
    t = sub.add_parser("time")
    t.add_argument("--wan22", required=True)
    t.add_argument("--model", required=True)
    t.add_argument("--inputs", required=True)
    t.add_argument("--steps", type=int, default=3)
    for sp in (m, t):
        sp.add_argument("--device", default="cuda")
        sp.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    args = p.parse_args()
    {"make": make, "time": time_steps}[args.cmd](args)


if __name__ == "__main__":
    main()
