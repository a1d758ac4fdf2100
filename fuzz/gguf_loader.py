#!/usr/bin/env python3
"""Fuzzes the GGUF loading path: ``load_model(model.gguf, mmproj.gguf)`` on a mutated file.

The input is one GGUF file. A text model (``general.type`` not "mmproj") loads with the committed
mmproj of its family as the second file; an mmproj loads after the committed text model of its
family. One input in four is paired with the other family's file (or, for a text model, loaded
alone), so that the pairing checks are fuzzed too. Each input goes through:

1. the file stage of ``load_model``, as ``arena_model.open_model_files`` runs it: the
   architecture dispatch (``text_architecture``), the text file opened and checked
   (``load_text_model_file``: header, keys, tensor table, offsets, shapes and dtypes, tokenizer,
   chat template), then the mmproj (``load_mmproj_file``: the same, its preprocessing, and the
   pair), and every tensor of the fuzzed file decoded (``state_dict``); the committed file of the
   pair is opened once and kept;
2. when that succeeds, for one input in 16 (by checksum, so a given input always does the same):
   the whole ``load_model`` (modules built from the checked configs, weights assigned). Building
   the modules costs twenty times the checks and depends only on values step 1 has validated.

Property: each input loads, or raises ``ModelFormatError`` / ``UnsupportedArchitectureError``
whose message names the fuzzed file. Any other exception is a finding (libFuzzer reports it as a
crash and saves the input); so is a hang (``-timeout``) or an allocation past ``-rss_limit_mb``.

    python fuzz/gguf_loader.py /tmp/gguf-corpus fuzz/corpus/gguf -runs=20000
"""
from __future__ import annotations

import logging
import zlib

import common  # puts the repository on sys.path
import gguf  # noqa: F401
import jinja2  # noqa: F401
import numpy  # noqa: F401
import tokenizers  # noqa: F401
import torch
from gguf_mutator import mutate

from conduit_rt.errors import ModelFormatError, UnsupportedArchitectureError
from conduit_rt.gguf_parser import read_string_keys
from conduit_rt.model_file import load_mmproj_file, load_text_model_file
from conduit_rt.models import load_model, text_architecture

common.instrument_packages("conduit_rt")

REFERENCE = common.CORPUS / "gguf"
TEXT = {"llava": REFERENCE / "llava-model.gguf", "qwen": REFERENCE / "qwen25-model.gguf"}
MMPROJ = {"llava": REFERENCE / "llava-mmproj.gguf", "qwen": REFERENCE / "qwen25-mmproj.gguf"}
INPUT = common.scratch_dir("gguf") / "input.gguf"
TYPED = (ModelFormatError, UnsupportedArchitectureError)
torch.set_num_threads(1)
logging.disable(logging.WARNING)


TEXT_FILES = {family: load_text_model_file(path) for family, path in TEXT.items()}
FULL_LOAD_EVERY = 16


def pair_for(data: bytes) -> tuple[str, str | None, str]:
    """(text path, mmproj path or None, the input's role: "text" or "mmproj") for this input."""
    try:
        found = read_string_keys(INPUT, ("general.type", "general.architecture"))
    except TYPED:
        found = {}
    family = "qwen" if found.get("general.architecture") == "qwen2vl" or b"merger" in data[:2048] else "llava"
    roll = zlib.crc32(data) % 8
    if roll in (0, 1):
        family = "qwen" if family == "llava" else "llava"
    if found.get("general.type") == "mmproj":
        return str(TEXT[family]), str(INPUT), "mmproj"
    return str(INPUT), None if roll == 2 else str(MMPROJ[family]), "text"


def load(data: bytes, text: str, mmproj: str | None, role: str) -> None:
    if role == "mmproj":
        load_mmproj_file(mmproj, TEXT_FILES["qwen" if text == str(TEXT["qwen"]) else "llava"]).state_dict()
    else:
        text_architecture(text)
        text_file = load_text_model_file(text)
        text_file.state_dict()
        if mmproj is not None:
            load_mmproj_file(mmproj, text_file)
    if zlib.adler32(data) % FULL_LOAD_EVERY == 0:
        load_model(text, mmproj)


def test_one_input(data: bytes) -> None:
    INPUT.write_bytes(data)
    text, mmproj, role = pair_for(data)
    try:
        load(data, text, mmproj, role)
    except TYPED as error:
        if str(INPUT) not in str(error):
            raise AssertionError(f"the error does not name the file {INPUT}: {error}") from error


if __name__ == "__main__":
    common.run(test_one_input, mutate)
