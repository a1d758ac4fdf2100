"""``image_url`` parts -> image payloads the Runtime reads: ``data:`` URIs decoded, http(s) URLs
fetched with a timeout and a size limit, local paths and ``file://`` URLs only when the server
allows local files. Blocking (network): call it off the event loop."""
from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from .api_errors import ApiError


@dataclass(frozen=True, slots=True)
class ImageSource:
    """How images are reached: ``allow_local_files`` lets requests name files on the server;
    ``timeout_s`` and ``max_bytes`` bound an http(s) fetch (and a ``data:`` URI's size)."""

    allow_local_files: bool = False
    timeout_s: float = 10.0
    max_bytes: int = 20 << 20

    def resolve(self, messages: list[dict]) -> list[dict]:
        """The messages with every ``image_url`` part replaced by ``{"type": "image", "image": payload}``."""
        return [{**message, "content": [self._part(part) for part in message["content"]]}
                if isinstance(message["content"], list) else message for message in messages]

    def _part(self, part: dict) -> dict:
        if part["type"] != "image_url":
            return part
        return {"type": "image", "image": self.load(part["url"], part["param"])}

    def load(self, url: str, param: str) -> bytes | str:
        """The image at ``url``: its bytes, or a local path. ApiError 400 (``param``) when it cannot be had."""
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return self._data_uri(url, param)
        if scheme in ("http", "https"):
            return self._fetch(url, param)
        if scheme in ("file", "") or (len(scheme) == 1 and url[1:3] in (":\\", ":/")):  # a Windows drive letter
            if not self.allow_local_files:
                raise ApiError(400, "local image files are off on this server (start it with --allow-local-files); "
                               "send the image as a data: URI or an http(s) URL", param=param, code="invalid_image_url")
            return urllib.request.url2pathname(urllib.parse.urlsplit(url).path) if scheme == "file" else url
        raise ApiError(400, f"unsupported image URL scheme {scheme!r}: use a data: URI or an http(s) URL",
                       param=param, code="invalid_image_url")

    def _data_uri(self, url: str, param: str) -> bytes:
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ApiError(400, "an image data: URI must be base64: data:image/png;base64,...", param=param,
                           code="invalid_image_url")
        if len(payload) * 3 // 4 > self.max_bytes:
            raise ApiError(400, f"the image is larger than the server's limit of {self.max_bytes} bytes",
                           param=param, code="image_too_large")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "the image data: URI is not valid base64", param=param,
                           code="invalid_image_url") from None

    def _fetch(self, url: str, param: str) -> bytes:
        request = urllib.request.Request(url, headers={"User-Agent": "conduit-rt"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 (http(s) only)
                data = response.read(self.max_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise ApiError(400, f"could not fetch the image at {url}: {error}", param=param,
                           code="invalid_image_url") from None
        if len(data) > self.max_bytes:
            raise ApiError(400, f"the image at {url} is larger than the server's limit of {self.max_bytes} bytes",
                           param=param, code="image_too_large")
        return data
