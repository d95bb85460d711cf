"""The actor checkpoint's config.json, one rule for the verl driver and the OpenRLHF launcher."""

from __future__ import annotations

import json

import pytest

from rlalign_verl.base.errors import AlignmentError, ConfigFormatError
from rlalign_verl.request.checkpoint import checkpoint_config

FIX = "point it at the checkpoint"


def _ckpt(tmp_path, text: str, name: str = "ck"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(text)
    return d


def test_a_local_checkpoint_gives_its_model_type_and_config(tmp_path):
    d = _ckpt(tmp_path, json.dumps({"model_type": "qwen2", "hidden_act": "silu"}))
    assert checkpoint_config(str(d), "--m", missing_fix=FIX) == (
        "qwen2",
        {"model_type": "qwen2", "hidden_act": "silu"},
    )


@pytest.mark.parametrize(
    ("text", "error", "words"),
    [
        ("{", ConfigFormatError, "is not valid JSON"),
        ('{"model_type": "qwen2", "model_type": "llama"}', ConfigFormatError, "duplicate key 'model_type'"),
        ("[1]", ConfigFormatError, "holds a JSON list"),
        ("{}", AlignmentError, "names no model_type (None)"),
        ('{"model_type": 5}', AlignmentError, "names no model_type (5)"),
        ('{"model_type": " "}', AlignmentError, "names no model_type"),
    ],
)
def test_a_broken_config_json_is_refused_naming_the_key(tmp_path, text, error, words):
    d = _ckpt(tmp_path, text)
    with pytest.raises(error) as e:
        checkpoint_config(str(d), "actor.path", missing_fix=FIX)
    assert words in str(e.value) and ("actor.path" in str(e.value)) and "\n" not in str(e.value)


@pytest.mark.parametrize(("sep", "shown"), [(" ", "--m /nowhere/x"), ("=", "--m=/nowhere/x")])
def test_a_missing_local_path_is_refused_with_the_surfaces_fix(sep, shown):
    with pytest.raises(AlignmentError) as e:
        checkpoint_config("/nowhere/x", "--m", missing_fix=FIX, sep=sep)
    assert str(e.value) == f"{shown} does not exist on this machine; {FIX}"
    with pytest.raises(AlignmentError, match="does not exist on the driver;"):
        checkpoint_config("/nowhere/x", "--m", missing_fix=FIX, machine="the driver")


def test_a_config_file_is_read_only_where_the_key_names_a_config(tmp_path):
    d = _ckpt(tmp_path, json.dumps({"model_type": "qwen3"}))
    cfg = str(d / "config.json")
    assert checkpoint_config(cfg, "hf_config_path", missing_fix=FIX, file_ok=True)[0] == "qwen3"
    with pytest.raises(AlignmentError, match="is a file, not a checkpoint folder"):
        checkpoint_config(cfg, "path", missing_fix=FIX)
    with pytest.raises(AlignmentError, match="holds no config.json"):
        checkpoint_config(str(tmp_path), "path", missing_fix=FIX)


@pytest.mark.parametrize("path", ["", "  ", None])
def test_an_unset_path_is_refused(path):
    with pytest.raises(AlignmentError, match="is not set"):
        checkpoint_config(path, "--m", missing_fix=FIX)


def test_a_hub_id_without_network_is_a_warning_not_a_stop(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert checkpoint_config("no-such-org/no-such-model", "--m", missing_fix=FIX) == (None, None)
