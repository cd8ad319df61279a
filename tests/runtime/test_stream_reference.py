"""The reference's pattern matching against the definition, by brute force.

The native engine is checked against the reference; this checks the reference's
incremental matcher against the literal definition in runtime.stream: a match is any
choice of earlier events of the key's stream, positions increasing, `->` steps
adjacent, first event no earlier than ts - within_ms.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.stream import StreamEngine
from runtime.stream_reference import ReferenceEngine, _step_matches
from runtime.stream_spec import CONTIGUOUS

from ._stream_helpers import batch

TYPES = ("a", "b", "c")


def fires_by_definition(spec, stream) -> bool:
    """Whether some match of `spec` ends at the last event of `stream` (a key's events)."""
    n, last = len(spec.steps), len(stream) - 1
    t = stream[last][0]
    for earlier in itertools.combinations(range(last), n - 1):
        positions = (*earlier, last)
        ok = all(
            _step_matches(step, stream[p][1], stream[p][2], stream[p][3])
            for step, p in zip(spec.steps, positions, strict=True)
        )
        ok = ok and all(
            positions[j] == positions[j - 1] + 1
            for j in range(1, n)
            if spec.steps[j].op == CONTIGUOUS
        )
        if ok and (spec.within_ms < 0 or stream[positions[0]][0] >= t - spec.within_ms):
            return True
    return False


steps = st.tuples(st.sampled_from(TYPES), st.sampled_from(("", "[v>0]", "[k!=1]")))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(steps, min_size=1, max_size=3),
    st.lists(st.sampled_from((" -> ", " ~> ")), min_size=2, max_size=2),
    st.none() | st.integers(0, 8),
    st.lists(
        st.tuples(
            st.integers(0, 3),
            st.integers(0, 5),
            st.integers(0, 2),
            st.integers(0, 1),
            st.integers(-1, 1),
        ),
        max_size=14,
    ),
)
def test_reference_matcher_is_the_definition(pattern_steps, ops, within, events) -> None:
    pattern = "".join(
        (ops[j - 1] if j else "") + name + cond for j, (name, cond) in enumerate(pattern_steps)
    )
    engine = StreamEngine(event_types=TYPES, key_fields=["k"], value_fields=["v"], lateness_ms=5)
    engine.add_trigger(pattern, by="k", within_ms=within)
    reference = ReferenceEngine(engine.config)
    reference.add_trigger(engine.triggers[0])
    ts, rows = 0, []
    for jump, behind, typ, key, value in events:
        ts += jump  # the watermark; events come up to `lateness` behind it
        rows.append((max(0, ts - behind), typ, [key], [float(value)]))
    fired = reference.push_batch(*batch(rows, 1, 1)).event_index.tolist()
    expected = []
    for i, (_, _, key, _) in enumerate(rows):
        stream = [(r[0], r[1], r[2], r[3]) for r in rows[: i + 1] if r[2] == key]
        if fires_by_definition(engine.triggers[0], stream):
            expected.append(i)
    assert fired == expected
