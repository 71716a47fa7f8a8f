"""A terminal screenshot as a PNG: run a command in a tmux window of COLUMNS x ROWS, wait until its
screen shows WAIT_FOR, capture it with its colours (``tmux capture-pane -e``) and draw it in
DejaVu Sans Mono (shipped with matplotlib) with Pillow (a matplotlib dependency).

    python scripts/screenshot.py --size 80x24 --wait-for acme/chat-v1 --out docs/img/top-80x24.png \\
        -- kvstore top --url 127.0.0.1:7373
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid

import matplotlib
from PIL import Image, ImageDraw, ImageFont
from rich.color import Color
from rich.text import Text

BACKGROUND, FOREGROUND = (24, 24, 27), (228, 228, 231)
FONT = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "DejaVuSansMono.ttf")


def capture(command: list[str], columns: int, rows: int, wait_for: str, settle_s: float, timeout_s: float) -> str:
    tmux = ["tmux", "-L", f"kvstore-shot-{uuid.uuid4().hex[:8]}"]
    subprocess.run([*tmux, "new-session", "-d", "-x", str(columns), "-y", str(rows), " ".join(command)], check=True,
                   env={k: v for k, v in os.environ.items() if not k.startswith("TMUX")})
    try:
        deadline = time.monotonic() + timeout_s
        while wait_for not in subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True).stdout:
            if time.monotonic() > deadline:
                raise SystemExit(f"screenshot: {wait_for!r} never appeared")
            time.sleep(0.3)
        time.sleep(settle_s)
        return subprocess.run([*tmux, "capture-pane", "-p", "-e"], capture_output=True, text=True).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def rgb(color: Color | None, default: tuple[int, int, int]) -> tuple[int, int, int]:
    if color is None or color.is_default:
        return default
    triplet = color.get_truecolor()
    return (triplet.red, triplet.green, triplet.blue)


def draw(ansi: str, columns: int, rows: int, out: str, size: int = 15) -> None:
    font = ImageFont.truetype(FONT, size)
    bold = ImageFont.truetype(FONT.replace("Mono.ttf", "Mono-Bold.ttf"), size)
    cell_w = int(font.getlength("M"))   # whole pixels: a fractional cell leaves gaps in box-drawing lines
    cell_h = int(size * 1.35)
    pad = 12
    image = Image.new("RGB", (int(columns * cell_w) + 2 * pad, rows * cell_h + 2 * pad), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for row, line in enumerate(ansi.splitlines()[:rows]):
        text = Text.from_ansi(line)
        x = pad
        for span_text, style in _runs(text):
            fg = rgb(style.color if style else None, FOREGROUND)
            if style is not None and style.dim:
                fg = tuple(int(c * 0.6 + b * 0.4) for c, b in zip(fg, BACKGROUND))
            face = bold if style is not None and style.bold else font
            for char in span_text:   # one cell each: box-drawing glyphs are narrower than a cell
                pen.text((x, pad + row * cell_h), char, font=face, fill=fg)
                x += cell_w
    image.save(out)


def _runs(text: Text):
    """(text, style) runs of a rich Text, in order, unstyled gaps included."""
    plain = text.plain
    styles = [None] * len(plain)
    for span in text.spans:
        for i in range(span.start, min(span.end, len(plain))):
            style = span.style if not isinstance(span.style, str) else None
            styles[i] = style if styles[i] is None else styles[i] + style if style else styles[i]
    start = 0
    for i in range(1, len(plain) + 1):
        if i == len(plain) or styles[i] != styles[start]:
            yield plain[start:i], styles[start]
            start = i


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="80x24", help="COLUMNSxROWS")
    p.add_argument("--wait-for", required=True, help="text the screen must show before it is captured")
    p.add_argument("--settle", type=float, default=1.5, help="seconds to wait after it appears")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--out", required=True)
    p.add_argument("command", nargs="+")
    args = p.parse_args(argv)
    columns, rows = (int(n) for n in args.size.split("x"))
    ansi = capture(args.command, columns, rows, args.wait_for, args.settle, args.timeout)
    draw(ansi, columns, rows, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
