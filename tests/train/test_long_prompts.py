"""Long-context prompts for measuring (and one day training) a drafter on long prompts:
held-out and train prompts come from different source files, at the lengths asked."""

import re

from dflash_mlx.train.prompts import LONG_REQUESTS, is_heldout, long_prompts


def fake_stdlib(root, n=60):
    for i in range(n):
        body = "".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(200))
        (root / f"mod{i}.py").write_text(body)
    return root


def test_long_prompts_grow_with_the_length_and_end_with_a_request(tmp_path):
    root = fake_stdlib(tmp_path)
    got = long_prompts("heldout", (100, 1000), per_length=2, root=root)
    assert len(got) == 4 and got == long_prompts("heldout", (100, 1000), 2, root)
    assert all(any(p.endswith(r) for r in LONG_REQUESTS) for p in got)
    short, long = len(got[0]), len(got[2])
    assert 300 < short < 400 + 200 and 3300 < long < 3500 + 200  # ~3.5 characters a token


def test_held_out_long_prompts_never_share_a_file_with_the_train_ones(tmp_path):
    root = fake_stdlib(tmp_path, 200)
    held = [f"mod{i}" for i in range(200) if is_heldout(f"mod{i}.py")]
    assert held  # the split holds some files (by a hash of the path)
    for split, inside in (("heldout", True), ("train", False)):
        for p in long_prompts(split, (300,), per_length=3, root=root):
            names = set(re.findall(r"^def f(\d+)_", p, re.MULTILINE))
            assert names and all((f"mod{n}" in held) == inside for n in names)
