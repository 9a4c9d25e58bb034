"""With an image in the prompt the samples follow the target's law; an image sent to a
text-only model is refused (``no_vision``); a text-only load never imports mlx-vlm, and a
VLM without mlx-vlm installed gets one line saying what to install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from reference import next_logits

from dflash_mlx import generate, load
from dflash_mlx.decoding.acceptance import SamplingParams, target_probs
from dflash_mlx.decoding.loop import DecodeOptions, decode
from dflash_mlx.prompts import request_ids
from dflash_mlx.settings import GenerationConfig
from dflash_mlx.vision.images import ImageError

ROOT = Path(__file__).resolve().parents[2]
MSGS = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Name it."}]}]
EOS = 3


def law(path, image: bytes, params) -> dict:
    """Exact joint law of the first two tokens (an EOS first ends it), by enumeration
    through mlx-vlm's model."""
    out = {}
    p0 = np.array(target_probs(next_logits(path, MSGS, [image], []), params)[0])
    for t0 in np.flatnonzero(p0):
        if t0 == EOS:
            out[(EOS, -1)] = float(p0[t0])
            continue
        p1 = np.array(target_probs(next_logits(path, MSGS, [image], [int(t0)]), params)[0])
        for t1 in np.flatnonzero(p1):
            out[(int(t0), int(t1))] = float(p0[t0] * p1[t1])
    return out


def test_sampling_with_an_image_follows_the_target_law(tiny_vlm_dir, images):
    model, tok = load(str(tiny_vlm_dir[0]), drafter=str(tiny_vlm_dir[1]))
    params = SamplingParams(1.0, 1.0, 0.0, 3)  # top-3: a law small enough to enumerate
    exact = law(tiny_vlm_dir[0], images[2], params)
    cfg = GenerationConfig(temperature=1.0, top_k=3, max_tokens=2)
    ids, _, vision = request_ids(model, tok, MSGS, cfg, images=[images[2]])  # one encoding
    samples, trials = [], 160
    for seed in range(trials):
        run = DecodeOptions(max_tokens=2, block_size=4, key=mx.random.key(seed), vision=vision)
        out = [t for c in decode(model, ids, model.make_cache(), params, run) for t in c.tokens]
        out = out[: out.index(EOS) + 1] if EOS in out else out
        samples.append(tuple(out[:2]) if out[0] != EOS else (EOS, -1))
    keys = sorted(set(exact) | set(samples))
    emp = np.array([samples.count(k) / trials for k in keys])
    tv = 0.5 * np.abs(emp - np.array([exact.get(k, 0.0) for k in keys])).sum()
    assert all(k in exact for k in samples)  # nothing drawn that the law rules out
    assert tv < 0.15, (tv, exact)


def test_an_image_to_a_text_only_model_is_refused(small_vocab_pair, images):
    with pytest.raises(ImageError) as e:
        generate(small_vocab_pair, None, "hi", images=[images[0]])
    assert e.value.kind == "no_vision"
    assert str(e.value).startswith("this model takes no images (")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    cmd = [sys.executable, "-c", code]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)


def test_a_text_only_load_never_imports_mlx_vlm(tmp_path):
    code = (
        "import sys\nfrom tiny_models import build_target, build_drafter\n"
        f"t = build_target('{tmp_path}/t', 'qwen3_5')\n"
        f"d = build_drafter('{tmp_path}/d', t, block_size=4)\n"
        "import dflash_mlx\nm, tok = dflash_mlx.load(str(t), drafter=str(d))\n"
        "dflash_mlx.generate(m, tok, 'hi', max_tokens=2)\n"
        "assert 'mlx_vlm' not in sys.modules, 'mlx_vlm imported'\nprint('ok')\n"
    )
    r = _python(code)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_a_vlm_without_mlx_vlm_says_what_to_install(tiny_vlm_dir):
    code = (
        "import sys\nsys.modules['mlx_vlm'] = None  # as if it were not installed\n"
        "import dflash_mlx\nfrom dflash_mlx.errors import DFlashError\n"
        f"try:\n    dflash_mlx.load('{tiny_vlm_dir[0]}', drafter='{tiny_vlm_dir[1]}')\n"
        "except DFlashError as e:\n    print('error:', e)\n"
    )
    r = _python(code)
    assert r.stdout.strip() == (
        "error: this is a vision-language model; pip install 'dflash-mlx[vision]'"
    ), r.stderr[-2000:]


def test_kv_bits_on_a_vlm_is_refused_not_ignored(tiny_vlm_dir, images):
    from dflash_mlx.errors import DFlashError

    model, tok = load(str(tiny_vlm_dir[0]), drafter=str(tiny_vlm_dir[1]))
    with pytest.raises(DFlashError, match="kv_bits is not supported on a vision-language"):
        generate(model, tok, "hi", images=[images[0]], kv_bits=8, max_tokens=2)


class _Group:
    """A fake group of ``n`` ranks (as tests/distributed/test_sharded.py's)."""

    def __init__(self, n=2):
        self.n = n

    def size(self):
        return self.n

    def rank(self):
        return 0


def test_a_vlm_that_cannot_split_over_the_ranks_is_refused_in_one_line(tiny_vlm_dir, monkeypatch):
    """Across ranks a qwen3_5 VLM's language model is split by tensor parallelism
    (``vision.shard``; the two-rank run is tests/vision/test_ranks.py): heads that do not
    split, or pipeline parallelism, are one line before anything is split."""
    from dflash_mlx.distributed import handshake
    from dflash_mlx.errors import DFlashError

    # a fake group cannot sum: the start-up handshake (every rank alike) is not the point here
    monkeypatch.setattr(handshake, "check", lambda group, paths, argv=None: [])
    pair = (str(tiny_vlm_dir[0]), str(tiny_vlm_dir[1]))
    with pytest.raises(
        DFlashError,
        match=r"^this vision-language target's heads \(2 DeltaNet key, 4 DeltaNet value\) do not split over 3",
    ):
        load(pair[0], drafter=pair[1], group=_Group(3))
    with pytest.raises(DFlashError, match="^a vision-language target runs under mlx.launch with"):
        load(pair[0], drafter=pair[1], group=_Group(), shard="pipeline")
