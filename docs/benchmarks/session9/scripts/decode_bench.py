"""Host time of _decode_images for 8 recurring image files (JPEG, PNG; as paths and as bytes)."""
import io, os, tempfile, time, numpy as np, torch
from PIL import Image
"""Host time of a warm request's prologue on this machine (no model work): _request's parts."""
import time, torch, dataclasses, sys
from conduit_rt.bench import synthetic
from conduit_rt.bench.synthetic import Shape, SHAPES
from conduit_rt.models.random_init import random_llava
from conduit_rt.runtime import Runtime
import conduit_rt.runtime as R
from conduit_rt.chat import build_prompt, validate_messages
SHAPES["host"] = Shape(vocab=32064, hidden=64, intermediate=128, n_layers=32, n_heads=4, n_kv_heads=4,
    vision_hidden=32, vision_intermediate=64, vision_layers=1, vision_heads=4, image_size=336, patch_size=14)
text, vision = synthetic.llava_configs("host")
model = random_llava(text, vision, torch.device("cuda"), torch.bfloat16, seed=0)
rt = Runtime.from_model(model, kv_cache_bytes=1<<30, image_cache_bytes=256<<20)
images = synthetic.random_images(8, 336, seed=10)
second = synthetic.image_request(images, 19, 80, text.vocab_size, 2)
def t(label, f, n=30):
    f(); s=time.perf_counter()
    for _ in range(n): f()
    print("%-20s %.3f ms" % (label, (time.perf_counter()-s)/n*1e3))

rng = np.random.default_rng(0)
def photo(seed):  # smooth gradients + mild noise: photo-like sizes when encoded
    y, x = np.mgrid[0:336, 0:336]
    base = np.stack([(x + seed * 7) % 256, (y + seed * 13) % 256, ((x + y) // 2 + seed) % 256], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8))
tmp = tempfile.mkdtemp()
for fmt in ("JPEG", "PNG"):
    files, blobs = [], []
    for i in range(8):
        buf = io.BytesIO(); photo(i).save(buf, format=fmt, quality=90) if fmt == "JPEG" else photo(i).save(buf, format=fmt)
        blobs.append(buf.getvalue()); path = os.path.join(tmp, f"{i}.{fmt.lower()}"); open(path, "wb").write(buf.getvalue()); files.append(path)
    pil = [Image.open(io.BytesIO(b)) for b in blobs]
    for image in pil:
        image.load()
    for label, payloads in (("paths", files), ("bytes", blobs), ("PIL images", pil)):
        def cold():
            rt.decoded_images = type(rt.decoded_images)(rt.decoded_images.max_bytes)
            return rt._decode_images(payloads)
        def best(f, n=15):
            ts = []
            for _ in range(n):
                s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
            return sorted(ts)[n // 2] * 1e3
        c = best(cold); rt._decode_images(payloads); w = best(lambda: rt._decode_images(payloads))
        kb = sum(len(b) for b in blobs) / 8 / 1024
        print(f"{fmt} {label}: {kb:.0f} KiB a file; first sight {c:.2f} ms, recurring {w:.2f} ms (8 images, median)")
