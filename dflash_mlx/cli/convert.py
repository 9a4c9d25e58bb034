"""``dflash convert``: a drafter checkpoint written again with its layers quantized (or
dense), in the released format plus MLX's quantization (docs/format.md §2.5)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..errors import DFlashError


def convert(
    drafter: str = typer.Option(
        ...,
        "--drafter",
        help="The drafter's directory (config.json, *.safetensors).",
        show_default=False,
    ),
    out: str = typer.Option(
        ...,
        "--out",
        help="Directory to write (created; must not hold a checkpoint).",
        show_default=False,
    ),
    draft_quant: str = typer.Option(
        "4", "--draft-quant", help="4 or 8 bits (MLX's quantization, group 64), or none (dense)."
    ),
):
    """Write a drafter checkpoint with its attention and MLP projections quantized, so it
    loads pre-quantized (or, with none, a pre-quantized one dense again)."""
    from ..model.config import parse_draft_quant

    bits = parse_draft_quant(draft_quant, "--draft-quant")
    if bits is None:
        raise DFlashError("--draft-quant auto has no meaning for convert; give 4, 8 or none")
    src, dest = Path(drafter), Path(out)
    if not (src / "config.json").is_file():
        raise DFlashError(f"--drafter {src} has no config.json; point to a drafter directory")
    if (dest / "config.json").exists() or (dest / "model.safetensors").exists():
        raise DFlashError(f"--out {dest} already holds a checkpoint; choose an empty directory")
    if dest.exists() and not dest.is_dir():
        raise DFlashError(f"--out {dest} is a file; choose a directory")
    import json

    from ..model import quantize
    from ..model.checkpoint import load_drafter, save_drafter

    model = load_drafter(src)
    config = json.loads((src / "config.json").read_text())
    if bits == 0:
        quantize.dequantize(model)
    save_drafter(dest, model, config, quantize=bits)
    size = sum(f.stat().st_size for f in dest.glob("*.safetensors"))
    what = f"{bits}-bit" if bits else "dense"
    print(f"wrote {dest} ({what} layers, {size / 1e6:.1f} MB)", file=sys.stderr, flush=True)
