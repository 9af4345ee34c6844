"""Render a text capture of a terminal (tmux capture-pane -p) as a PNG: light text on a dark
background in DejaVu Sans Mono. Needs Pillow (any Python that has it; not a gpuctl dependency).

    python docs/capture_to_png.py docs/live-view.txt docs/live-view.png
"""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"


def render(text: str, out: Path, size: int = 15) -> None:
    font = ImageFont.truetype(FONT, size)
    lines = text.rstrip("\n").splitlines() or [""]
    left, top, right, bottom = font.getbbox("M")
    cell_w, cell_h = right - left, int((bottom - top) * 1.6)
    width = max(len(line) for line in lines) * cell_w + 2 * 16
    image = Image.new("RGB", (max(width, 200), len(lines) * cell_h + 2 * 12), (24, 26, 33))
    draw = ImageDraw.Draw(image)
    for row, line in enumerate(lines):
        draw.text((16, 12 + row * cell_h), line, font=font, fill=(220, 223, 228))
    image.save(out)


if __name__ == "__main__":
    render(Path(sys.argv[1]).read_text(), Path(sys.argv[2]))
