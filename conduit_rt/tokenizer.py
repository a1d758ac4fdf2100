"""Text tokenizer (the ``tokenizers`` library over an embedded tokenizer.json) and streaming decode.

The GGUF carries the whole ``tokenizer.json`` as a string; ``TextTokenizer.from_json_str`` builds
the tokenizer from it exactly as written. Hugging Face's ``encode``/``decode`` are reproduced:
special tokens are added only when asked (the chat template already writes BOS where the model
wants one), ``add_bos_token``/``add_eos_token`` from tokenizer_config.json override the JSON's
post-processor as transformers does, and decoding skips special tokens by default.

``IncrementalDetokenizer`` turns token ids into text pieces as they arrive; the pieces join to
``decode(all ids)``, and a character split over byte-fallback tokens is held back until complete.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from conduit_rt.errors import ModelFormatError

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Plain one-character pieces tried, in order, as the decoding sentinel (see IncrementalDetokenizer).
_SENTINEL_CANDIDATES = ("a", "x", "e", "0", "A", "!", ".")


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    """The special tokens a chat template sees (``bos_token``, ``eos_token``, ...) by name."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None

    def as_template_vars(self) -> dict[str, str]:
        """Only the tokens that are set, as transformers' ``special_tokens_map`` gives them."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus the few settings transformers keeps beside it."""

    def __init__(
        self,
        backend: Tokenizer,
        special_tokens: SpecialTokens,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ) -> None:
        """``add_bos_token``/``add_eos_token`` None: the JSON's post-processor decides."""
        self.backend = backend
        self.special_tokens = special_tokens
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.bos_token_id = self._require_id(special_tokens.bos_token)
        self.eos_token_id = self._require_id(special_tokens.eos_token)

    def _require_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ModelFormatError(f"tokenizer: special token {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_json_str(
        cls,
        tokenizer_json: str,
        special_tokens: SpecialTokens,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ) -> TextTokenizer:
        """From the text of a ``tokenizer.json`` (as embedded in the GGUF)."""
        try:
            backend = Tokenizer.from_str(tokenizer_json)
        except Exception as error:  # the Rust side raises a bare Exception
            raise ModelFormatError(f"tokenizer.json cannot be parsed: {error}") from error
        return cls(backend, special_tokens, add_bos_token, add_eos_token)

    @classmethod
    def from_json_and_ids(
        cls,
        tokenizer_json: str,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ) -> TextTokenizer:
        """From a ``tokenizer.json`` text and special-token ids, as a GGUF stores them
        (``tokenizer.huggingface.json``, ``tokenizer.ggml.bos_token_id``, ...)."""
        backend = cls.from_json_str(tokenizer_json, SpecialTokens()).backend

        def token(token_id: int | None, name: str) -> str | None:
            if token_id is None:
                return None
            content = backend.id_to_token(int(token_id))
            if content is None:
                raise ModelFormatError(f"tokenizer: {name} id {token_id} is outside the vocabulary")
            return content

        special = SpecialTokens(
            token(bos_token_id, "bos_token"),
            token(eos_token_id, "eos_token"),
            token(unk_token_id, "unk_token"),
            token(pad_token_id, "pad_token"),
        )
        return cls(backend, special, add_bos_token, add_eos_token)

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> tuple[TextTokenizer, str | None]:
        """From a Hugging Face folder's tokenizer.json (as written) + tokenizer_config.json.

        transformers 5 rebuilds the pre-tokenizer/decoder of some classes (``LlamaTokenizerFast``
        with ``legacy: false`` gets a Metaspace "first" pre-tokenizer instead of the file's
        Prepend normalizer), so for parity with it a converter should embed
        ``AutoTokenizer.from_pretrained(folder).backend_tokenizer.to_str()`` rather than the file.

        Returns the tokenizer and the chat template found in tokenizer_config.json or
        chat_template.json/.jinja (None when there is none).
        """
        folder = Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        special = SpecialTokens(
            **{name: _token_content(config.get(name)) for name in SpecialTokens.__slots__}
        )
        tokenizer = cls.from_json_str(
            (folder / "tokenizer.json").read_text(encoding="utf-8"),
            special,
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=config.get("add_eos_token"),
        )
        return tokenizer, _find_chat_template(folder, config)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` BOS/EOS are added as transformers does."""
        if not add_special_tokens or (self.add_bos_token is None and self.add_eos_token is None):
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if self.add_eos_token and self.eos_token_id is not None:
            ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one completion."""
        return IncrementalDetokenizer(self, skip_special_tokens)

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of the byte tokens ``<0x00>``..``<0xFF>`` of a BPE with byte fallback (else empty)."""
        model = json.loads(self.backend.model.__getstate__())
        if not model.get("byte_fallback"):
            return frozenset()
        ids = (self.backend.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
        return frozenset(token_id for token_id in ids if token_id is not None)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (what ``skip_special_tokens`` drops)."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(token_id for token_id, token in added.items() if token.special)

    def sentinel_id(self) -> int | None:
        """A plain token that decodes to one visible character on its own (None if none found)."""
        for text in _SENTINEL_CANDIDATES:
            token_id = self.backend.token_to_id(text)
            if token_id is None:
                continue
            if self.backend.decode([token_id, token_id], skip_special_tokens=False) == text + text:
                return token_id
        return None


def _find_chat_template(folder: Path, config: dict) -> str | None:
    """transformers 5 reads chat_template.jinja, then chat_template.json, then tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    json_file = folder / "chat_template.json"
    if json_file.exists():
        return json.loads(json_file.read_text(encoding="utf-8"))["chat_template"]
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((item["template"] for item in template if item.get("name") == "default"), None)
    return template


class IncrementalDetokenizer:
    """Streaming decode: ``push(token_id)`` returns the new text (maybe ""), ``flush()`` the rest.

    The ids not yet turned into text form a window, decoded whole at each push. Its text is
    emitted, and a new window started, once the text does not end in U+FFFD (a character whose
    bytes have not all arrived) and the last id is neither a byte-fallback token nor a skipped
    special token: tokenizers decodes a run of byte tokens all or nothing (one stray byte later
    turns the whole run into U+FFFD, and skipped specials do not break a run), so a run is only
    emitted once it has ended.

    Windows after the first are decoded behind a one-character sentinel token whose text is cut
    off: decoders that strip the leading space of the *first* token (Llama's Strip, Metaspace)
    then treat every window as the middle of the text, so the pieces join to
    ``decode(all ids)``. The first window stays open until it has produced some text, for the
    same reason. Each push decodes only the open window (a few ids), not the whole completion.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._sentinel = tokenizer.sentinel_id()
        self._sentinel_text = "" if self._sentinel is None else tokenizer.decode([self._sentinel], False)
        self._all_ids: list[int] = []
        self._window_start = 0
        self._num_emitted_chars = 0  # used only without a sentinel
        self._hold_ids = tokenizer.byte_fallback_ids | (
            tokenizer.special_ids if skip_special_tokens else frozenset()
        )
        if self._sentinel is None:
            logger.debug("no sentinel token found; streaming decodes from the start at every token")

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far."""
        return list(self._all_ids)

    def _window_text(self) -> str:
        if self._sentinel is None:  # slow but exact: decode everything, drop what was emitted
            return self._tokenizer.decode(self._all_ids, self._skip_special)[self._num_emitted_chars :]
        window = self._all_ids[self._window_start :]
        if self._window_start == 0:
            return self._tokenizer.decode(window, self._skip_special)
        text = self._tokenizer.decode([self._sentinel, *window], self._skip_special)
        return text[len(self._sentinel_text) :]

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the text it completes (empty while a character is split)."""
        self._all_ids.append(int(token_id))
        text = self._window_text()
        if text.endswith(REPLACEMENT_CHAR) or token_id in self._hold_ids:
            return ""  # a character (or a byte run) may still be incomplete
        if not text and self._window_start == 0:
            return ""
        return self._close_window(text)

    def _close_window(self, text: str) -> str:
        self._window_start = len(self._all_ids)
        self._num_emitted_chars += len(text)
        return text

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD here, as in decode)."""
        if self._window_start == len(self._all_ids):
            return ""
        return self._close_window(self._window_text())
