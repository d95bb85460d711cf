"""OpenRLHF's own flags that the plugin reads, as data: every spelling each release used.

OpenRLHF 0.10 moved from flat flags (``--enforce_eager``, ``--enable_vllm_is_correction``,
``--vllm_is_truncated_threshold``) to dotted ones (``--vllm.enforce_eager``,
``--algo.advantage.is_correction_*``). The launcher reads a setting under any of its spellings, and
refuses, before Ray starts, a spelling the installed OpenRLHF does not know (its parser would fail only
after Ray is up), naming the spelling that it does know, and an abbreviation of one of them (OpenRLHF's
argparse would read it as the full flag, the launcher would not see it).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence

from rlalign_verl.base.errors import ConfigFormatError

# setting -> its spellings, newest first (dotted names of OpenRLHF >= 0.10, then older flat names)
FLAG_TABLE: dict[str, tuple[str, ...]] = {
    "enforce_eager": ("--vllm.enforce_eager", "--enforce_eager"),
    "use_liger_kernel": ("--ds.use_liger_kernel", "--use_liger_kernel"),
    "is_correction_level": ("--algo.advantage.is_correction_level",),
    "is_correction_enable": ("--algo.advantage.is_correction_enable", "--enable_vllm_is_correction"),
    "is_correction_threshold": ("--algo.advantage.is_correction_threshold", "--vllm_is_truncated_threshold"),
    "vllm_num_engines": ("--vllm.num_engines", "--vllm_num_engines"),
    "vllm_tensor_parallel_size": ("--vllm.tensor_parallel_size", "--vllm_tensor_parallel_size"),
    "model_path": ("--actor.model_name_or_path", "--pretrain"),
    "param_dtype": ("--ds.param_dtype", "--param_dtype"),
    "eps_clip": ("--actor.eps_clip", "--eps_clip"),
    "eps_clip_low_high": ("--actor.eps_clip_low_high", "--eps_clip_low_high"),
    # read by the start-up confounder checks (rlalign_verl/openrlhf/doctor_flags.py)
    "top_p": ("--rollout.top_p", "--top_p"),
    "rollout_micro_batch_size": ("--rollout.micro_batch_size", "--micro_rollout_batch_size"),
    "train_micro_batch_size": ("--train.micro_batch_size", "--micro_train_batch_size"),
    "dynamic_batch_enable": ("--train.dynamic_batch_enable", "--use_dynamic_batch"),
    "rollout_max_tokens_per_gpu": ("--rollout.max_tokens_per_gpu", "--rollout_max_tokens_per_gpu"),
    "train_max_tokens_per_gpu": ("--train.max_tokens_per_gpu", "--train_max_tokens_per_gpu"),
    "async_enable": ("--train.async_enable", "--async_train"),
    "partial_rollout_enable": ("--train.partial_rollout_enable",),
    "agent_func_path": ("--train.agent_func_path", "--agent_func_path"),
}

# a setting that a later release replaced by another one (the on/off switch became a level)
SUCCESSOR = {"is_correction_enable": "is_correction_level"}

CLI_MODULE = "openrlhf.cli.train_ppo_ray"


def spellings(setting: str) -> tuple[str, ...]:
    """Every flag name of ``setting`` (a key of :data:`FLAG_TABLE`)."""
    return FLAG_TABLE[setting]


def _cli_source(module: str) -> str | None:
    """The installed OpenRLHF CLI's source (read, not imported); ``None`` when not installed or unreadable."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def installed_flags(module: str = CLI_MODULE) -> set[str] | None:
    """The ``--flag`` names declared in the installed OpenRLHF CLI's source (read, not imported);
    ``None`` when OpenRLHF is not installed or its source is unreadable."""
    source = _cli_source(module)
    return None if source is None else set(re.findall(r"""["'](--[A-Za-z0-9_.\-]+)["']""", source))


def installed_switches(module: str = CLI_MODULE) -> set[str]:
    """The ``store_true`` flags of the installed OpenRLHF CLI (read from its source; empty when unreadable)."""
    pattern = r"""add_argument\(\s*["'](--[A-Za-z0-9_.\-]+)["'][^)]*?action\s*=\s*["']store_true["']"""
    return set(re.findall(pattern, _cli_source(module) or ""))


def last_given(argv: Sequence[str], names: Sequence[str]) -> tuple[str, str | bool] | None:
    """``(flag as written, value)`` of the last of ``names`` in ``argv`` (argparse keeps the last): ``--f v`` or
    ``--f=v``, ``True`` for a bare ``--f`` (at the end, or before another flag); ``None`` when absent."""
    found: tuple[str, str | bool] | None = None
    for i, arg in enumerate(argv):
        name, eq, rest = arg.partition("=")
        if name in names:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            found = (name, rest if eq else (nxt if nxt is not None and not nxt.startswith("--") else True))
    return found


def check_switch_values(argv: Sequence[str], switches: set[str] | None = None) -> None:
    """Refuse a value given to an OpenRLHF on/off switch (``store_true``): its parser refuses ``--flag=false``
    ("ignored explicit argument") and a value after it (an unrecognized argument), only after Ray is up."""
    switches = installed_switches() if switches is None else switches
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if name not in switches or not (eq or (nxt is not None and not nxt.startswith("-"))):
            continue
        given = f"{name}={value}" if eq else f"{name} {nxt}"
        raise ConfigFormatError(
            f"{given}: {name} is an on/off switch in OpenRLHF (store_true), which takes no value and would stop "
            f"OpenRLHF's parser after Ray started; give {name} alone to turn it on, or leave it out"
        )


def _used(argv: Sequence[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def check_spellings(argv: Sequence[str], known: set[str] | None = None) -> None:
    """Refuse a table flag spelled for another OpenRLHF release than the installed one."""
    known = installed_flags() if known is None else known
    if not known:
        return
    for flag in _used(argv):
        for setting, names in FLAG_TABLE.items():
            if flag in names and flag not in known:
                valid = [n for n in (*names, *FLAG_TABLE.get(SUCCESSOR.get(setting, ""), ())) if n in known]
                if valid:
                    raise ConfigFormatError(
                        f"{flag} is not a flag of the installed OpenRLHF (another release spells it so); "
                        f"use {valid[0]}"
                    )


def check_abbreviations(argv: Sequence[str], known: set[str] | None = None) -> None:
    """Refuse an abbreviation of a table flag: argparse (``allow_abbrev``) reads ``--vllm.tensor_parallel 2`` as
    ``--vllm.tensor_parallel_size 2``, which the launcher reads under its full name only."""
    known = installed_flags() if known is None else known
    if not known:
        return
    table = {name for names in FLAG_TABLE.values() for name in names}
    for flag in _used(argv):
        if flag in known or flag in table or flag == "--":
            continue
        full = sorted(name for name in table & known if name.startswith(flag))
        if full:
            raise ConfigFormatError(
                f"{flag} abbreviates {full[0]}, which OpenRLHF's parser would read but the launcher reads only "
                f"written in full; write {full[0]}"
            )
