"""The server's memory under image load, as issue 54's hostile pass measured it:

    python benchmarks/image_memory.py [--model demo [--drafter D]] [--concurrency 16] [--images 8]
        [--side 4096]

starts ``dflash serve`` (a text-only ``demo`` by default: every request is refused
``model_not_vision``, which must come before any pixel is decoded), sends ``--concurrency``
chat requests at once, each with ``--images`` PNG data URLs of ``--side`` x ``--side``
(one colour: a small body, a large canvas), and prints the server's resident memory before,
at its peak (VmHWM) and two seconds after, with the answers' status codes, as JSON. Before
the fix 16 x 8 images of 4096 x 4096 took a text-only server from 0.99 GB to 10.2 GB, kept.
Other load on the machine slows it but does not change the memory.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


def body(images: int, side: int) -> bytes:
    """A chat request with ``images`` PNG data URLs of side x side."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 90)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}] * images
    msg = {"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}]}
    return json.dumps({"messages": [msg], "max_tokens": 2}).encode()


def memory(pid: int) -> tuple[float, float]:
    """(resident GB now, peak resident GB) of a process."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return tuple(int(fields[k].split()[0]) / 1e6 for k in ("VmRSS", "VmHWM"))


def post(port: int, data: bytes, codes: list) -> None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=data,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            codes.append(str(r.status))
    except urllib.error.HTTPError as e:
        codes.append(f"{e.code} {json.loads(e.read())['error'].get('code')}")


def serve(model: str, drafter: str | None, images: int) -> tuple[subprocess.Popen, int]:
    """A ``dflash serve`` process on a free port, once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dflash_mlx.cli", "serve", "--model", model]
    cmd += ["--port", str(port), "--max-images", str(images)]
    cmd += ["--drafter", drafter] if drafter else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start in 10 minutes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--drafter", default=None, help="a vision-language target's drafter")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--side", type=int, default=4096)
    a = ap.parse_args()
    data = body(a.images, a.side)
    proc, port = serve(a.model, a.drafter, a.images)
    try:
        before, codes = memory(proc.pid)[0], []
        tic = time.perf_counter()
        threads = [
            threading.Thread(target=post, args=(port, data, codes)) for _ in range(a.concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took, peak = time.perf_counter() - tic, memory(proc.pid)[1]
        time.sleep(2)
        out = {
            "model": a.model,
            "concurrency": a.concurrency,
            "images": a.images,
            "side": a.side,
            "body_mb": round(len(data) / 1e6, 2),
            "rss_before_gb": round(before, 2),
            "peak_gb": round(peak, 2),
            "rss_after_gb": round(memory(proc.pid)[0], 2),
            "seconds": round(took, 1),
            "answers": sorted(set(codes)),
            "load_average": os.getloadavg()[0],
        }
        print(json.dumps(out))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
