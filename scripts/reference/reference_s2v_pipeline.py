#!/usr/bin/env python3
"""Speech-to-video end to end (issue #35): a tiny random Wan2.2-S2V checkpoint in the official
layout, and the wan22 wheel's `WanS2V.generate` loop run on it with the wheel's own modules,
the reference for `tpinfer generate --model S2V_DIR --audio --image`.

  make:   the checkpoint: config.json and diffusion_pytorch_model.safetensors (the S2V DiT,
          original names), models_t5_umt5-xxl-enc-bf16.pth (Wan's T5Encoder, bf16 as shipped),
          google/umt5-xxl/tokenizer.json (a Unigram tokenizer appending </s>), Wan2.1_VAE.pth
          (Wan's WanVAE_ at base width 4), wav2vec2-large-xlsr-53-english/ (a 24-layer
          Wav2Vec2ForCTC, so 25 states as S2V reads them); and the inputs: speech.wav (1.5 s of
          a voiced stand-in at 16 kHz: two clips of 16 frames), face.png, init.safetensors
          (`latents`, each clip's starting noise [clips, 16, 4, 8, 8]) and pose.mp4 (40 frames
          of H.264 with B-frames, as libx264 writes by default).
  run:    WanS2V.generate's loop as the wheel writes it (wan/speech2video.py), on the CPU in f32
          (or --device cuda --dtype bf16 as generate runs it, each stage timed):
          the prompt and S2V's default negative prompt through the T5, the speech through
          wav2vec2 and the wheel's own resampling to frames, the reference image resized and
          cropped by torchvision and encoded, each clip denoised by UniPC with guidance (the
          negative prompt, silent audio), decoded after the reference (first clip, cut by
          three frames) or motion latents, the last 73 frames re-encoded as the next clip's
          motion. With --pose-video, each clip's poses as `WanS2V.load_pose_cond` reads them
          (its own code, PyAV's decoder in decord's place). Writes the frames [frames, 3, H, W]
          in 8 bits.
  compare: tpinfer's --save-frames PNGs (or a `run --out` file) against the reference's frames,
          in 8-bit.
  full:   the rest of the official layout at the published sizes, beside a DiT that
          reference_s2v_speed.py made: Wan's umT5-XXL T5Encoder (bf16 .pth), Wan2.1's VAE
          (.pth), wav2vec2-large-xlsr-53's shape, this script's tokenizer; random weights made
          on the GPU. And inputs: SECONDS of speech and a reference image of WIDTHxHEIGHT.

  python reference_s2v_pipeline.py make --wan22 DIR --out PIPE --inputs IN
  python reference_s2v_pipeline.py run --wan22 DIR --model PIPE --inputs IN --steps 2 --out ref.st
  python reference_s2v_pipeline.py run --wan22 DIR --model PIPE --inputs IN --steps 2 --pose-video IN/pose.mp4 \
      --out ref_pose.st
(tests/fixtures/s2v-pipeline holds PIPE as model/, IN as inputs/, ref.st as reference.safetensors and
ref_pose.st as reference_pose.safetensors.)
  tpinfer generate --model PIPE --audio IN/speech.wav --image IN/face.png --prompt "a person talks" \
      --size 64x64 --frames 16 --steps 2 --init-latents IN/init.safetensors --save-frames frames --out v.mp4
  python reference_s2v_pipeline.py compare --ref ref.st --frames frames
"""
import argparse
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types
import wave

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from wan22_modules import import_wan22

PROMPT = "a person talks"
FRAMES, SIZE, SECONDS, STEPS, GUIDE, SHIFT = 16, 64, 1.5, 2, 4.5, 3.0
MOTION, LAT_MOTION = 73, 19
T5 = dict(vocab=0, dim=32, dim_attn=32, dim_ffn=48, num_heads=4, num_layers=2, num_buckets=8)
DIT = {
    "_class_name": "WanModel_S2V", "model_type": "s2v",
    "dim": 64, "ffn_dim": 128, "freq_dim": 32, "num_heads": 4, "num_layers": 3,
    "in_dim": 16, "out_dim": 16, "text_dim": 32, "text_len": 512, "patch_size": [1, 2, 2],
    "audio_dim": 32, "num_audio_token": 4, "cond_dim": 16, "audio_inject_layers": [0, 2],
    "enable_adain": True, "adain_mode": "attn_norm", "enable_framepack": True,
    "framepack_drop_mode": "padd", "enable_motioner": False, "zero_timestep": True,
    "zero_init": False, "add_last_motion": True, "trainable_token": False,
    "enable_tsm": False, "motion_frames": 73, "window_size": [-1, -1],
    "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
}
WAV2VEC2 = dict(hidden_size=32, num_hidden_layers=24, num_attention_heads=2, intermediate_size=48,
                conv_dim=[16] * 7, conv_kernel=[10, 3, 3, 3, 3, 2, 2], conv_stride=[5, 2, 2, 2, 2, 2, 2],
                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=12)
# Wan2_1_VAE's normalisation (wan/modules/vae2_1.py).
MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
        0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
       3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]
# S2V's default negative prompt (wan/configs/wan_s2v_14B.py, sample_neg_prompt).
NEGATIVE = ("画面模糊，最差质量，画面模糊，细节模糊不清，情绪激动剧烈，手快速抖动，字幕，丑陋的，残缺的，多余的手指，"
            "画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，"
            "背景人很多，倒着走")


def wheel(root, name):
    # t5.py takes `device=torch.cuda.current_device()` as a default argument, at import.
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    return import_wan22(root, name)


def tokenizer_json():
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [["<pad>", 0.0], ["</s>", 0.0], ["<unk>", 0.0], ["\u2581", -2.0]]
    pieces += [[c, -3.0] for c in letters] + [["\u2581" + c, -2.5] for c in letters]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(["<pad>", "</s>", "<unk>"])],
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 0}},
                                    {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                           "special_tokens": {"</s>": {"id": "</s>", "ids": [1], "tokens": ["</s>"]}}},
        "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": True},
        "model": {"type": "Unigram", "unk_id": 2, "vocab": pieces, "byte_fallback": False},
    }


def randomize(module):
    """Every weight away from its init (S2V's zero inits, identity norms), so that each shows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ("norm" in name and p.dim() == 1) or "original0" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1 or name.endswith(".weights") or "padding_tokens" in name or "modulation" in name:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)


def make(args):
    torch.manual_seed(args.seed)
    out = args.out
    os.makedirs(os.path.join(out, "google", "umt5-xxl"), exist_ok=True)
    tok = tokenizer_json()
    with open(os.path.join(out, "google", "umt5-xxl", "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False)
    # The DiT.
    model_s2v = wheel(args.wan22, "modules.s2v.model_s2v")
    kwargs = {k: v for k, v in DIT.items() if k not in ("_class_name", "trainable_token", "motion_frames")}
    kwargs["window_size"], kwargs["patch_size"] = tuple(kwargs["window_size"]), tuple(kwargs["patch_size"])
    dit = model_s2v.WanModel_S2V(**kwargs).eval()
    randomize(dit)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(DIT, f, indent=1)
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()},
              os.path.join(out, "diffusion_pytorch_model.safetensors"))
    # Wan's T5, in bf16 as the official file is.
    t5 = wheel(args.wan22, "modules.t5")
    encoder = t5.T5Encoder(**{**T5, "vocab": len(tok["model"]["vocab"])}, shared_pos=False, dropout=0.0).eval()
    randomize(encoder)
    torch.save({k: v.to(torch.bfloat16) for k, v in encoder.state_dict().items()},
               os.path.join(out, "models_t5_umt5-xxl-enc-bf16.pth"))
    # Wan's VAE.
    vae = wheel(args.wan22, "modules.vae2_1")
    model = vae.WanVAE_(dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                        temperal_downsample=[False, True, True], dropout=0.0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(0.5 + torch.rand_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * (2 * torch.rand_like(p) - 1))
    torch.save(model.state_dict(), os.path.join(out, "Wan2.1_VAE.pth"))
    # wav2vec2.
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    config = Wav2Vec2Config(**WAV2VEC2, feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True,
                            hidden_act="gelu", feat_extract_activation="gelu", layer_norm_eps=1e-5)
    w2v = Wav2Vec2ForCTC(config)
    randomize(w2v)
    w2v.save_pretrained(os.path.join(out, "wav2vec2-large-xlsr-53-english"), safe_serialization=True)
    # The inputs.
    os.makedirs(args.inputs, exist_ok=True)
    n = int(SECONDS * 16000)
    t = torch.arange(n, dtype=torch.float64) / 16000
    pitch = 140 + 30 * torch.sin(2 * torch.pi * 1.3 * t)
    phase = 2 * torch.pi * torch.cumsum(pitch, 0) / 16000
    audio = sum(0.3 / k * torch.sin(k * phase) for k in range(1, 6)) + 0.02 * torch.randn(n, dtype=torch.float64)
    pcm = (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy()
    with wave.open(os.path.join(args.inputs, "speech.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(pcm.tobytes())
    from PIL import Image
    # At the frame's size: the resize is checked apart (crates/media/tests/picture.rs), and a
    # random VAE turns the resize's 1/255 steps into larger ones.
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    face = np.stack([(xx * 3) % 256, (yy * 2) % 256, ((xx + yy) * 5) % 256], -1).astype(np.uint8)
    Image.fromarray(face).save(os.path.join(args.inputs, "face.png"))
    lat = (FRAMES + 3 + MOTION) // 4 - LAT_MOTION
    save_file({"latents": torch.randn(2, 16, lat, SIZE // 8, SIZE // 8)}, os.path.join(args.inputs, "init.safetensors"))
    write_pose_video(os.path.join(args.inputs, "pose.mp4"))


def write_pose_video(path):
    """40 frames at 16 a second of a blob sweeping over a ramp, as libx264 writes H.264 by
    default (High profile, B-frames: frames stored out of display order)."""
    import av

    with av.open(path, "w") as out:
        stream = out.add_stream("libx264", rate=16, options={"crf": "10"})
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        yy, xx = np.mgrid[0:SIZE, 0:SIZE]
        for t in range(40):
            img = np.zeros((SIZE, SIZE, 3), np.uint8)
            cx, cy = 16 + t, 32 + int(10 * np.sin(t / 4))
            img[..., 0] = np.clip(255 - 6 * np.hypot(xx - cx, yy - cy), 0, 255)
            img[..., 1] = (xx * 2) % 256
            img[..., 2] = 40
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode())


def full(args):
    torch.manual_seed(args.seed)
    out, device = args.out, args.device
    os.makedirs(os.path.join(out, "google", "umt5-xxl"), exist_ok=True)
    with open(os.path.join(out, "google", "umt5-xxl", "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(), f, ensure_ascii=False)
    t5 = wheel(args.wan22, "modules.t5")
    with torch.device(device):
        encoder = t5.T5Encoder(vocab=256384, dim=4096, dim_attn=4096, dim_ffn=10240, num_heads=64, num_layers=24,
                               num_buckets=32, shared_pos=False, dropout=0.0).to(torch.bfloat16)
    torch.save({k: v.contiguous() for k, v in encoder.state_dict().items()},
               os.path.join(out, "models_t5_umt5-xxl-enc-bf16.pth"))
    del encoder
    vae = wheel(args.wan22, "modules.vae2_1")
    model = vae.WanVAE_(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                        temperal_downsample=[False, True, True], dropout=0.0)
    torch.save(model.state_dict(), os.path.join(out, "Wan2.1_VAE.pth"))
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    config = Wav2Vec2Config(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                            conv_dim=[512] * 7, conv_kernel=[10, 3, 3, 3, 3, 2, 2], conv_stride=[5, 2, 2, 2, 2, 2, 2],
                            num_conv_pos_embeddings=128, num_conv_pos_embedding_groups=16, vocab_size=33,
                            feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True)
    Wav2Vec2ForCTC(config).save_pretrained(os.path.join(out, "wav2vec2-large-xlsr-53-english"), safe_serialization=True)
    os.makedirs(args.inputs, exist_ok=True)
    n = int(args.seconds * 16000)
    t = torch.arange(n, dtype=torch.float64) / 16000
    phase = 2 * torch.pi * torch.cumsum(140 + 30 * torch.sin(2 * torch.pi * 1.3 * t), 0) / 16000
    audio = sum(0.3 / k * torch.sin(k * phase) for k in range(1, 6))
    pcm = (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy()
    with wave.open(os.path.join(args.inputs, "speech.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(pcm.tobytes())
    from PIL import Image
    width, height = map(int, args.image.split("x"))
    yy, xx = np.mgrid[0:height, 0:width]
    face = np.stack([(xx // 3) % 256, (yy // 2) % 256, ((xx + yy) // 4) % 256], -1).astype(np.uint8)
    Image.fromarray(face).save(os.path.join(args.inputs, "face.png"))


def bucket_module(root):
    stub_modules("librosa")
    spec = importlib.util.spec_from_file_location("s2v_audio_encoder", os.path.join(root, "wan/modules/s2v/audio_encoder.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


T5_XXL = dict(dim=4096, dim_attn=4096, dim_ffn=10240, num_heads=64, num_layers=24, num_buckets=32)


class Stages:
    """Seconds per stage, the device synchronised at each mark (the whole clip's timing)."""

    def __init__(self, device):
        self.device, self.seconds, self.last = device, {}, None

    def mark(self, name):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.last is not None:
            self.seconds[self.last[0]] = self.seconds.get(self.last[0], 0.0) + now - self.last[1]
        self.last = (name, now)

    def report(self):
        self.mark(None)
        for name, s in self.seconds.items():
            print(f"  {name}: {s:.2f} s")
        print(f"  total: {sum(self.seconds.values()):.2f} s")


def stub_modules(*names):
    """Empty modules for the wheel's imports that these scripts never call (its audio file
    reader, its video reader)."""
    for name in names:
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.VideoReader = None
            sys.modules[name] = module


def pose_latents(args, clips, frames, H, W, vae, scale, dev, dtype):
    """`WanS2V.load_pose_cond` itself, each clip's pose latents, with decord's reader replaced
    by PyAV's (ffmpeg's decoder, as decord's) picking the same frames."""
    import av

    stub_modules("librosa", "decord")
    s2v = wheel(args.wan22, "speech2video")

    def read_last_n_frames(video_path, n_frames, target_fps=16, reverse=False):
        with av.open(video_path) as container:
            stream = container.streams.video[0]
            original_fps = float(stream.average_rate)
            decoded = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        interval = max(1, round(original_fps / target_fps))
        start = 0 if reverse else max(0, len(decoded) - (n_frames - 1) * interval - 1)
        picked = [start + i * interval for i in range(n_frames) if start + i * interval < len(decoded)]
        return np.stack([decoded[i] for i in picked])

    def encode(videos):
        return [vae.encode(v.unsqueeze(0).float(), scale)[0] for v in videos]

    this = types.SimpleNamespace(read_last_n_frames=read_last_n_frames, fps=16, param_dtype=dtype, device=dev,
                                 vae=types.SimpleNamespace(encode=encode))
    return [c[0].to(dev, dtype) for c in s2v.WanS2V.load_pose_cond(this, args.pose_video, clips, frames, (H, W))]


def run(args):
    from PIL import Image
    from tokenizers import Tokenizer
    from torchvision import transforms
    from transformers import Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC

    pipe, inputs = args.model, args.inputs
    W, H = map(int, args.size.split("x"))
    frames, dev = args.frames, torch.device(args.device)
    # As the wheel's `generate` runs in bf16: the T5 in bf16, the DiT's weights in bf16 under
    # autocast, the VAE in f32 on the device, wav2vec2 in f32 on the CPU (AudioEncoder's default).
    bf16 = args.dtype == "bf16"
    wide = torch.bfloat16 if bf16 else torch.float32
    with torch.no_grad():
        # The weights, loaded before the clock starts.
        t5 = wheel(args.wan22, "modules.t5")
        tok = Tokenizer.from_file(os.path.join(pipe, "google", "umt5-xxl", "tokenizer.json"))
        state = torch.load(os.path.join(pipe, "models_t5_umt5-xxl-enc-bf16.pth"), map_location=dev)
        vocab, dim = state["token_embedding.weight"].shape
        shape = T5_XXL if dim == T5_XXL["dim"] else T5
        with dev:
            encoder = t5.T5Encoder(**{**shape, "vocab": vocab}, shared_pos=False, dropout=0.0).eval().to(wide)
        encoder.load_state_dict({k: v.to(wide) for k, v in state.items()})
        del state
        w2v = Wav2Vec2ForCTC.from_pretrained(os.path.join(pipe, "wav2vec2-large-xlsr-53-english")).eval()
        vae_module = wheel(args.wan22, "modules.vae2_1")
        vae_state = torch.load(os.path.join(pipe, "Wan2.1_VAE.pth"), map_location=dev)
        with dev:
            vae = vae_module.WanVAE_(dim=vae_state["encoder.conv1.weight"].shape[0], z_dim=16, dim_mult=[1, 2, 4, 4],
                                     num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True],
                                     dropout=0.0).eval()
        vae.load_state_dict(vae_state)
        scale = [torch.tensor(MEAN, device=dev), 1.0 / torch.tensor(STD, device=dev)]
        model_s2v = wheel(args.wan22, "modules.s2v.model_s2v")
        config = json.load(open(os.path.join(pipe, "config.json")))
        kwargs = {k: v for k, v in config.items() if k not in ("_class_name", "trainable_token", "motion_frames")}
        kwargs["window_size"], kwargs["patch_size"] = tuple(kwargs["window_size"]), tuple(kwargs["patch_size"])
        with dev:
            dit = model_s2v.WanModel_S2V(**kwargs).eval().to(wide)
        dit.load_state_dict(load_file(os.path.join(pipe, "diffusion_pytorch_model.safetensors"), device=args.device))
        solvers = wheel(args.wan22, "utils.fm_solvers_unipc")
        init = os.path.join(inputs, "init.safetensors")
        noise = load_file(init)["latents"].to(dev) if os.path.exists(init) else None

        stages = Stages(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        stages.mark("encode the prompt and the negative")

        def encode_text(text):
            # Padded to the text length with its mask, as T5EncoderModel does, then cut.
            ids = tok.encode(" ".join(text.split())).ids[:512]
            padded = torch.tensor([ids + [0] * (512 - len(ids))], device=dev)
            mask = (torch.arange(512, device=dev) < len(ids)).unsqueeze(0).long()
            return encoder(padded, mask)[0, :len(ids)]

        context, context_null = encode_text(PROMPT), encode_text(NEGATIVE)
        # Speech, as extract_audio_feat and get_audio_embed_bucket_fps make it.
        stages.mark("encode the speech")
        with wave.open(os.path.join(inputs, "speech.wav")) as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
        audio = pcm.astype(np.float32) / 32768.0
        extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                             do_normalize=True, return_attention_mask=True)
        values = extractor(audio, sampling_rate=16000, return_tensors="pt").input_values
        states = torch.cat(w2v(values, output_hidden_states=True).hidden_states)
        m = bucket_module(args.wan22)
        feat = m.linear_interpolation(states, input_fps=50, output_fps=30)
        bucket, clips = m.AudioEncoder.get_audio_embed_bucket_fps(types.SimpleNamespace(video_rate=30), feat, fps=16,
                                                                  batch_frames=frames, m=0)
        audio_emb = bucket.unsqueeze(0).permute(0, 2, 3, 1).to(dev, wide)  # [1, layers, dim, frames]
        # The reference image, and (as `generate` does) the zero motion frames and the absent
        # pose video's -1 frames through the encoder.
        stages.mark("encode the image, motion and pose")
        image = np.array(Image.open(os.path.join(inputs, "face.png")).convert("RGB"))
        pic = transforms.CenterCrop((H, W))(transforms.Resize(min(H, W))(Image.fromarray(image)))
        ref_pixels = transforms.ToTensor()(pic).unsqueeze(1).unsqueeze(0).to(dev) * 2 - 1.0
        ref_latents = vae.encode(ref_pixels, scale)
        videos_last_frames = torch.zeros(1, 3, MOTION, H, W, device=dev)
        motion_latents = vae.encode(videos_last_frames, scale)
        clips = min(clips, args.clips)
        if args.pose_video:
            poses = pose_latents(args, clips, frames, H, W, vae, scale, dev, wide)
        else:
            pose_pixels = -torch.ones(1, 3, frames + 1, H, W, device=dev)
            poses = [(vae.encode(pose_pixels, scale)[:, :, 1:] * 0).to(wide)[0]] * clips
        lat = (frames + 3 + MOTION) // 4 - LAT_MOTION
        out = []
        autocast = torch.amp.autocast("cuda", dtype=torch.bfloat16, enabled=bf16 and dev.type == "cuda")
        for r in range(clips):
            stages.mark(f"clip {r + 1}: denoise")
            scheduler = solvers.FlowUniPCMultistepScheduler(num_train_timesteps=1000, shift=1,
                                                            use_dynamic_shifting=False)
            scheduler.set_timesteps(args.steps, device=dev, shift=SHIFT)
            if noise is not None:
                latents = noise[r].clone().to(wide)
            else:
                g = torch.Generator(device=dev).manual_seed(args.seed + r)
                latents = torch.randn(16, lat, H // 8, W // 8, device=dev, dtype=wide, generator=g)
            audio_input = audio_emb[..., r * frames:(r + 1) * frames]
            motion, pose = motion_latents, poses[r]
            with autocast:
                for t in scheduler.timesteps:
                    def velocity(ctx, audio_in):
                        return dit([latents], t=torch.stack([t]), context=[ctx], seq_len=None,
                                   cond_states=[pose], motion_latents=[motion[0]], ref_latents=[ref_latents[0]],
                                   audio_input=audio_in, motion_frames=[MOTION, LAT_MOTION],
                                   drop_motion_frames=r == 0)[0]
                    cond, uncond = velocity(context, audio_input), velocity(context_null, 0.0 * audio_input)
                    guided = uncond + GUIDE * (cond - uncond)
                    latents = scheduler.step(guided.unsqueeze(0), t, latents.unsqueeze(0),
                                             return_dict=False)[0].squeeze(0)
            stages.mark(f"clip {r + 1}: decode")
            before = ref_latents if r == 0 else motion_latents
            image = vae.decode(torch.cat([before, latents.unsqueeze(0).float()], dim=2), scale).clamp(-1, 1)
            image = image[:, :, -frames:]
            if r == 0:
                image = image[:, :, 3:]
            stages.mark(f"clip {r + 1}: encode the motion")
            overlap = min(MOTION, image.shape[2])
            videos_last_frames = torch.cat([videos_last_frames[:, :, overlap:], image[:, :, -overlap:]], dim=2)
            motion_latents = vae.encode(videos_last_frames, scale)
            out.append(image.cpu())
        frames_out = torch.cat(out, dim=2)[0].permute(1, 0, 2, 3).contiguous()
    print(f"{clips} clips of {args.steps} guided steps, frames {list(frames_out.shape)}, {args.dtype} on {dev}:")
    stages.report()
    if dev.type == "cuda":
        print(f"  peak allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    if args.out:
        # In 8 bits, rounded as diffusers' video processor rounds.
        frames8 = ((frames_out / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        save_file({"frames": frames8}, args.out)


def compare(args):
    from PIL import Image

    ref8 = load_file(args.ref)["frames"].float()
    if os.path.isfile(args.frames):
        got8 = load_file(args.frames)["frames"].float()
    else:
        names = sorted(n for n in os.listdir(args.frames) if n.endswith(".png"))
        got8 = torch.stack([torch.from_numpy(np.array(Image.open(os.path.join(args.frames, n)).convert("RGB")))
                            .permute(2, 0, 1).float() for n in names])
    # A video cut at the speech's end holds the reference's first frames; `--count` cuts both.
    count = min(got8.shape[0], args.count or got8.shape[0])
    got8, ref8 = got8[:count], ref8[:count]
    diff = (got8 - ref8).abs()
    # In [-1, 1], as the decoder writes them.
    rel = float((got8 - ref8).norm() / (ref8 / 127.5 - 1).norm() / 127.5)
    print(f"{got8.shape[0]} frames against the reference's: largest difference {int(diff.max())}/255, "
          f"mean {float(diff.mean()):.4f}/255, rel {rel:.3e}")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--wan22", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--inputs", required=True)
    m.add_argument("--seed", type=int, default=21)
    r = sub.add_parser("run")
    r.add_argument("--wan22", required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--inputs", required=True)
    r.add_argument("--steps", type=int, default=STEPS)
    r.add_argument("--out")
    r.add_argument("--device", default="cpu")
    r.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    r.add_argument("--size", default=f"{SIZE}x{SIZE}", help="WIDTHxHEIGHT of the frames")
    r.add_argument("--frames", type=int, default=FRAMES, help="frames per clip")
    r.add_argument("--clips", type=int, default=1 << 30, help="at most this many clips")
    r.add_argument("--seed", type=int, default=42, help="each clip's noise, without init.safetensors")
    r.add_argument("--pose-video", help="an MP4 of poses, read as load_pose_cond reads it")
    f = sub.add_parser("full")
    f.add_argument("--wan22", required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--inputs", required=True)
    f.add_argument("--seconds", type=float, default=6.0)
    f.add_argument("--image", default="832x480")
    f.add_argument("--device", default="cuda")
    f.add_argument("--seed", type=int, default=22)
    c = sub.add_parser("compare")
    c.add_argument("--ref", required=True)
    c.add_argument("--frames", required=True)
    c.add_argument("--count", type=int, help="compare the first COUNT frames")
    args = p.parse_args()
    {"make": make, "run": run, "compare": compare, "full": full}[args.cmd](args)


if __name__ == "__main__":
    main()
