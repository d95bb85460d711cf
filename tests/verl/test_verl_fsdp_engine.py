"""The worker-side hook in verl's own FSDP engine on CPU: actor and ref aligned, critic not.

The tests run this file as a script in a fresh process (``python test_verl_fsdp_engine.py engine``):
verl resolves its platform once per process, so the CPU platform shim must not leak into other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false")


ENGINE_CASES = {
    # name: (strategy, use_remove_padding, gradient checkpointing, lora_rank)
    "fsdp2-rmpad-gc": ("fsdp2", True, True, 0),
    "fsdp1-pad": ("fsdp", False, False, 0),
    "fsdp2-lora": ("fsdp2", True, True, 4),
}


def _run_engine_child(model_path: str, timeout: int) -> tuple[dict, str]:
    """:func:`_engine_child` in a fresh process: its results per case, and its stderr (the log lines)."""
    out = subprocess.run(
        [sys.executable, __file__, "engine", model_path],
        capture_output=True,
        text=True,
        env=dict(ENV, VERL_PLATFORM="cpu", VERL_ENGINE_DEVICE="cuda", VERL_LOGGING_LEVEL="WARNING"),
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.verl
def test_verl_fsdp_engine_aligns_actor_and_ref_not_critic(qwen2_path):
    pytest.importorskip("verl")
    results, stderr = _run_engine_child(qwen2_path, timeout=600)
    for case in ENGINE_CASES:
        r = results[case]
        assert r["actor"] == {"regions": ["rope", "swiglu", "rmsnorm"], "profile": "vllm-cpu"}, (case, r)
        assert r["ref"] == {"regions": ["rope", "swiglu", "rmsnorm"], "profile": "vllm-cpu"}, (case, r)
        assert r["critic"] is None, (case, r)
        # the aligned forward really runs inside the FSDP-wrapped actor: removing it changes the logits
        assert r["actor_logits_change_when_removed"] > 0, (case, r)
        assert r["actor_logits_finite"], (case, r)
        assert r["flags_left"] == [], (case, r)
        # an in-run verification pass: unaligned logits, then the aligned model bit for bit as before
        assert r["verify_pass_is_unaligned"], (case, r)
        assert r["aligned_bit_identical_after_verify_pass"] and r["grads_bit_identical_after_verify_pass"], (
            case,
            r,
        )
    # one log line per aligned model, naming role, regions and profile
    lines = [ln for ln in stderr.splitlines() if "[rlalign-verl]" in ln and "aligned" in ln]
    assert len(lines) == 2 * len(ENGINE_CASES), stderr[-3000:]
    assert any(
        "aligned Qwen2ForCausalLM (role=actor, rank 0): regions=rope,swiglu,rmsnorm profile=vllm-cpu" in ln
        for ln in lines
    )
    assert any("(role=ref, rank 0)" in ln for ln in lines)


@pytest.mark.verl
def test_verl_fsdp_engine_aligns_tiny_qwen3_moe_actor(tiny_checkpoint):
    """The same engine path builds an aligned tiny Qwen3-MoE actor (routed experts patched too)."""
    pytest.importorskip("verl")
    results, stderr = _run_engine_child(str(tiny_checkpoint("qwen3_moe")), timeout=900)
    for case, r in results.items():
        assert r["actor"] == {"regions": ["rope", "swiglu", "rmsnorm"], "profile": "vllm-cpu"}, (case, r)
        assert r["critic"] is None, (case, r)
        assert r["actor_logits_change_when_removed"] > 0 and r["actor_logits_finite"], (case, r)
        assert "Qwen3MoeExperts" in r["actor_bound"], (case, r)
    assert any("aligned Qwen3MoeForCausalLM (role=actor, rank 0)" in ln for ln in stderr.splitlines())


def _grads(module, ids) -> list:
    """One training forward+backward (the engine's bf16 autocast, checkpointing as configured); local grads."""
    import torch

    module.train()
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = module(input_ids=ids).logits.float().pow(2).mean()
    loss.backward()
    out = []
    for p in module.parameters():
        if p.grad is not None:
            g = p.grad
            out.append((g.to_local() if hasattr(g, "to_local") else g).detach().clone())
    module.zero_grad(set_to_none=True)
    module.eval()
    return out


def _engine_child(model_path: str) -> None:
    """Build actor, ref and critic with verl's EngineRegistry/FSDPEngine on CPU (shims: see docs/verl.md)."""
    import contextlib

    import torch
    import torch.distributed as dist
    import verl  # noqa: F401  (loads our plugin through verl.plugins)
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class CPUPlatform(PlatformBase):  # shim 1: a CPU platform (VERL_PLATFORM=cpu)
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, i):
            pass

        def synchronize(self, i=None):
            pass

        def manual_seed(self, s):
            torch.manual_seed(s)

        def manual_seed_all(self, s):
            torch.manual_seed(s)

        def set_allocator_settings(self, s):
            pass

        def empty_cache(self):
            pass

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def get_device_capability(self, i=0):
            return (None, None)

        def cudart(self):
            return None

        def is_ipc_supported(self):
            return False

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_noset_envvars(self):
            return []

        def ray_resource_name(self):
            return "GPU"

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(29500 + os.getpid() % 1000),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    dist.init_process_group("gloo", world_size=1, rank=0)  # shim 3 (shim 2: VERL_ENGINE_DEVICE=cuda)

    import verl.workers.engine.fsdp.transformer_impl as impl
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    from rlalign_verl.align.patch import apply_alignment, get_alignment, remove_alignment

    # CPU-only tweaks of values verl hardcodes for GPUs: no pinned memory, no rank-0 broadcast.
    class _UnpinnedOffload(impl.CPUOffloadPolicy):
        def __init__(self, pin_memory: bool = True):
            super().__init__(pin_memory=False)

    impl.CPUOffloadPolicy = _UnpinnedOffload

    class _FSDP1OnCPU(impl.FSDP):
        def __init__(self, module, **kwargs):
            kwargs.update(sync_module_states=False)
            super().__init__(module, **kwargs)

    impl.FSDP = _FSDP1OnCPU
    import verl.utils.model as verl_model
    from transformers import AutoModelForTokenClassification

    def _value_model_sdpa(local_path, torch_dtype, model_config, trust_remote_code):
        # verl asks for flash_attention_2 here, which needs a GPU; everything else as verl does it
        return AutoModelForTokenClassification.from_pretrained(
            local_path,
            dtype=torch_dtype,
            config=model_config,
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
        )

    verl_model.load_valuehead_model = _value_model_sdpa

    from rlalign_verl.align.patch import alignment_variant
    from rlalign_verl.request.spec import AlignmentSpec

    alignment = {"rlalign_spec": AlignmentSpec.parse({"regions": "all", "engine": "vllm-cpu"}).to_json()}
    ids = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(0))

    def build(model_type, override, forward_only, strategy, rmpad, gc, lora):
        mc = HFModelConfig(
            path=model_path,
            override_config={"attn_implementation": "sdpa", **override},
            use_remove_padding=rmpad,
            enable_gradient_checkpointing=gc,
            lora_rank=lora if model_type == "language_model" and not forward_only else 0,
        )
        mc.model_type = model_type
        ec = FSDPEngineConfig(strategy=strategy, forward_only=forward_only, use_torch_compile=False)
        ec.use_remove_padding = rmpad
        opt = None if forward_only else FSDPOptimizerConfig(lr=1e-5, total_training_steps=1)
        engine = EngineRegistry.new(
            model_type,
            strategy,
            model_config=mc,
            engine_config=ec,
            optimizer_config=opt,
            checkpoint_config=CheckpointConfig(),
        )
        engine.initialize()
        return engine

    def state(engine):
        st = get_alignment(engine.module)
        return None if st is None else {"regions": list(st.regions), "profile": st.profile.name}

    results = {}
    for case, (strategy, rmpad, gc, lora) in ENGINE_CASES.items():
        actor = build("language_model", alignment, False, strategy, rmpad, gc, lora)
        ref = build("language_model", alignment, True, strategy, rmpad, gc, 0)
        # the critic's model config is its own (critic.model.override_config): no alignment keys
        critic = build("value_model", {}, False, strategy, rmpad, gc, 0)
        actor.module.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            aligned_logits = actor.module(input_ids=ids).logits.float()
            st = get_alignment(actor.module)
            remove_alignment(actor.module)
            plain_logits = actor.module(input_ids=ids).logits.float()
            apply_alignment(actor.module, st.spec.replace(engine=st.profile))
            # an in-run verification pass (alignment switched off), then the aligned model exactly as before
            before = actor.module(input_ids=ids).logits.float()
            with alignment_variant(actor.module, ()):
                unaligned_logits = actor.module(input_ids=ids).logits.float()
            after = actor.module(input_ids=ids).logits.float()
        grads_before = _grads(actor.module, ids)
        with (
            torch.no_grad(),
            alignment_variant(actor.module, ("rope",)),
            torch.autocast("cpu", dtype=torch.bfloat16),
        ):
            actor.module(input_ids=ids)
        grads_after = _grads(actor.module, ids)
        results[case] = {
            "verify_pass_is_unaligned": bool(torch.equal(unaligned_logits, plain_logits)),
            "aligned_bit_identical_after_verify_pass": bool(torch.equal(before, after))
            and bool(torch.equal(before, aligned_logits)),
            "grads_bit_identical_after_verify_pass": all(
                torch.equal(a, b) for a, b in zip(grads_before, grads_after, strict=True)
            ),
            "actor": state(actor),
            "ref": state(ref),
            "critic": state(critic),
            "actor_logits_change_when_removed": float((aligned_logits - plain_logits).abs().max()),
            "actor_logits_finite": bool(torch.isfinite(aligned_logits).all()),
            "actor_bound": sorted(
                {type(m).__name__ for m in actor.module.modules() if "forward" in m.__dict__}
            ),
            # read once, then removed: saved HF checkpoints must not carry the switch
            "flags_left": [
                key
                for e in (actor, ref)
                for key in ("rlalign_spec", "rlalign_regions", "rlalign_engine")
                if hasattr(e.model_config.hf_config, key)
            ],
        }
        del actor, ref, critic
    print(json.dumps(results))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "engine":
    _engine_child(sys.argv[2])
