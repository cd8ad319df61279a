"""`LlmSession`: one MNN-LLM bundle, generating text token by token.

MNN-LLM's own ``response()`` streams to C stdout and samples in C++; Skiff needs the
tokens in Python to stream them over gRPC, to stop on the caller's stop strings, to stop
at once when the caller goes away and to sample reproducibly from a seed. So the session
drives the model one step at a time, as FACTS.md measured: ``forward(prompt_ids)``
prefills the KV cache (kept inside MNN's Attention op) and returns the next-token logits,
then ``forward([token])`` per generated token; ``reset()`` clears the cache between
requests. Sampling, stop tokens and strings, incremental UTF-8 decoding and timing live
here, over a small `Engine` protocol, so they are tested without a model too.

Text is decoded from token *bytes* with an incremental UTF-8 decoder: a character split
across two tokens (byte-level BPE does that to emoji and CJK) is emitted whole, once
its last byte arrives. Text that may be the start of a stop string is held back until it
is known not to be one, so stop strings never leak into the output.
"""

from __future__ import annotations

import codecs
import enum
import functools
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from runtime.errors import InferenceError, InvalidInput, ModelLoadError
from runtime.llm.bundle import BundleDir, BundleInfo, validate_bundle

__all__ = [
    "MAX_NEW_TOKENS",
    "Delta",
    "Engine",
    "LlmSession",
    "MnnEngine",
    "Sampling",
    "StopReason",
    "Summary",
]

MAX_NEW_TOKENS = 1 << 16  # beyond any context MNN-LLM serves on a device
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 16, 256
# What a prompt may hold before it is tokenized (see LlmSession.encode).
MAX_BYTES_PER_TOKEN = 16
MAX_RUN = 2048
MAX_TEMPERATURE, MAX_TOP_K = 100.0, 1 << 20
_ROLES = ("system", "user", "assistant")
_PRECISIONS = ("low", "normal", "high")
_MEMORY = ("low", "normal", "high")


class StopReason(enum.Enum):
    """Why a generation ended."""

    EOS = "eos"  # the model produced a stop token
    STOP_STRING = "stop_string"  # the text reached one of the caller's stop strings
    MAX_TOKENS = "max_tokens"  # max_new_tokens were generated
    CONTEXT = "context"  # the context window is full
    CANCELLED = "cancelled"  # the caller asked to stop


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy (temperature 0) or seeded sampling.

    With ``temperature > 0`` the logits are divided by it, cut to the `top_k` most
    likely tokens (0: no cut) and to the smallest set whose probability reaches
    `top_p`, then one token is drawn with a numpy Generator seeded by `seed` (None: a
    fresh seed, so not reproducible). Out-of-range values raise InvalidInput.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        """Refuse NaN, infinities, negatives and absurd values, naming the parameter."""
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise InvalidInput(f"temperature must be a finite number, not {t!r}")
        if not 0.0 <= t <= MAX_TEMPERATURE:
            raise InvalidInput(f"temperature must be in [0, {MAX_TEMPERATURE:g}], not {t!r}")
        if isinstance(p, bool) or not isinstance(p, int | float) or not math.isfinite(p):
            raise InvalidInput(f"top_p must be a finite number, not {p!r}")
        if not 0.0 < p <= 1.0:
            raise InvalidInput(f"top_p must be in (0, 1], not {p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise InvalidInput(f"top_k must be an integer in [0, {MAX_TOP_K}], not {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 1 << 64):
            raise InvalidInput(f"seed must be an integer in [0, 2**64), not {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Tell whether the most likely token is always taken."""
        return self.temperature == 0.0


@dataclass(frozen=True)
class Summary:
    """What one generation did, for the caller and telemetry."""

    tokens_in: int
    tokens_out: int
    ttft_s: float  # request start to the first generated token (prefill + one sample)
    prefill_tps: float  # prompt tokens per second of prefill
    decode_tps: float  # generated tokens after the first, per second of decoding
    stop_reason: StopReason
    output_ids: tuple[int, ...] = ()  # every token generated, a final stop token included

    def to_dict(self) -> dict[str, Any]:
        """Return the summary as JSON-able data."""
        data = asdict(self)
        data.update(stop_reason=self.stop_reason.value, output_ids=list(self.output_ids))
        return data


@dataclass(frozen=True)
class Delta:
    """A piece of generated text; the last one of a generation carries its summary."""

    text: str
    summary: Summary | None = None


class Engine(Protocol):
    """What a session needs from a model (MNN-LLM, or a fake in tests)."""

    vocab_size: int  # ids at or past it are refused before they reach the model

    def encode(self, text: str) -> list[int]:
        """Tokenize text (no template)."""

    def token_bytes(self, token: int) -> bytes:
        """Return the bytes a token stands for (possibly part of a UTF-8 character)."""

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Append ids to the KV cache; return the next-token logits, shape [vocab]."""

    def reset(self) -> None:
        """Clear the KV cache."""

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Apply the chat template, ending with the assistant's turn opened."""

    def close(self) -> None:
        """Release the model."""


class LlmSession:
    """A loaded MNN-LLM bundle. One generation at a time (not thread-safe)."""

    def __init__(
        self,
        files: Mapping[str, int],
        *,
        threads: int = 1,
        precision: str = "low",
        memory: str = "low",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """Validate the bundle in `files` (name -> sealed memfd) and load it with MNN-LLM.

        `threads`, `precision` and `memory` are MNN's CPU settings. The descriptors stay
        the caller's and must stay open while the session lives. Raises InvalidBundle
        for a bundle Skiff refuses and ModelLoadError when MNN cannot load it.
        """
        if not _is_int(threads) or not 1 <= threads <= 256:
            raise InvalidInput(f"threads must be an integer in [1, 256], not {threads!r}")
        if precision not in _PRECISIONS:
            raise InvalidInput(f"precision must be one of {_PRECISIONS}, not {precision!r}")
        if memory not in _MEMORY:
            raise InvalidInput(f"memory must be one of {_MEMORY}, not {memory!r}")
        info = validate_bundle(files)
        from runtime.hardening import forbid_core_dumps

        forbid_core_dumps()  # this process holds the plaintext: no core file may carry it
        settings = {"thread_num": threads, "precision": precision, "memory": memory}
        engine = MnnEngine(files, info, settings)
        self._setup(engine, info, engine.stop_token_ids, clock)

    @classmethod
    def from_engine(
        cls,
        engine: Engine,
        info: BundleInfo,
        *,
        stop_token_ids: Sequence[int] = (),
        clock: Callable[[], float] = time.perf_counter,
    ) -> LlmSession:
        """Wrap an already loaded engine (a fake in tests, a worker's proxy)."""
        session = cls.__new__(cls)
        session._setup(engine, info, stop_token_ids, clock)
        return session

    def _setup(
        self,
        engine: Engine,
        info: BundleInfo,
        stop_token_ids: Sequence[int],
        clock: Callable[[], float],
    ) -> None:
        self._engine, self.info, self._clock = engine, info, clock
        self.stop_token_ids = frozenset(stop_token_ids)
        self.context_length = info.context_length

    # ------------------------------------------------------------ text

    @property
    def vocab_size(self) -> int:
        """Return how many tokens the model's vocabulary holds."""
        return self._engine.vocab_size

    def encode(self, text: str) -> list[int]:
        """Tokenize raw text (no chat template); refuse what the tokenizer cannot take.

        Empty or non-str text, text far longer than the context could hold (a token is
        rarely more than MAX_BYTES_PER_TOKEN bytes), and a run of more than MAX_RUN
        characters without whitespace: MNN-LLM's BPE takes quadratic time on such a run
        (8,000 letters: 1.6 s) and crashes on longer ones (16,383 "é": SIGSEGV).
        """
        if not isinstance(text, str) or not text:
            raise InvalidInput("prompt must be a non-empty string")
        limit = self.context_length * MAX_BYTES_PER_TOKEN
        if len(text) > limit:
            raise InvalidInput(
                f"the prompt has {len(text):,} characters: more than a context of "
                f"{self.context_length} tokens holds (at most {limit:,})"
            )
        run = _longest_run(text)
        if run > MAX_RUN:
            raise InvalidInput(
                f"the prompt has {run:,} characters in a row without a space (at most {MAX_RUN:,})"
            )
        return list(self._engine.encode(text))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Render chat messages with the bundle's template, the assistant's turn opened.

        `messages` are ``{"role": "system"|"user"|"assistant", "content": str}``.
        Raises InvalidInput for a bundle without a chat template (MNN-LLM would silently
        use ChatML, see `runtime.llm.bundle.chat_template`) and for malformed messages.
        """
        if self.info.chat_template is None:
            raise InvalidInput(
                "this model has no chat template (a base model): send a raw prompt instead"
            )
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise InvalidInput("messages must be a non-empty list")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
                raise InvalidInput(f"message {i} must have exactly 'role' and 'content'")
            if message["role"] not in _ROLES:
                raise InvalidInput(f"message {i}: role must be one of {_ROLES}")
            if not isinstance(message["content"], str):
                raise InvalidInput(f"message {i}: content must be a string")
            # The template's own turn markers inside a message would forge turns (a
            # "user" message that closes itself and opens a "system" one).
            for marker in _turn_markers(self.info.chat_template):
                if marker in message["content"]:
                    raise InvalidInput(
                        f"message {i}: its content holds the chat template's marker "
                        f"{marker!r}: a message cannot open or close turns"
                    )
        return self._engine.render_chat([dict(m) for m in messages])

    # ------------------------------------------------------------ generation

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop_strings: Sequence[str] = (),
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[Delta]:
        """Generate after `prompt_ids`, yielding text deltas; the last one has the summary.

        Stops at a stop token (EOS), at the first stop string (whose text is not
        emitted), after `max_new_tokens`, when the context is full, or within one token
        of `cancelled()` turning true (it is checked before every model step).
        Arguments are checked before the model runs (InvalidInput: empty prompt or one
        that leaves no room in the context, max_new_tokens outside [1, 65536], bad
        stop strings, ids outside the vocabulary); InferenceError if the model returns
        non-finite logits.
        """
        ids = self._check_prompt(prompt_ids)
        if not _is_int(max_new_tokens) or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
            raise InvalidInput(
                f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS}], "
                f"not {max_new_tokens!r}"
            )
        sampling = Sampling() if sampling is None else sampling  # greedy by default
        if not isinstance(sampling, Sampling):
            raise InvalidInput("sampling must be a Sampling")
        stops = _check_stop_strings(stop_strings)
        return self._generate(ids, max_new_tokens, sampling, stops, cancelled)

    def _generate(
        self,
        ids: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        stops: tuple[str, ...],
        cancelled: Callable[[], bool],
    ) -> Iterator[Delta]:
        clock, engine = self._clock, self._engine
        rng = None if sampling.greedy else np.random.default_rng(sampling.seed)
        text = _TextStream(stops)
        room = min(max_new_tokens, self.context_length - len(ids))
        start = clock()
        first_at = prefill_s = 0.0
        produced, reason, out_ids = 0, None, []
        engine.reset()
        try:
            step_input: list[int] = ids
            while True:
                if cancelled():
                    reason = StopReason.CANCELLED
                    break
                logits = engine.forward(step_input)
                token = _pick(logits, sampling, rng)
                if produced == 0:
                    first_at = clock()
                    prefill_s = first_at - start
                produced += 1
                out_ids.append(token)
                if token in self.stop_token_ids:
                    reason = StopReason.EOS
                    break
                out = text.push(engine.token_bytes(token))
                if text.stopped:
                    if out:
                        yield Delta(out)
                    reason = StopReason.STOP_STRING
                    break
                if out:
                    yield Delta(out)
                if produced >= room:
                    full = produced < max_new_tokens
                    reason = StopReason.CONTEXT if full else StopReason.MAX_TOKENS
                    break
                step_input = [token]
            end = clock()
        finally:
            engine.reset()  # a generator closed mid-way leaves no KV cache behind
        assert reason is not None
        summary = Summary(
            tokens_in=len(ids),
            tokens_out=produced,
            ttft_s=first_at - start if produced else 0.0,
            prefill_tps=len(ids) / prefill_s if prefill_s > 0 else 0.0,
            decode_tps=(produced - 1) / (end - first_at)
            if produced > 1 and end > first_at
            else 0.0,
            stop_reason=reason,
            output_ids=tuple(out_ids),
        )
        yield Delta(text.finish() if reason is not StopReason.STOP_STRING else "", summary)

    def logits(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits: row i predicts ``continuation_ids[i]``, shape [n, vocab].

        Runs the same prefill-then-one-token path as generation (so the figures hold
        for what the device serves): the prompt, then each continuation token but the
        last. Feed the result to `runtime.llm.scoring.score`.
        """
        ids = self._check_prompt(prompt_ids)
        rest = list(continuation_ids)
        if not rest:
            raise InvalidInput("continuation_ids must not be empty")
        self._check_prompt(rest)  # the same rules: integers inside the vocabulary
        if len(ids) + len(rest) > self.context_length:
            raise InvalidInput(
                f"prompt plus continuation ({len(ids) + len(rest)} tokens) exceed the "
                f"context length {self.context_length}"
            )
        rows = []
        self._engine.reset()
        try:
            rows.append(np.array(self._engine.forward(ids), dtype=np.float32))
            for token in rest[:-1]:
                rows.append(np.array(self._engine.forward([token]), dtype=np.float32))
        finally:
            self._engine.reset()
        return np.stack(rows)

    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        if isinstance(prompt_ids, str | bytes) or not isinstance(prompt_ids, Sequence):
            raise InvalidInput("prompt_ids must be a sequence of token ids")
        ids = list(prompt_ids)
        if not ids:
            raise InvalidInput("the prompt is empty")
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise InvalidInput("prompt_ids must be non-negative integers")
        vocab = self._engine.vocab_size
        if max(ids) >= vocab:
            raise InvalidInput(f"token id {max(ids)} is outside the vocabulary ({vocab} tokens)")
        if len(ids) >= self.context_length:
            raise InvalidInput(
                f"the prompt is {len(ids)} tokens; the context length is "
                f"{self.context_length} (prompt and answer together)"
            )
        return ids

    def close(self) -> None:
        """Release the model (and its load directory). Idempotent."""
        self._engine.close()

    def __enter__(self) -> LlmSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- helpers


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_stop_strings(stop_strings: Sequence[str]) -> tuple[str, ...]:
    if isinstance(stop_strings, str) or not isinstance(stop_strings, Sequence):
        raise InvalidInput("stop_strings must be a list of strings")
    if len(stop_strings) > MAX_STOP_STRINGS:
        raise InvalidInput(f"at most {MAX_STOP_STRINGS} stop strings, not {len(stop_strings)}")
    for s in stop_strings:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LENGTH:
            raise InvalidInput(f"each stop string must have 1 to {MAX_STOP_LENGTH} characters")
    return tuple(stop_strings)


def _pick(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator | None) -> int:
    """Pick the next token from one row of logits."""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    if not np.isfinite(row).all():
        raise InferenceError("the model produced NaN or infinite logits")
    if rng is None:
        return int(row.argmax())
    scaled = row / sampling.temperature
    candidates = np.arange(row.size)
    if 0 < sampling.top_k < row.size:
        candidates = np.argpartition(-scaled, sampling.top_k - 1)[: sampling.top_k]
    # Descending by logit, ties by id, so the draw depends on the seed alone.
    order = candidates[np.lexsort((candidates, -scaled[candidates]))]
    top = scaled[order]
    probs = np.exp(top - top[0])
    probs /= probs.sum()
    if sampling.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), sampling.top_p)) + 1
        probs = probs[:keep] / probs[:keep].sum()
        order = order[:keep]
    index = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return int(order[min(index, order.size - 1)])


class _TextStream:
    """Turn token bytes into text deltas: whole UTF-8 characters, stop strings held back."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = stops
        self._held = ""  # decoded text not yet emitted (may begin a stop string)
        self.stopped = False

    def push(self, data: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to emit."""
        self._held += self._decoder.decode(data)
        if not self._stops:
            out, self._held = self._held, ""
            return out
        hits = [i for i in (self._held.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._held = self._held[: min(hits)], ""
            return out
        keep = self._partial_stop_suffix()
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def finish(self) -> str:
        """Return what is left at the end (a trailing broken byte sequence as U+FFFD)."""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return out

    def _partial_stop_suffix(self) -> int:
        """Length of the longest end of the held text that starts some stop string."""
        held, best = self._held, 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(held)), best, -1):
                if held.endswith(stop[:n]):
                    best = n
                    break
        return best


# ---------------------------------------------------------------- MNN-LLM


class MnnEngine:
    """MNN-LLM loaded from a `BundleDir` of memfd symlinks; the `Engine` of real sessions.

    Every native call runs inside `native_output()`, so MNN's printf logging goes to the
    ``runtime.mnn`` logger and never to the app's stdout.
    """

    def __init__(
        self, files: Mapping[str, int], info: BundleInfo, settings: Mapping[str, Any]
    ) -> None:
        """Load the bundle with `settings` (thread_num, precision, memory)."""
        from runtime.mnn_host import load_mnn, native_output

        load_mnn()  # quiet import, phone-home guard installed
        from MNN import llm as mnn_llm

        self._quiet = native_output
        # Nothing may write the plaintext to disk: no mmap'ed weights or KV cache files.
        overrides = {
            **settings,
            "backend_type": "cpu",
            "use_mmap": False,
            "kvcache_mmap": False,
            "reuse_kv": False,
        }
        self._dir: BundleDir | None = BundleDir(files, overrides=overrides)
        try:
            with native_output() as log:
                self._llm = mnn_llm.create(self._dir.config_path)
                self._llm.set_config(json.dumps(overrides))  # the C object takes a string
                loaded = self._llm.load()
            # load() says False on failure; any other call after that may crash the process.
            if loaded is False:
                raise ModelLoadError(f"MNN-LLM could not load the bundle: {_last_line(log.text)}")
            # One step now: a graph that cannot run fails here, not on a user's request,
            # and the logits' width is the vocabulary size the prompts are checked against.
            self.vocab_size = int(self.forward([0]).shape[0])
            self.reset()
            self.stop_token_ids = _stop_tokens(files, info, self)
        except BaseException:
            self.close()
            raise

    def encode(self, text: str) -> list[int]:
        """Tokenize with the bundle's tokenizer."""
        with self._quiet():
            return list(self._llm.tokenizer_encode(text))

    def token_bytes(self, token: int) -> bytes:
        """Return one token's text as UTF-8 bytes."""
        with self._quiet():
            try:
                return self._llm.tokenizer_decode(int(token)).encode("utf-8")
            except UnicodeDecodeError as exc:
                # MNN hands back the token's raw bytes, which byte-level BPE may cut inside
                # a character; the binding's str conversion then fails, carrying them.
                return bytes(exc.object)

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        """Run ids through the model; return a copy of the last position's logits."""
        with self._quiet():
            var = self._llm.forward([int(t) for t in ids])
            if var is None:
                raise InferenceError("MNN-LLM returned no logits")
            logits = np.array(var.read(), dtype=np.float32)
        # A prefill may return a row per position ([1, n, vocab], measured with Skiff's
        # converted bundles: even n + 1 rows); the next token's logits are the last row.
        return logits.reshape(-1, logits.shape[-1])[-1].copy()

    def reset(self) -> None:
        """Clear the KV cache."""
        with self._quiet():
            self._llm.reset()

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Apply the bundle's chat template with MNN-LLM's own renderer."""
        with self._quiet():
            return str(self._llm.apply_chat_template(list(messages)))

    def close(self) -> None:
        """Drop the model and remove the load directory."""
        self._llm = None
        if self._dir is not None:
            self._dir.close()
            self._dir = None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no error message"


def _stop_tokens(files: Mapping[str, int], info: BundleInfo, engine: MnnEngine) -> set[int]:
    """Return the ids that end a generation.

    ``tokenizer.txt`` lists them in its header (line 2: counts of special, stop and
    prefix tokens; line 3: those ids); the chat template's ``eos`` string (in
    ``llm_config.json``'s ``jinja``) counts too when it is one token.
    """
    stops: set[int] = set()
    if info.tokenizer == "tokenizer.txt":
        head = os.pread(files["tokenizer.txt"], 1 << 16, 0).split(b"\n", 3)
        try:
            special, stop, _prefix = (int(x) for x in head[1].split()[:3])
            ids = [int(x) for x in head[2].split()]
            stops.update(ids[special : special + stop])
        except (IndexError, ValueError):
            pass
    jinja = {**info.config, **info.llm_config}.get("jinja")
    eos = jinja.get("eos") if isinstance(jinja, Mapping) else None
    if isinstance(eos, str) and eos:
        ids = engine.encode(eos)
        if len(ids) == 1:
            stops.add(ids[0])
    return stops


def _longest_run(text: str) -> int:
    """Return the length of the longest stretch of `text` without whitespace."""
    return max((len(word) for word in text.split()), default=0)


# Special-token markers as chat templates write them: <|im_start|>, <start_of_turn>,
# [INST], <|eot_id|>...
_MARKER = re.compile(r"<\|[^|<>\s]{1,40}\|>|<(?:start|end)_of_turn>|\[/?INST\]|</?s>")


@functools.lru_cache(maxsize=8)
def _turn_markers(template: str) -> tuple[str, ...]:
    """Return the special-token markers a chat template writes literally."""
    return tuple(sorted(set(_MARKER.findall(template))))
