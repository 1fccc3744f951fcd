#!/usr/bin/env python3
"""The Wan DiT reference: diffusers' WanTransformer3DModel on the same weights and inputs as
tpinfer (issue #5). Runs on any CUDA host with torch and diffusers.

  make    --shape 1.3b|14b [--layers N] [--save bf16] --out DIR
                                                         random weights, rounded to bf16, saved in f32
                                                         (or bf16: the same values, half the bytes)
  inputs  --frames F --size WxH [--tokens L] --out FILE  latents, text states, timestep
  forward --model DIR --inputs FILE[,FILE…] --dtype f32|bf16 --out FILE [--repeats N]
  compare --ref FILE [--out-json FILE] name=FILE ...     ‖x − ref‖ / ‖ref‖ of each velocity
"""
import argparse
import json
import sys
import time

import torch
from safetensors.torch import load_file, save_file

SHAPES = {
    "1.3b": dict(num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "14b": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40),
}


def original_head(model):
    """Newer diffusers compute the head's modulation from SiLU(temb) (an AdaLayerNorm); the
    original Wan code, and older diffusers, from temb itself. tpinfer follows the original."""
    norm_out = getattr(model, "norm_out", None)
    if norm_out is not None and hasattr(norm_out, "silu"):
        norm_out.silu = torch.nn.Identity()
        return "AdaLayerNorm head: SiLU removed to match the original Wan head"
    return "scale_shift_table head (original form)"


def make(args):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(args.seed)
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_layers"] = args.layers
    # Initialized on the GPU when there is one: a 14B model's init on the CPU takes minutes.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
            freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, **shape)
    with torch.no_grad():
        for p in model.parameters():
            # Norm weights and modulation tables away from their identity init, so they matter.
            if p.dim() <= 1:
                p.add_(0.1 * torch.randn_like(p))
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    import os
    os.makedirs(args.out, exist_ok=True)
    model.save_config(args.out)
    save = {"f32": torch.float32, "bf16": torch.bfloat16}[args.save]
    state = {k: v.to(save).cpu().contiguous() for k, v in model.state_dict().items()}
    del model
    # Checkpoints on the Hub carry the head's table as `scale_shift_table`; newer diffusers
    # convert it into norm_out.linear on load (an identity-repeat weight).
    if "norm_out.linear.weight" in state:
        dim = state["norm_out.linear.bias"].numel() // 2
        state.pop("norm_out.linear.weight")
        state["scale_shift_table"] = state.pop("norm_out.linear.bias").reshape(1, 2, dim)
    save_file(state, f"{args.out}/diffusion_pytorch_model.safetensors")
    print(f"wrote {args.out}: {sum(v.numel() for v in state.values()) / 1e9:.2f} B params, diffusers "
          f"{__import__('diffusers').__version__}")


def inputs(args):
    g = torch.Generator().manual_seed(args.seed)
    w, h = (int(v) for v in args.size.split("x"))
    f = (args.frames - 1) // 4 + 1
    latents = torch.randn(16, f, h // 8, w // 8, generator=g)
    text = 0.5 * torch.randn(args.tokens, 4096, generator=g)
    save_file({"latents": latents, "text": text, "timestep": torch.tensor([args.timestep])}, args.out)
    print(f"wrote {args.out}: latents {tuple(latents.shape)}, text {tuple(text.shape)}")


def forward(args):
    from diffusers import WanTransformer3DModel

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    # An f32 reference in f32: PyTorch runs convolutions (the patch embedding) in TF32 by
    # default, which alone moves the velocity by ~1e-4.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = WanTransformer3DModel.from_pretrained(args.model, torch_dtype=dtype).cuda().eval()
    print(original_head(model), file=sys.stderr)
    paths = args.inputs.split(",")
    for index, path in enumerate(paths):
        x = load_file(path)
        latents = x["latents"][None].to("cuda", dtype)
        text = x["text"][None].to("cuda", dtype)
        t = x["timestep"].to("cuda")
        times = []
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            for _ in range(args.repeats + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = model(hidden_states=latents, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
                torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
        out_path = args.out if len(paths) == 1 else args.out.replace(".st", f"_{index}.st")
        save_file({"velocity": out[0].float().cpu().contiguous()}, out_path)
        del out
        times = sorted(times[1:]) or times
        median = times[len(times) // 2]
        print(f"diffusers {args.dtype}, {tuple(latents.shape[2:])} latents: {median:.1f} ms per "
              f"forward (median of {len(times)}), peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB allocated")
        if args.out_json:
            path = args.out_json if len(paths) == 1 else args.out_json.replace(".json", f"_{index}.json")
            json.dump(dict(ms_per_forward=median, peak_mib=torch.cuda.max_memory_allocated() / 2**20), open(path, "w"))


def compare(args):
    ref = load_file(args.ref)["velocity"].double()
    report = {}
    for item in args.runs:
        name, path = item.split("=", 1)
        try:
            out = load_file(path)["velocity"].double()
        except FileNotFoundError:
            print(f"{name}: missing {path}")
            continue
        err = ((out - ref).norm() / ref.norm()).item()
        report[name] = err
        print(f"{name}: rel error {err:.3e}")
    if args.out_json:
        json.dump(report, open(args.out_json, "w"), indent=1)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--shape", choices=SHAPES, default="1.3b")
    m.add_argument("--layers", type=int)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--save", choices=["f32", "bf16"], default="f32")
    m.add_argument("--out", required=True)
    i = sub.add_parser("inputs")
    i.add_argument("--frames", type=int, default=21)
    i.add_argument("--size", default="832x480")
    i.add_argument("--tokens", type=int, default=512)
    i.add_argument("--timestep", type=float, default=700.0)
    i.add_argument("--seed", type=int, default=1)
    i.add_argument("--out", required=True)
    f = sub.add_parser("forward")
    f.add_argument("--model", required=True)
    f.add_argument("--inputs", required=True)
    f.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    f.add_argument("--repeats", type=int, default=2)
    f.add_argument("--out", required=True)
    f.add_argument("--out-json")
    c = sub.add_parser("compare")
    c.add_argument("--ref", required=True)
    c.add_argument("--out-json")
    c.add_argument("runs", nargs="+")
    args = p.parse_args()
    {"make": make, "inputs": inputs, "forward": forward, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
