"""Image prompts for tests: tiny PNGs and the OpenAI-style records that carry them."""

from __future__ import annotations

import base64
import io
from typing import Any

from PIL import Image


def png(color: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> bytes:
    """A one-colour PNG of ``size`` (width, height)."""
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def image_url(data: bytes) -> dict[str, Any]:
    """An OpenAI ``image_url`` part holding ``data`` as a data URI."""
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": uri}}


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


def user(*parts: dict[str, Any]) -> dict[str, Any]:
    """A one-turn record whose user turn is ``parts``."""
    return {"messages": [{"role": "user", "content": list(parts)}]}
