#!/usr/bin/env python3
"""S2V's reference image as the wan22 wheel prepares it (issue #35), for
crates/media/tests/data/s2v-image/: the frame size its `get_size_less_than_area` picks for images of
many sizes (sizes.json: [height, width, max_area, picked height, picked width]), and a test
image (PNG and JPEG) through torchvision's Resize(min(H, W)) and CenterCrop((H, W)) on the
PIL image, ToTensor, then * 2 - 1 (pixels.safetensors: `png` and `jpeg`, [3, H, W]), for a
size that crops and one that pads. The size function is the wheel's own source, taken from
wan/speech2video.py without importing the pipeline.

  python scripts/reference/reference_s2v_image.py --wan22 DIR --out crates/media/tests/data/s2v-image
"""
import argparse
import ast
import json
import math
import os

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from torchvision import transforms


def size_function(root):
    source = open(os.path.join(root, "wan", "speech2video.py")).read()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_size_less_than_area":
            module = ast.Module(body=[node], type_ignores=[])
            scope = {"math": math}
            exec(compile(module, "speech2video.py", "exec"), scope)
            return lambda h, w, area: scope["get_size_less_than_area"](None, h, w, target_area=area)
    raise SystemExit("get_size_less_than_area not found")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--wan22", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    pick = size_function(args.wan22)
    rng = np.random.default_rng(3)
    sizes = []
    areas = [832 * 480, 1280 * 720, 1024 * 704, 64 * 64]
    shapes = [(480, 832), (720, 1280), (1080, 1920), (1920, 1080), (512, 512), (61, 97), (3000, 200), (200, 3000)]
    shapes += [tuple(int(x) for x in rng.integers(16, 2500, 2)) for _ in range(40)]
    for area in areas:
        for h, w in shapes:
            ph, pw = pick(h, w, area)
            sizes.append([h, w, area, int(ph), int(pw)])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sizes.json"), "w") as f:
        json.dump(sizes, f)

    # A 61 x 97 test image: smooth gradients and a little texture, so that resampling shows.
    y, x = np.mgrid[0:61, 0:97]
    img = np.stack([
        127 + 120 * np.sin(x / 9.0) * np.cos(y / 7.0),
        255 * x / 96.0,
        127 + 100 * np.sin((x + y) / 5.0) + rng.integers(-20, 20, (61, 97)),
    ], -1).clip(0, 255).astype(np.uint8)
    png, jpeg = os.path.join(args.out, "face.png"), os.path.join(args.out, "face.jpg")
    Image.fromarray(img).save(png)
    Image.fromarray(img).save(jpeg, quality=95)
    pixels = {}
    # (48, 64) crops the width; (64, 48) pads the width of the resized image.
    for h, w in [(48, 64), (64, 48)]:
        for name, path in [("png", png), ("jpeg", jpeg)]:
            pic = Image.open(path).convert("RGB")
            fitted = transforms.CenterCrop((h, w))(transforms.Resize(min(h, w))(pic))
            pixels[f"{name}_{h}x{w}"] = (transforms.ToTensor()(fitted) * 2 - 1).contiguous()
    save_file(pixels, os.path.join(args.out, "pixels.safetensors"))
    print(len(sizes), "sizes;", {k: list(v.shape) for k, v in pixels.items()})


if __name__ == "__main__":
    main()
