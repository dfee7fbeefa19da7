"""Where an image comes from, in every front end's vocabulary, and reading it into a PIL image.

Chat content parts name images in several shapes: OpenAI's `image_url` (a data URL or a web address),
the Responses API's `input_image`, Anthropic's image block with a base64 `source`, LangChain's image blocks and
transformers' own `{"type": "image", "image": ...}`. `source_of` takes any of them to one source: a PIL image, an
array or tensor, raw bytes, or a URL string. `read_image` reads a source: images and bytes as they are, data URLs
decoded; web addresses and file paths are refused (the engine fetches nothing on a caller's behalf). A deployer may allow web
addresses on named hosts (`EngineConfig.allowed_image_domains`): those are fetched with a time and size limit,
following no redirect (which could lead anywhere). Every refusal is a ValueError naming the image.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.request
from collections.abc import Collection
from typing import Any
from urllib.parse import urlsplit

MAX_IMAGE_BYTES = 20 * 2**20  # an encoded image (what a data URL or bytes carry)
MAX_PIXELS = 50_000_000  # a decoded image; PIL's own guard against decompression bombs is close to it
FETCH_TIMEOUT_S = 10.0  # one fetch of an allowed web address, connection and reading

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def source_of(part: dict[str, Any]) -> Any:
    """The image a content part names, whichever front end's shape it has; ValueError when it names none."""
    for key in ("image_url", "image", "url"):
        value = part.get(key)
        if isinstance(value, dict):  # OpenAI's {"url": ..., "detail": ...}
            value = value.get("url")
        if value is not None:
            return value
    source = part.get("source")
    if isinstance(source, dict):  # Anthropic's {"type": "base64", "media_type", "data"} or {"type": "url", "url"}
        if source.get("type") == "base64":
            return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
        if source.get("url") is not None:
            return source["url"]
    data = part.get("base64", part.get("data") if part.get("source_type") == "base64" else None)
    if isinstance(data, str):  # LangChain's base64 image blocks
        return f"data:{part.get('mime_type', 'image/png')};base64,{data}"
    raise ValueError(f"an image part of type {part.get('type')!r} names no image (no url, data or image)")


def read_image(source: Any, name: str = "the image", allowed_domains: Collection[str] = ()) -> Any:
    """A PIL image (or the array or tensor given) from a source; ValueError naming `name` for what cannot be
    read. `allowed_domains`: the hosts whose http(s) addresses may be fetched."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image) or hasattr(source, "shape"):
        return source
    if isinstance(source, str):
        parts = urlsplit(source)
        allowed = parts.scheme in ("http", "https") and parts.hostname in allowed_domains
        source = fetch(source, name) if allowed else bytes_of_url(source, name)
    if not isinstance(source, (bytes, bytearray)):
        raise ValueError(f"{name}: expected a PIL image, an array, bytes or a data URL, got {type(source).__name__}")
    if len(source) > MAX_IMAGE_BYTES:
        raise ValueError(f"{name}: {len(source)} bytes, more than the {MAX_IMAGE_BYTES} an image may have")
    try:
        image = Image.open(io.BytesIO(source))
        if image.width * image.height > MAX_PIXELS:
            raise ValueError(f"{name}: {image.width}x{image.height} pixels, more than {MAX_PIXELS}")
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"{name}: not a readable image ({exc})") from None
    return image.convert("RGB") if image.mode not in ("RGB", "L") else image


def bytes_of_url(url: str, name: str) -> bytes:
    """A data URL's bytes; anything else refused."""
    if not url.startswith("data:"):
        raise ValueError(f"{name}: {shown(url)!r} is not a data URL; images are sent inline "
                         "(data:image/...;base64,...), and the engine fetches no file, nor a web address on a host "
                         "the deployer did not allow (allowed_image_domains)")
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ValueError(f"{name}: a data URL of an image must be base64 (data:image/...;base64,...)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"{name}: more than the {MAX_IMAGE_BYTES} bytes an image may have")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name}: its data URL is not valid base64") from None


class NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is refused: it could lead to a host the deployer did not allow."""

    def redirect_request(self, *args: Any) -> None:
        return None


def fetch(url: str, name: str) -> bytes:
    """An allowed web address's bytes, within FETCH_TIMEOUT_S and MAX_IMAGE_BYTES; ValueError otherwise."""
    opener = urllib.request.build_opener(NoRedirects)
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "paged-backend"}),
                         timeout=FETCH_TIMEOUT_S) as response:
            data = response.read(MAX_IMAGE_BYTES + 1)
    except (OSError, ValueError) as exc:  # URLError, HTTPError (a refused redirect too) and timeouts are OSErrors
        raise ValueError(f"{name}: fetching {shown(url)!r} failed: {exc}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{name}: {shown(url)!r} holds more than the {MAX_IMAGE_BYTES} bytes an image may have")
    return data


def shown(url: str) -> str:
    return url if len(url) <= 60 else url[:57] + "..."
