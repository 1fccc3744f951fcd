#!/usr/bin/env python3
"""The wav2vec2 speech encoder reference of S2V (issue #35): transformers' Wav2Vec2ForCTC as
Wan2.2-S2V loads it, on random weights, and the wan22 wheel's resampling of its hidden states
to the video's frames. Runs on any host with torch and transformers; the bucket step also
needs the wan22 wheel's `wan/modules/s2v/audio_encoder.py` (`--wan22 FILE`).

  make  --shape tiny|xlsr-53 [--seed S] --out DIR   random weights saved as transformers saves
                                                    them (config.json, model.safetensors)
  run   --model DIR --seconds T [--seed S] [--wan22 FILE] --out FILE [--dtype f32|bf16]
        the raw audio (`audio`, 16 kHz), every hidden state (`hidden_states` [layers + 1,
        frames, width]), and with --wan22 S2V's per-video-frame features at 16 fps for clips
        of 80 and of 16 frames (`bucket_80`, `bucket_16`: [frames, layers + 1, width])
  compare --ref FILE name=FILE ...   ‖x − ref‖ / ‖ref‖ of each run's `hidden_states`, over all
                                     states and per state

tests/fixtures/wav2vec2-tiny was written by
  make --shape tiny --seed 3 --out tests/fixtures/wav2vec2-tiny
  run --model tests/fixtures/wav2vec2-tiny --seconds 1.3 --seed 4 --wan22 .../audio_encoder.py \
      --out tests/fixtures/wav2vec2-tiny/reference.safetensors
"""
import argparse
import importlib.util
import sys
import types

import torch
from safetensors.torch import save_file

# jonatasgrosman/wav2vec2-large-xlsr-53-english, the encoder Wan2.2-S2V ships.
XLSR_53 = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
               conv_dim=[512] * 7, conv_kernel=[10, 3, 3, 3, 3, 2, 2], conv_stride=[5, 2, 2, 2, 2, 2, 2],
               num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16, vocab_size=33)
# Six heads split unevenly over 4 and 5 ranks; a last conv width unlike the hidden one; the
# real model's 320-sample hop (50 frames a second), which S2V's resampling assumes; an even
# positional kernel, whose last output the model drops.
TINY = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, intermediate_size=40,
            conv_dim=[16, 16, 24, 32], conv_kernel=[10, 4, 4, 4], conv_stride=[5, 4, 4, 4],
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=12)


def make(args):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(args.seed)
    shape = XLSR_53 if args.shape == "xlsr-53" else TINY
    config = Wav2Vec2Config(**shape, feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True,
                            hidden_act="gelu", feat_extract_activation="gelu", layer_norm_eps=1e-5)
    model = Wav2Vec2ForCTC(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norms and biases away from their identity init, so that a norm or bias read
            # wrong shows; matrices at 1/sqrt(fan-in).
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            elif "original0" in name:  # the positional conv's weight-norm magnitudes
                p.copy_(1.0 + 0.2 * torch.rand_like(p))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn_like(p) / fan_in ** 0.5)
    model.save_pretrained(args.out, safe_serialization=True)


def bucket_functions(path):
    # audio_encoder.py imports librosa for its file reading, which this script does not use.
    sys.modules.setdefault("librosa", types.ModuleType("librosa"))
    spec = importlib.util.spec_from_file_location("s2v_audio_encoder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(args):
    from transformers import Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC

    dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
    model = Wav2Vec2ForCTC.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    model = model.to(dtype)
    torch.manual_seed(args.seed)
    n = int(args.seconds * 16000)
    t = torch.arange(n, dtype=torch.float64) / 16000
    # A voiced-speech stand-in: a few harmonics with a drifting pitch, under noise.
    pitch = 140 + 30 * torch.sin(2 * torch.pi * 1.3 * t)
    phase = 2 * torch.pi * torch.cumsum(pitch, 0) / 16000
    audio = sum(0.3 / k * torch.sin(k * phase) for k in range(1, 6)) + 0.02 * torch.randn(n, dtype=torch.float64)
    audio = audio.float()
    # S2V's processor: zero mean, unit variance (Wav2Vec2Processor, do_normalize).
    extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                         do_normalize=True, return_attention_mask=True)
    values = extractor(audio.numpy(), sampling_rate=16000, return_tensors="pt").input_values
    with torch.no_grad():
        out = model(values.to(dtype), output_hidden_states=True)
    states = torch.cat(out.hidden_states).float()  # [layers + 1, frames, width]
    tensors = {"audio": audio.contiguous(), "hidden_states": states.contiguous()}
    if args.wan22:
        m = bucket_functions(args.wan22)
        feat = m.linear_interpolation(states, input_fps=50, output_fps=30)
        encoder = types.SimpleNamespace(video_rate=30)
        for frames in (80, 16):
            bucket, _ = m.AudioEncoder.get_audio_embed_bucket_fps(encoder, feat, fps=16, batch_frames=frames, m=0)
            tensors[f"bucket_{frames}"] = bucket.float().contiguous()
    save_file(tensors, args.out)
    print({k: list(v.shape) for k, v in tensors.items()})


def compare(args):
    from safetensors.torch import load_file

    ref = load_file(args.ref)["hidden_states"].double()
    for item in args.runs:
        name, path = item.split("=", 1)
        x = load_file(path)["hidden_states"].double()
        rel = lambda a, b: ((a - b).norm() / b.norm()).item()
        if x.shape != ref.shape:
            print(f"{name}: shape {list(x.shape)}, the reference's {list(ref.shape)}")
            continue
        per_state = [rel(x[i], ref[i]) for i in range(ref.shape[0])]
        print(f"{name}: rel {rel(x, ref):.3e} over all states, worst state {max(per_state):.3e}")
        # Where an error enters: each state's, and the first and last frames' of the first bad one.
        print("  per state: " + " ".join(f"{e:.1e}" for e in per_state))
        bad = next((i for i, e in enumerate(per_state) if e > 1e-3), None)
        if bad is not None:
            frames = [rel(x[bad, t], ref[bad, t]) for t in range(ref.shape[1])]
            off = [t for t, e in enumerate(frames) if e > 1e-3]
            print(f"  state {bad}: {len(off)} of {len(frames)} frames off, first {off[:5]}, last {off[-5:]}")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("--shape", choices=["tiny", "xlsr-53"], required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--out", required=True)
    rn = sub.add_parser("run")
    rn.add_argument("--model", required=True)
    rn.add_argument("--seconds", type=float, required=True)
    rn.add_argument("--seed", type=int, default=0)
    rn.add_argument("--wan22")
    rn.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    rn.add_argument("--out", required=True)
    cp = sub.add_parser("compare")
    cp.add_argument("--ref", required=True)
    cp.add_argument("runs", nargs="+")
    args = p.parse_args()
    {"make": make, "run": run, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
