"""Render report.html in headless Chromium: a screenshot, and a check that every plot drew."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def render(
    html_path: Path, screenshot: Path | None = None, timeout: int = 60, width: int = 1280
) -> tuple[int, int]:
    """(images rendered, images on the page) as Chromium saw them at ``width`` pixels; optionally
    a PNG screenshot. :func:`page_width` reads how wide the page laid itself out."""
    browser = find_chromium()
    if browser is None:
        raise FileNotFoundError("no Chromium found (Debian: apt-get install chromium)")
    url = html_path.resolve().as_uri()
    with tempfile.TemporaryDirectory() as profile:
        base = [
            browser,
            *FLAGS,
            f"--user-data-dir={profile}",
            "--virtual-time-budget=5000",
            f"--window-size={width},2200",
        ]
        dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=timeout)
        if screenshot is not None:
            subprocess.run(
                [*base, f"--screenshot={screenshot}", url],
                capture_output=True,
                timeout=timeout,
            )
    match = re.search(r'data-images-rendered="(\d+)/(\d+)"', dom.stdout)
    if not match:
        raise RuntimeError(f"Chromium did not render the page: {dom.stderr[-500:]}")
    global _last_width
    found = re.search(r'data-page-width="(\d+)"', dom.stdout)
    _last_width = int(found.group(1)) if found else None
    return int(match.group(1)), int(match.group(2))


_last_width: int | None = None


def page_width() -> int | None:
    """How wide (px) the last rendered page laid itself out; above the window means it overflows."""
    return _last_width
