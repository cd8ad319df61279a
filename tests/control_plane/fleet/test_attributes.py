"""Canonical device attributes: normalisation, limits, stamped and attested ones, CLI flags."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contract import errors
from control_plane.fleet.attributes import (
    ATTESTED,
    STANDARD_KEYS,
    attested_attributes,
    effective_attributes,
    normalize_attributes,
    parse_attr_flags,
)

FULL = {
    "region": "eu",
    "custom": {"tier": "gold", "batch": "8"},
    "tags": ["beta", "alpha", "beta"],
    "platform": "android",
    "os_version": "14",
    "app_version": "5.2.1",
    "device_model": "Pixel 8 Pro",
    "soc": "tensor_g3",
    "ram_mb": 8192,
}


def test_standard_keys_are_the_documented_ones():
    assert STANDARD_KEYS == (
        "platform",
        "os_version",
        "app_version",
        "device_model",
        "soc",
        "ram_mb",
        "region",
        "tags",
    )


def test_normalize_full_device_gives_canonical_order_and_sorted_collections():
    out = normalize_attributes(FULL)
    assert list(out) == [*STANDARD_KEYS, "custom"]
    assert out["tags"] == ["alpha", "beta"]
    assert list(out["custom"].items()) == [("batch", "8"), ("tier", "gold")]
    assert out["ram_mb"] == 8192


def test_normalize_does_not_mutate_its_input():
    raw = {"tags": ["b", "a"], "custom": {"z": "1", "a": "2"}}
    normalize_attributes(raw)
    assert raw == {"tags": ["b", "a"], "custom": {"z": "1", "a": "2"}}


def test_empty_and_none_values_are_absent():
    raw = {"platform": "", "soc": None, "ram_mb": "", "custom": {"a": "", "b": None, "c": "x"}}
    assert normalize_attributes(raw) == {"custom": {"c": "x"}}


def test_empty_custom_is_absent_but_empty_tags_are_kept():
    # An empty tag list says "reports tags, has none", which `tags!=x` relies on.
    assert normalize_attributes({"custom": {}, "tags": []}) == {"tags": []}
    assert normalize_attributes({}) == {}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (0, 0),
        (2**31, 2**31),
        ("4096", 4096),
        ("0004096", 4096),
    ],
)
def test_ram_mb_accepts_ints_and_decimal_strings(raw, expected):
    assert normalize_attributes({"ram_mb": raw}) == {"ram_mb": expected}
    assert type(normalize_attributes({"ram_mb": raw})["ram_mb"]) is int


@pytest.mark.parametrize(
    "raw", [-1, 2**31 + 1, "2147483649", True, 4096.0, "4e3", " 12", "+5", "-5", "1_000", "١٢", []]
)
def test_ram_mb_rejects_other_values(raw):
    with pytest.raises(errors.InvalidArgument, match="'ram_mb' must be an integer from 0 to"):
        normalize_attributes({"ram_mb": raw})


@pytest.mark.parametrize("key", ["platform", "os_version", "app_version", "device_model", "soc"])
def test_string_length_limit_names_the_key(key):
    assert normalize_attributes({key: "x" * 128}) == {key: "x" * 128}
    with pytest.raises(errors.InvalidArgument, match=f"'{key}' must be at most 128 characters"):
        normalize_attributes({key: "x" * 129})


@pytest.mark.parametrize("bad", ["a\nb", "a\x00", "\x1b[31m", "a\x7f", "a\x85b", "\t"])
def test_control_characters_are_rejected_in_standard_and_custom_values(bad):
    with pytest.raises(errors.InvalidArgument, match="'region' must not contain control"):
        normalize_attributes({"region": bad})
    with pytest.raises(errors.InvalidArgument, match="'note' must not contain control"):
        normalize_attributes({"custom": {"note": bad}})


def test_non_control_unicode_is_accepted():
    assert normalize_attributes({"device_model": "Téléphone 8 «Pro»"})["device_model"] == (
        "Téléphone 8 «Pro»"
    )


@pytest.mark.parametrize("value", [8, 1.5, b"android", ["android"]])
def test_string_keys_reject_other_types(value):
    with pytest.raises(errors.InvalidArgument, match="'platform' must be a string"):
        normalize_attributes({"platform": value})


def test_unknown_top_level_keys_are_named():
    with pytest.raises(errors.InvalidArgument, match="unknown attribute key 'batch', 'zone'"):
        normalize_attributes({"platform": "android", "zone": "a", "batch": "8"})


def test_non_mapping_is_rejected():
    with pytest.raises(errors.InvalidArgument, match="must be a mapping"):
        normalize_attributes([("platform", "android")])  # type: ignore[arg-type]


def test_tags_limits():
    tags = [f"t{i}" for i in range(32)]
    assert normalize_attributes({"tags": tags})["tags"] == sorted(tags)
    with pytest.raises(errors.InvalidArgument, match="at most 32 tags"):
        normalize_attributes({"tags": [*tags, "one_more"]})


def test_tag_count_is_checked_after_deduplication():
    tags = [f"t{i}" for i in range(32)]
    assert len(normalize_attributes({"tags": tags + tags})["tags"]) == 32


@pytest.mark.parametrize("tag", ["a", "x" * 64, "beta:2", "A.b_c-d", "0"])
def test_valid_tags(tag):
    assert normalize_attributes({"tags": [tag]}) == {"tags": [tag]}


@pytest.mark.parametrize("tag", ["", "x" * 65, "a b", "a,b", "é", "a/b", 5, None])
def test_invalid_tags_are_named(tag):
    with pytest.raises(errors.InvalidArgument, match=r"tag .* must be 1 to 64 characters"):
        normalize_attributes({"tags": ["ok", tag]})


@pytest.mark.parametrize("container", [tuple, set, frozenset])
def test_tags_accept_any_collection(container):
    assert normalize_attributes({"tags": container(["b", "a"])}) == {"tags": ["a", "b"]}


@pytest.mark.parametrize("tags", ["a,b", {"a": 1}, 3])
def test_tags_must_be_a_list(tags):
    with pytest.raises(errors.InvalidArgument, match="'tags' must be a list of strings"):
        normalize_attributes({"tags": tags})


def test_custom_limits():
    custom = {f"k{i}": "v" for i in range(32)}
    assert normalize_attributes({"custom": custom})["custom"] == dict(sorted(custom.items()))
    with pytest.raises(errors.InvalidArgument, match="at most 32 keys"):
        normalize_attributes({"custom": {**custom, "k32": "v"}})


@pytest.mark.parametrize("key", ["a", "_x", "A1.b-c_d", "k" + "x" * 63])
def test_valid_custom_keys(key):
    assert normalize_attributes({"custom": {key: "v"}}) == {"custom": {key: "v"}}


@pytest.mark.parametrize("key", ["", "9x", ".a", "-a", "a b", "k" + "x" * 64, "a$", 3])
def test_invalid_custom_keys_are_named(key):
    with pytest.raises(errors.InvalidArgument, match=r"custom key .* must be a letter"):
        normalize_attributes({"custom": {key: "v"}})


@pytest.mark.parametrize("key", [*STANDARD_KEYS, "custom"])
def test_custom_keys_cannot_shadow_standard_ones(key):
    with pytest.raises(errors.InvalidArgument, match=f"custom key '{key}' is reserved"):
        normalize_attributes({"custom": {key: "v"}})


def test_custom_values_limits():
    assert normalize_attributes({"custom": {"a": "x" * 128}}) == {"custom": {"a": "x" * 128}}
    with pytest.raises(errors.InvalidArgument, match="'a' must be at most 128"):
        normalize_attributes({"custom": {"a": "x" * 129}})
    with pytest.raises(errors.InvalidArgument, match="'a' must be a string, not int"):
        normalize_attributes({"custom": {"a": 8}})
    with pytest.raises(errors.InvalidArgument, match="'custom' must be a mapping"):
        normalize_attributes({"custom": ["a"]})


def test_stamped_overrides_key_by_key_and_is_attested():
    reported = {"platform": "android", "region": "us", "soc": "sm8650", "ram_mb": 4096}
    stamped = {"region": "eu", "ram_mb": 8192}
    assert effective_attributes(reported, stamped) == {
        "platform": "android",
        "soc": "sm8650",
        "ram_mb": 8192,
        "region": "eu",
        "attested": {"ram_mb": 8192, "region": "eu"},
    }


def test_custom_keys_per_key_and_stamped_tags_exclusive():
    # Before attestation tags were the union ("field" was kept): a device could add
    # any tag to a set its token fixed.
    reported = {"tags": ["beta", "field"], "custom": {"batch": "8", "tier": "free"}}
    stamped = {"tags": ["beta", "fleet-a"], "custom": {"tier": "gold"}}
    assert effective_attributes(reported, stamped) == {
        "tags": ["beta", "fleet-a"],
        "custom": {"batch": "8", "tier": "gold"},
        "attested": {"tags": ["beta", "fleet-a"], "custom": {"tier": "gold"}},
    }


def test_reported_tags_count_only_where_the_token_stamps_none():
    assert effective_attributes({"tags": ["a"]}, {}) == {"tags": ["a"]}
    assert effective_attributes({"tags": ["a"]}, {"region": "eu"})["tags"] == ["a"]
    assert effective_attributes({}, {"tags": ["b"]})["tags"] == ["b"]
    # An empty stamped list is no stamp: over gRPC every token without tags stores one.
    assert effective_attributes({"tags": ["a"]}, {"tags": [], "soc": "x"}) == {
        "soc": "x",
        "tags": ["a"],
        "attested": {"soc": "x"},
    }
    assert effective_attributes({}, {"tags": []}) == {}
    assert effective_attributes({}, {}) == {}


def test_nothing_stamped_means_nothing_attested():
    out = effective_attributes({"platform": "android", "custom": {"x": "1"}}, {})
    assert ATTESTED not in out and attested_attributes(out) == {}
    assert attested_attributes(effective_attributes({}, {"soc": "a1"})) == {"soc": "a1"}


def test_a_device_cannot_report_the_attested_key():
    forged = {"tags": ["internal"]}
    with pytest.raises(errors.InvalidArgument, match="'attested' is reserved"):
        normalize_attributes({"platform": "android", ATTESTED: forged})
    with pytest.raises(errors.InvalidArgument, match="'attested' is reserved"):
        effective_attributes({ATTESTED: forged}, {})
    with pytest.raises(errors.InvalidArgument, match="'attested' is reserved"):
        effective_attributes({}, {ATTESTED: forged})  # nor can a token nest it
    # A custom key of that name is only a custom key, never the attested set.
    out = effective_attributes({"custom": {ATTESTED: "yes"}}, {})
    assert out == {"custom": {ATTESTED: "yes"}} and attested_attributes(out) == {}


def test_effective_result_is_canonical_and_checked():
    merged = effective_attributes({"custom": {"z": "1"}}, {"custom": {"a": "2"}, "ram_mb": "16"})
    assert list(merged["custom"]) == ["a", "z"]
    assert merged["ram_mb"] == 16
    assert merged[ATTESTED] == {"ram_mb": 16, "custom": {"a": "2"}}
    too_many = {f"k{i}": "v" for i in range(20)}
    with pytest.raises(errors.InvalidArgument, match="at most 32 keys"):
        effective_attributes(
            {"custom": too_many}, {"custom": {k + "x": v for k, v in too_many.items()}}
        )


def test_effective_validates_both_sides():
    with pytest.raises(errors.InvalidArgument, match="unknown attribute key 'zone'"):
        effective_attributes({"zone": "a"}, {})
    with pytest.raises(errors.InvalidArgument, match="'region' must not contain control"):
        effective_attributes({}, {"region": "e\nu"})


def test_parse_attr_flags_fills_slots_tags_and_custom():
    flags = [
        "platform=android",
        "ram_mb=4096",
        "tags=beta",
        "tags=fleet-a,canary",
        "batch=8",
        "note=a=b",
        "region=eu",
    ]
    assert parse_attr_flags(flags) == {
        "platform": "android",
        "ram_mb": 4096,
        "region": "eu",
        "tags": ["beta", "canary", "fleet-a"],
        "custom": {"batch": "8", "note": "a=b"},
    }


def test_parse_attr_flags_output_is_canonical():
    out = parse_attr_flags(["tags=b,a,b", "z=1", "a=2", "soc=sm8650"])
    assert normalize_attributes(out) == out
    assert list(out) == ["soc", "tags", "custom"]


def test_parse_attr_flags_empty_values():
    assert parse_attr_flags(["tags="]) == {"tags": []}
    assert parse_attr_flags(["platform=", "x="]) == {}
    assert parse_attr_flags([]) == {}


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["platform"], "attribute 'platform' is not KEY=VALUE"),
        (["soc=a", "oops"], "attribute 'oops' is not KEY=VALUE"),
        (["platform=a", "platform=b"], "'platform' is given more than once"),
        (["x=1", "x=2"], "'x' is given more than once"),
        (["custom=x"], "custom key 'custom' is reserved"),
        (["=x"], "custom key '' must be"),
        (["ram_mb=lots"], "'ram_mb' must be an integer"),
        (["tags=a,,b"], "tag '' must be 1 to 64"),
        (["tags=a b"], "tag 'a b' must be"),
        (["bad key=1"], "custom key 'bad key' must be"),
    ],
)
def test_parse_attr_flags_errors_name_the_item(items, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        parse_attr_flags(items)


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs")), max_size=20)
_attrs = st.fixed_dictionaries(
    {},
    optional={
        "platform": st.one_of(st.none(), _text),
        "os_version": _text,
        "ram_mb": st.one_of(st.integers(0, 2**31), st.integers(0, 2**31).map(str)),
        "tags": st.lists(st.from_regex(r"[A-Za-z0-9_.:-]{1,8}", fullmatch=True), max_size=40),
        "custom": st.dictionaries(
            st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(
                lambda k: k not in (*STANDARD_KEYS, "custom")
            ),
            _text,
            max_size=5,
        ),
    },
)


@given(_attrs)
def test_normalize_is_idempotent(raw):
    try:
        once = normalize_attributes(raw)
    except errors.InvalidArgument:
        assert len(set(raw.get("tags", []))) > 32
        return
    assert normalize_attributes(once) == once
    assert effective_attributes(once, {}) == once
    stamp = _stamp(once)
    assert effective_attributes({}, once) == ({**stamp, ATTESTED: stamp} if stamp else {})


def _stamp(stamped: dict) -> dict:
    """What a canonical stamp attests: all of it, but an empty tag list is no stamp."""
    return {k: v for k, v in stamped.items() if (k, v) != ("tags", [])}


def _canonical(raw: dict) -> dict | None:
    try:
        return normalize_attributes(raw)
    except errors.InvalidArgument:  # more than 32 tags
        return None


@given(_attrs.map(_canonical), _attrs.map(_canonical), _attrs.map(_canonical))
def test_a_device_reporting_an_attested_attribute_cannot_change_or_add_to_it(
    reported, other, stamped
):
    if None in (reported, other, stamped):
        return
    out = effective_attributes(reported, stamped)
    stamped = _stamp(stamped)
    # Every stamped value is the effective one, tags whole, custom keys one by one.
    for key, value in stamped.items():
        if key != "custom":
            assert out[key] == value, key
    for key, value in stamped.get("custom", {}).items():
        assert out["custom"][key] == value, key
    # What is attested is exactly what the token stamped, whatever the device reports.
    assert attested_attributes(out) == stamped
    assert attested_attributes(effective_attributes(other, stamped)) == stamped
    # What the token leaves alone is the device's to report.
    for key, value in reported.items():
        if key not in stamped and key != "custom":
            assert out[key] == value, key
    for key, value in reported.get("custom", {}).items():
        if key not in stamped.get("custom", {}):
            assert out["custom"][key] == value, key


def test_parse_attr_flags_takes_custom_keys_as_selectors_write_them():
    assert parse_attr_flags(["custom.tier=gold", "batch=8"]) == {
        "custom": {"batch": "8", "tier": "gold"}
    }
    with pytest.raises(errors.InvalidArgument, match="more than once"):
        parse_attr_flags(["custom.tier=gold", "tier=silver"])
