"""JSON inputs read strictly: a key given twice is an error at the second one, never silently its last value."""

from __future__ import annotations

import json

import pytest

from rlalign_verl.base import strict_json


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"a": 1, "a": 2}', "a"),
        ('{"x": {"b": 1, "b": 1}}', "b"),
        ('[{"s": 1}, {"s": 1, "s": 2}]', "s"),
        ('{"\\u0061": 1, "a": 2}', "a"),
    ],  # fmt: skip
)
def test_a_key_given_twice_is_a_decode_error_naming_it(text, key):
    with pytest.raises(json.JSONDecodeError) as e:
        strict_json.loads(text)
    assert isinstance(e.value, strict_json.DuplicateKeyError) and e.value.key == key
    assert f"duplicate key {key!r}" in e.value.msg
    assert json.loads(text) is not None  # the standard parser keeps one value without a word


def test_the_position_points_at_the_second_key():
    text = '{"step": 1,\n "step": 2}'
    with pytest.raises(strict_json.DuplicateKeyError) as e:
        strict_json.loads(text)
    assert (e.value.lineno, e.value.colno) == (2, 2)


def test_plain_json_reads_as_json_does():
    text = '{"a": [1, {"b": null}], "c": "\\u00e9"}'
    assert strict_json.loads(text) == json.loads(text)
    assert strict_json.loads(text.encode()) == json.loads(text)
