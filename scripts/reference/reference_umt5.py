#!/usr/bin/env python3
"""The umT5 text encoder reference: transformers' UMT5EncoderModel on the same weights and
token ids as tpinfer (issue #30). Runs on any host with torch and transformers (CUDA for the
timings).

  make    [--layers N] [--seed S] --out DIR        random weights in umt5-xxl's shape, rounded
                                                   to bf16, saved in f32 as transformers saves them
  ids     --tokens L [--seed S] --out FILE         a prompt of L token ids (`ids`, u32 as i64)
  encode  --model DIR --ids FILE --dtype f32|bf16 --out FILE [--repeats N]
                                                   last hidden states `states` [L, 4096], f32
  compare --ref FILE [--out-json FILE] name=FILE ...   ‖x − ref‖ / ‖ref‖ of each run's states
"""
import argparse
import json
import time

import torch
from safetensors.torch import load_file, save_file

XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
           relative_attention_num_buckets=32, relative_attention_max_distance=128,
           layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu")


def make(args):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(args.seed)
    shape = dict(XXL)
    if args.layers:
        shape["num_layers"] = args.layers
    config = UMT5Config(**shape, is_encoder_decoder=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = UMT5EncoderModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norms away from their identity init and a bias table that matters; matrices at
            # T5's init scale (1/sqrt(fan-in)), so that 24 layers keep the states finite, and
            # the queries 1/sqrt(d_kv) smaller still, as T5 initialises them: T5 does not scale
            # its scores, and at 1/sqrt(fan-in) they come out with a standard deviation of 8,
            # a softmax so saturated that the encoder is chaotic (transformers' own bf16 run
            # then differs from its f32 one by 115%).
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "relative_attention_bias" in name:
                p.copy_(torch.randn_like(p))
            elif name.endswith(".q.weight"):
                p.copy_(torch.randn_like(p) / (p.shape[-1] * shape["d_kv"]) ** 0.5)
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.save_pretrained(args.out, safe_serialization=True)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B params")


def ids(args):
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(3, XXL["vocab_size"], (args.tokens,), generator=g)
    tokens[-1] = 1  # </s>
    save_file({"ids": tokens}, args.out)
    print(f"wrote {args.out}: {args.tokens} ids")


def encode(args):
    from transformers import UMT5EncoderModel

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = UMT5EncoderModel.from_pretrained(args.model, torch_dtype=dtype).to(device).eval()
    input_ids = load_file(args.ids)["ids"][None].to(device)
    times = []
    with torch.no_grad():
        for _ in range(args.repeats + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            states = model(input_ids=input_ids).last_hidden_state
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    save_file({"states": states[0].float().cpu().contiguous()}, args.out)
    times = sorted(times[1:]) or times
    print(f"transformers {args.dtype}: {input_ids.shape[1]} tokens in {times[len(times) // 2]:.2f} ms "
          f"(median of {len(times)})")


def compare(args):
    ref = load_file(args.ref)["states"].double()
    report = {}
    for item in args.runs:
        name, path = item.split("=", 1)
        out = load_file(path)["states"].double()
        err = ((out - ref).norm() / ref.norm()).item()
        report[name] = err
        print(f"{name}: rel error {err:.3e}")
    if args.out_json:
        json.dump(report, open(args.out_json, "w"), indent=1)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--layers", type=int)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", required=True)
    i = sub.add_parser("ids")
    i.add_argument("--tokens", type=int, default=512)
    i.add_argument("--seed", type=int, default=1)
    i.add_argument("--out", required=True)
    e = sub.add_parser("encode")
    e.add_argument("--model", required=True)
    e.add_argument("--ids", required=True)
    e.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("--ref", required=True)
    c.add_argument("--out-json")
    c.add_argument("runs", nargs="+")
    args = p.parse_args()
    {"make": make, "ids": ids, "encode": encode, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
