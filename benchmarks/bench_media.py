"""Media layer timings: load_media vs a bare base64 decode of the same data URL, decoders (median of 7)."""

import base64
import io
import pickle
import statistics
import time

import av
import numpy as np
import soundfile as sf
from PIL import Image

from gymbridge.media import MediaItem, MediaPolicy, encode_data_url, load_media


def med(f, n=7):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


rng = np.random.default_rng(0)
arr = (rng.random((1080, 1920, 3)) * 255).astype(np.uint8)
rows = []
for fmt, mime in (("JPEG", "image/jpeg"), ("PNG", "image/png")):
    buf = io.BytesIO()
    opts = {"quality": 90} if fmt == "JPEG" else {"compress_level": 1}
    Image.fromarray(arr).save(buf, format=fmt, **opts)
    raw = buf.getvalue()
    url = encode_data_url(raw, mime)
    payload = url.split(",", 1)[1]
    base = med(lambda payload=payload: base64.b64decode(payload))
    name = f"{fmt.lower()} 1920x1080 ({len(raw) / 1e6:.1f} MB)"
    rows.append((f"{name} base64.b64decode (baseline)", base, 1.0))
    t = med(lambda url=url: load_media(url, "image"))
    rows.append((f"{name} load_media(data URL): bytes + header", t, t / base))
    item = load_media(url, "image")
    t = med(item.image)
    rows.append((f"{name} .image() full decode", t, t / base))
    t = med(lambda raw=raw: MediaItem.from_bytes(raw, "image").key)
    rows.append((f"{name} .key (sha256)", t, t / base))
    t = med(lambda item=item: pickle.loads(pickle.dumps(item, protocol=5)))
    rows.append((f"{name} pickle round trip of a loaded item", t, t / base))
big = encode_data_url(bytes(range(256)) * (15 * (1 << 20) // 256), "image/png")  # a 20 MiB data URL
base = med(lambda: base64.b64decode(big[22:]))
rows.append(("20 MiB data URL base64.b64decode (baseline)", base, 1.0))
t = med(lambda: MediaItem.from_ref(big, "image", MediaPolicy(max_encoded_bytes=64 << 20)), n=21)
rows.append(("20 MiB data URL MediaItem.from_ref (header only; goal < 1/500)", t, t / base))
buf = io.BytesIO()
with av.open(buf, "w", format="mp4") as c:
    s = c.add_stream("libx264", rate=30)
    s.width = s.height = 256
    s.pix_fmt = "yuv420p"
    for i in range(300):
        frame = av.VideoFrame.from_ndarray(np.full((256, 256, 3), i % 256, np.uint8), format="rgb24")
        for p in s.encode(frame):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
v = MediaItem.from_bytes(buf.getvalue(), "video")
rows.append(("mp4 256x256, 10 s @ 30 fps: .video() at 2 fps -> [20,256,256,3]", med(v.video), float("nan")))
buf = io.BytesIO()
sf.write(buf, (0.1 * rng.standard_normal(16000 * 30)).astype(np.float32), 16000, format="FLAC")
a = MediaItem.from_bytes(buf.getvalue(), "audio")
rows.append(("flac 30 s @ 16 kHz: .audio()", med(a.audio), float("nan")))
print(f"{'operation':<66} {'ms':>8} {'x b64':>8}")
for k, ms, ratio in rows:
    print(f"{k:<66} {ms:8.3f} {ratio:8.3g}")
