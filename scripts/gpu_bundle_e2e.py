"""The bundle-mode steps of ``scripts/gpu_profile_check.py`` that need more than one op: the end-to-end floor
step and the MoE router rows, with vLLM's ops from the bundle (:mod:`gpu_bundle_natives`) and no vLLM.

* :class:`BundleFloor`: a HF Qwen2/Qwen3/Llama whose regions run vLLM's own ops. ``mode="compiled"``: the
  bundled native ops in Inductor pieces split at attention with vLLM's compile settings (the default path,
  profile ``vllm``); ``mode="eager"``: the built CUDA kernels (``enforce_eager``, profile ``vllm-eager``).
  HF's GEMMs, embedding, attention and lm_head stay HF's.
* :func:`run_bundle_e2e`: the floor samples from a tiny local model; HF recomputes the sampled tokens
  unaligned, per region and with all regions aligned to the profile; the floor recomputes them too. Rows
  and misses are ``scripts/e2e_check.py``'s (95% bootstrap intervals over prompts).
* :func:`router_rows`: vLLM's ``topk_softmax`` kernel (built from the bundle) against the ``vllm`` profile's
  MoE router. The Triton expert rows need vLLM's ``fused_moe`` package, which the bundle does not carry.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import torch

_SCRIPTS = str(Path(__file__).resolve().parent)
if _SCRIPTS not in sys.path:  # scripts/ is not a package: its modules import each other by name
    sys.path.insert(0, _SCRIPTS)

from piecewise_floor import PiecewiseEngineFloor  # noqa: E402  (scripts/, on the path above)

natives_mod = importlib.import_module("gpu_bundle_natives")
BundleError = natives_mod.BundleError
E2E_MODES = {"vllm": "compiled", "vllm-eager": "eager"}
"""Profile -> the floor mode that runs its engine path."""
ROUTER_CASES = ((16, 2, True), (60, 4, False), (128, 8, True))
"""``(experts, top_k, renormalize)``: the fused power-of-two kernel, Qwen2-MoE's 60 experts (the generic
softmax + top-k kernels, no renormalisation), Qwen3-MoE's 128 experts."""
EXPERTS_ABSENT = (
    "the Triton expert rows need vLLM's fused_moe Python package, which the bundle does not carry"
)


class BundleFloor(PiecewiseEngineFloor):
    """``logits(input_ids)`` of a HF dense model with the regions run by vLLM's ops from the bundle."""

    def __init__(self, model: torch.nn.Module, ops: Any, mode: str) -> None:
        from rlalign_verl.tools.diagnose.engine_floor import _floor_custom_ops, rope_parameters

        if any(hasattr(layer.mlp, "experts") for layer in model.model.layers):
            raise BundleError("the bundle floor covers dense models only")
        if mode not in ("eager", "compiled"):
            raise ValueError(f"mode {mode!r}")
        self.model, self.bundle_ops, self.mode = model, ops, mode
        self.compiled = mode == "compiled"
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.qk_norm = hasattr(attn, "q_norm")
        self.head_dim, self.scaling = attn.head_dim, float(attn.scaling)
        self.groups, self.eps = int(attn.num_key_value_groups), float(cfg.rms_norm_eps)
        dtype = model.model.embed_tokens.weight.dtype
        theta = float(rope_parameters(cfg)["rope_theta"])
        self.cos_sin_cache = ops.cos_sin_cache(self.head_dim, int(cfg.max_position_embeddings), theta, dtype)
        self._linear, self._sdpa = _floor_custom_ops()
        self.moe_isa = None
        if mode == "eager":
            if ops.ops is None:
                raise BundleError("the eager floor needs the built CUDA kernels")
            self._eager = natives_mod.eager_ops_functions(ops.ops)
            return
        opts = ops.options()

        def comp(fn):  # one Inductor graph per piece, vLLM's options on this device, token count dynamic
            return torch.compile(fn, backend="inductor", fullgraph=True, options=opts)

        self._first, self._middle, self._last = (
            comp(self._piece_first),
            comp(self._piece_middle),
            comp(self._piece_last),
        )

    def _norm(self, x, w, residual=None):
        if self.mode == "eager":
            f = self._eager
            return f["rms"](x, w, self.eps) if residual is None else f["add_rms"](x, residual, w, self.eps)
        n = self.bundle_ops.natives
        if residual is None:
            return n.rms_norm(x, w, self.eps)
        return n.fused_add_rms_norm(x, residual, w, self.eps)

    def _rope(self, positions, q, k):
        if self.mode == "eager":
            return self._eager["rope"](positions, q, k, self.head_dim, self.cos_sin_cache)
        n = self.bundle_ops.natives
        return n.rotary_forward_static(
            positions, q, k, self.head_dim, self.head_dim, self.cos_sin_cache, True
        )

    def _silu_and_mul(self, gate, up):
        gu = torch.cat((gate, up), dim=-1)
        return self._eager["silu"](gu) if self.mode == "eager" else self.bundle_ops.natives.silu_and_mul(gu)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T, vocab]`` bf16 logits of one unpadded sequence of token ids ``[T]``."""
        if self.mode != "eager":
            return super().logits(input_ids)
        ids = input_ids.reshape(-1)
        positions = torch.arange(ids.shape[0], dtype=torch.long, device=ids.device)
        return self.model.lm_head(self._hidden(ids, positions))


@torch.no_grad()
def sample_rollouts(floor: Any, prompts: list[list[int]], tokens: int, seed: int, eos: int | None,
                    device: str) -> list:  # fmt: skip
    """Temperature-1 samples from the floor, with the floor's fp32 log-prob of each sampled token (as the
    engine reports it). No KV cache: every step reruns the whole sequence (tiny model)."""
    from rlalign_verl.tools.diagnose.rollouts import Rollout

    gen = torch.Generator().manual_seed(seed)
    out = []
    for prompt in prompts:
        ids, lps = list(prompt), []
        for _ in range(tokens):
            logp = floor.logits(torch.tensor(ids, device=device))[-1].float().cpu().log_softmax(-1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
            ids.append(tok)
            lps.append(float(logp[tok]))
            if tok == eos:
                break
        out.append(Rollout(list(prompt), ids[len(prompt) :], lps))
    return out


def run_bundle_e2e(ops: Any, mode: str, profile: str, *, arch: str = "qwen3", prompts: int = 16,
                   tokens: int = 32, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """The floor (:class:`BundleFloor` in ``mode``) samples; HF recomputes unaligned, per region and with all
    regions aligned to ``profile``; the floor recomputes too. The JSON report's e2e entry for one mode."""
    from e2e_check import problems_of, recompute_rows

    from rlalign_verl.catalog.profiles import get_profile
    from rlalign_verl.tools.diagnose.pipeline import Sample, load_hf, measure, recompute
    from rlalign_verl.tools.diagnose.resolve import check_model
    from rlalign_verl.tools.diagnose.stats import CI_KEYS
    from rlalign_verl.tools.diagnose.tiny import build_tiny_checkpoint, tiny_prompts

    t0 = time.time()
    device = ops.device
    model_dir = build_tiny_checkpoint(arch)
    config, tok = check_model(model_dir)
    hf = load_hf(model_dir).to(device)
    floor = BundleFloor(hf, ops, mode)
    eos = getattr(config, "eos_token_id", None)
    rollouts = sample_rollouts(floor, tiny_prompts(tok, prompts, seed=seed), tokens, seed, eos, device)
    s = Sample(model_dir, config, get_profile(profile), None, rollouts, "engine", Path("."))
    with torch.no_grad():
        rows = recompute_rows(hf, s, device, seed)
        lps = recompute(lambda ids: floor.logits(ids.to(device)).cpu(), rollouts, f"e2e [floor {mode}]")
        metrics, _ = measure(lps, s, seed)
        rows["floor"] = {"mean_abs_dlogp": metrics[CI_KEYS[0]], "ci95": metrics["ci95"]}
    n = sum(len(r.response_ids) for r in rollouts)
    return {"arch": arch, "profile": profile, "floor": f"bundle {mode}", "rollouts": len(rollouts), "tokens": n,
            "rows": rows, "problems": problems_of(rows), "seconds": round(time.time() - t0, 1)}  # fmt: skip


def e2e_step(ops: Any, checked: dict[str, str], *, arch: str, prompts: int, tokens: int,
             seed: int) -> dict[str, Any]:  # fmt: skip
    """:func:`run_bundle_e2e` for each engine path in ``checked`` (``{engine profile: profile checked}``) the
    bundle can run here; prints one line per row. ``{"runs": {engine: report}, "problems": [...]}``."""
    result: dict[str, Any] = {"runs": {}, "problems": []}
    for engine, profile in checked.items():
        mode = E2E_MODES.get(engine)
        if mode is None or (mode == "eager" and ops.ops is None):
            continue
        try:
            e2e = run_bundle_e2e(ops, mode, profile, arch=arch, prompts=prompts, tokens=tokens, seed=seed)
        except Exception as exc:  # a failed step is a miss, reported like a failed case
            import traceback

            traceback.print_exc()
            result["problems"].append(f"e2e {engine}: {type(exc).__name__}: {exc}")
            continue
        result["runs"][engine] = e2e
        result["problems"] += [f"{p} [floor {mode}, profile {profile}]" for p in e2e["problems"]]
        for label, row in e2e["rows"].items():
            lo, hi = row["ci95"]["mismatch/logp_abs_diff_mean"]
            print(f"e2e {arch} [bundle {mode}, {profile}] {label:<8} mean |dlogp| "
                  f"{row['mean_abs_dlogp']:.4f} [{lo:.4f}, {hi:.4f}]")  # fmt: skip
    if not result["runs"] and not result["problems"]:
        result["problems"].append("e2e: no engine path of the bundle could run here")
    return result


# --- MoE router ------------------------------------------------------------------------------------------


def router_rows(ops: Any, experts: int, top_k: int, renormalize: bool, seed: int = 0) -> dict[str, float]:
    """``{row: fraction bit-identical}``: the vllm profile's router (and ``router_softmax=topk``) vs the
    built ``topk_softmax`` kernel, on bf16 gate logits ``[256, experts]``."""
    from rlalign_verl.catalog.profiles import get_profile

    g = torch.Generator(device="cpu").manual_seed(seed + experts)
    logits = (torch.randn(256, experts, generator=g) * 2).to(torch.bfloat16).to(ops.device)
    w_eng, ids = natives_mod.topk_softmax(ops.ops, logits, top_k, renormalize)
    moe_check = importlib.import_module("gpu_moe_check")
    return moe_check.router_rows_against(logits, top_k, renormalize, get_profile("vllm").moe, w_eng, ids)


def router_misses(rows: dict[str, float]) -> list[str]:
    """The router checks of ``gpu_moe_check.misses``: ids identical, the profile's weights at least as close
    as the other router variant's (which is then named: the value the profile should take)."""
    out = []
    if rows["router_ids[profile]"] != 1.0:
        out.append("router: expert ids differ")
    if rows["router_weights[profile]"] < rows["router_weights[router_softmax=topk]"]:
        out.append("router: best variant router_softmax=topk is closer")
    return out


def moe_step(ops: Any) -> dict[str, Any] | None:
    """The MoE rows the bundle can run (CUDA: the router; ``None`` without the built kernels)."""
    if ops.ops is None:
        return None
    result: dict[str, Any] = {"misses": [], "experts": f"absent: {EXPERTS_ABSENT}"}
    for experts, top_k, renorm in ROUTER_CASES:
        key = f"router_e{experts}_top{top_k}"
        try:
            rows = router_rows(ops, experts, top_k, renorm)
        except Exception as exc:  # a kernel that cannot run is a miss, not a crash
            result["misses"].append(f"moe {key}: {type(exc).__name__}: {exc}")
            continue
        result[key] = rows
        result["misses"] += [f"moe {key}: {m}" for m in router_misses(rows)]
        for name, frac in rows.items():
            print(f"moe {key} {name:<40} {100 * frac:8.3f}% bit-identical")
    print(f"moe experts: {EXPERTS_ABSENT}")
    return result
