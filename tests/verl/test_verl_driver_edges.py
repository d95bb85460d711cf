"""The verl driver, round 4: the checkpoint's config read as verl reads it (hf_config_path may name the file), a
config.json naming no architecture, an accelerator no profile describes, and one start-up line that names the profile
the workers use."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

from verl_configs import valid_config  # noqa: E402

from rlalign_verl.base.errors import AlignmentError, ProfileMismatchError, UnsupportedModelError  # noqa: E402
from rlalign_verl.verl.config import validate_config  # noqa: E402

pytestmark = pytest.mark.verl


def test_hf_config_path_may_name_the_config_file(qwen2_path):
    """transformers' AutoConfig.from_pretrained reads a config file given directly, as verl passes hf_config_path."""
    cfg_file = f"{qwen2_path}/config.json"
    cfg = valid_config(
        qwen2_path, "alignment.regions=[moe]", f"+actor_rollout_ref.model.hf_config_path={cfg_file}"
    )
    with pytest.raises(UnsupportedModelError, match="qwen2 is a dense model"):  # the architecture was read
        validate_config(cfg, on_cuda=False)


def test_a_missing_hf_config_path_is_named_with_its_own_key(qwen2_path, tmp_path):
    cfg = valid_config(qwen2_path, f"+actor_rollout_ref.model.hf_config_path={tmp_path}/nothing.json")
    with pytest.raises(AlignmentError) as e:
        validate_config(cfg, on_cuda=False)
    msg = str(e.value)
    assert msg.startswith("actor_rollout_ref.model.hf_config_path=") and "does not exist" in msg, msg
    assert "also set actor_rollout_ref.model.hf_config_path" not in msg  # what the user already did


@pytest.mark.parametrize("model_type", [None, 5, ""])
def test_a_config_json_naming_no_architecture_is_refused(qwen2_path, tmp_path, model_type):
    ckpt = tmp_path / "ck"
    shutil.copytree(qwen2_path, ckpt)
    data = json.loads((ckpt / "config.json").read_text())
    data.pop("model_type")
    if model_type is not None:
        data["model_type"] = model_type
    (ckpt / "config.json").write_text(json.dumps(data))
    cfg = valid_config(str(ckpt), "alignment.regions=[moe]")
    with pytest.raises(AlignmentError, match="names no model_type"):
        validate_config(cfg, on_cuda=False)


def test_a_model_path_that_is_a_file_is_refused(qwen2_path):
    cfg = valid_config(f"{qwen2_path}/config.json")
    with pytest.raises(AlignmentError, match="is a file, not a checkpoint folder"):
        validate_config(cfg, on_cuda=False)


@pytest.mark.parametrize("device", ["npu", "xpu", "mps"])
def test_an_accelerator_no_profile_describes_is_refused(qwen2_path, device):
    with pytest.raises(ProfileMismatchError, match=f"trainer.device={device}: the engine profiles describe"):
        validate_config(valid_config(qwen2_path, f"trainer.device={device}"), on_cuda=False)
    off = valid_config(qwen2_path, f"trainer.device={device}", "alignment.regions=[]")
    assert validate_config(off, on_cuda=False) is not None  # metrics only: nothing to mirror


def test_the_start_up_line_names_the_profile_the_workers_use(qwen2_path, caplog):
    """A CPU driver of GPU workers (trainer.device=cuda, verl's default): auto resolves to the CPU build here and
    each worker moves it to its CUDA build; the line says the CUDA one, as the unverified-engine line does."""
    logger = logging.getLogger("rlalign_verl.verl")
    logger.addHandler(caplog.handler)
    try:
        validate_config(valid_config(qwen2_path, "alignment.regions=[rope]"), on_cuda=False)
        gpu = [r.getMessage() for r in caplog.records if "alignment regions=" in r.getMessage()]
        caplog.clear()
        validate_config(
            valid_config(qwen2_path, "alignment.regions=[rope]", "trainer.device=cpu"), on_cuda=False
        )
        cpu = [r.getMessage() for r in caplog.records if "alignment regions=" in r.getMessage()]
    finally:
        logger.removeHandler(caplog.handler)
    assert gpu and gpu[0].startswith("alignment regions=rope profile=vllm (the workers run on cuda"), gpu
    assert cpu and cpu[0].startswith("alignment regions=rope profile=vllm-cpu ("), cpu
