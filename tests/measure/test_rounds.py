"""Multi-turn rounds and token identity (rlalign_verl.measure.turns): exact values on hand-built batches."""

from __future__ import annotations

import pytest
import torch

from rlalign_verl.base.errors import MetricsInputError
from rlalign_verl.measure.doctor import Doctor
from rlalign_verl.measure.metrics import compute_mismatch_metrics
from rlalign_verl.measure.turns import (
    MAX_ROUNDS,
    ROUND_KEYS,
    round_findings,
    round_index,
    round_metrics,
    unexplained_mask,
)


def test_round_index_numbers_runs_of_the_mask():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1], [0, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert round_index(mask).tolist() == [[1, 1, 0, 0, 2, 0, 3, 3], [0, 1, 1, 1, 1, 0, 0, 0], [0] * 8]
    assert round_index(mask, 2).tolist()[0] == [1, 1, 0, 0, 2, 0, 2, 2]  # later rounds pool into the last
    assert round_index(mask.bool()).equal(round_index(mask.float()))
    assert round_index(torch.zeros(3, 0)).shape == (3, 0)


def _batch(rounds_per_row: list[list[int]], seed: int = 0, scale: float = 0.01):
    """Rows of assistant rounds (lengths) with 2 environment tokens between them; rounding-like Δ."""
    width = max(sum(r) + 2 * (len(r) - 1) for r in rounds_per_row) + 3
    mask = torch.zeros(len(rounds_per_row), width, dtype=torch.long)
    for i, rounds in enumerate(rounds_per_row):
        at = 0
        for n in rounds:
            mask[i, at : at + n] = 1
            at += n + 2
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(mask.shape, generator=gen) * 3 - 0.05
    train = (rollout + scale * torch.randn(mask.shape, generator=gen)).clamp(max=0.0)
    return train, rollout, mask


def test_single_turn_gives_no_round_keys_and_multi_turn_matches_the_metrics_per_round():
    train, rollout, mask = _batch([[40], [35]])
    assert round_metrics(train, rollout, mask) == {}
    train, rollout, mask = _batch([[30, 20, 10], [25, 15], [12]])
    out = round_metrics(train, rollout, mask)
    assert out["mismatch/rounds/per_seq_mean"] == 2.0 and out["mismatch/rounds/per_seq_max"] == 3.0
    index = round_index(mask)
    for k in (1, 2, 3):
        ref = compute_mismatch_metrics(train, rollout, index == k, prefix="p/")
        for key in ROUND_KEYS:
            assert out[f"mismatch/round_{k}/{key}"] == float(ref[f"p/{key}"]), (k, key)
        d = (train - rollout).double().abs()[index == k]
        assert out[f"mismatch/round_{k}/share_above_1"] == float((d > 1).double().mean())
    assert "mismatch/round_4/num_tokens" not in out
    assert out["mismatch/round_1/num_tokens"] == 30 + 25 + 12
    assert "mismatch/doctor/token_id_mismatch" not in out  # no ids given


def test_rounds_past_the_cap_pool_into_the_last_and_count_uncapped():
    train, rollout, mask = _batch([[3] * (MAX_ROUNDS + 3)])
    out = round_metrics(train, rollout, mask)
    assert out["mismatch/rounds/per_seq_max"] == MAX_ROUNDS + 3
    assert out[f"mismatch/round_{MAX_ROUNDS}/num_tokens"] == 3 * 4
    assert f"mismatch/round_{MAX_ROUNDS + 1}/num_tokens" not in out


def test_token_identity_share_overall_and_per_round():
    train, rollout, mask = _batch([[30, 20], [25, 15]])
    ids = torch.randint(5, 100, mask.shape, generator=torch.Generator().manual_seed(1))
    same = round_metrics(train, rollout, mask, trainer_ids=ids, rollout_ids=ids.clone())
    assert (
        same["mismatch/doctor/token_id_mismatch"] == 0.0 and same["mismatch/round_2/token_id_mismatch"] == 0.0
    )
    assert round_findings(same) == []
    shifted = ids.clone()
    shifted[0, 32:] = ids[0, 31:-1]  # row 0's second round, one position late
    out = round_metrics(train, rollout, mask, trainer_ids=shifted, rollout_ids=ids)
    changed = int(((shifted != ids) & (mask != 0)).sum())
    assert out["mismatch/doctor/token_id_mismatch"] == changed / int(mask.sum())
    assert out["mismatch/round_1/token_id_mismatch"] == 0.0 and out["mismatch/round_2/token_id_mismatch"] > 0
    (cause, line), *rest = round_findings(out)
    assert cause == "token_ids" and "(round 2)" in line and "not numerics" in line and not rest
    # single-turn batches get the identity share too (a shifted response shows there)
    train1, rollout1, mask1 = _batch([[40], [30]])
    ids1 = torch.arange(mask1.numel()).reshape(mask1.shape)
    one = round_metrics(train1, rollout1, mask1, trainer_ids=ids1 + 1, rollout_ids=ids1)
    assert one == {"mismatch/doctor/token_id_mismatch": 1.0}


def test_heavy_later_rounds_behind_a_rounding_first_round_are_named():
    train, rollout, mask = _batch([[30, 30]] * 8)
    index = round_index(mask)
    assert round_findings(round_metrics(train, rollout, mask)) == []
    bad = train.clone()
    second = (index == 2).nonzero()
    pick = second[torch.arange(0, second.shape[0], 4)]  # every 4th token of round 2: 25% off by 2 nats
    bad[pick[:, 0], pick[:, 1]] -= 2.0
    out = round_metrics(bad, rollout, mask)
    assert out["mismatch/round_2/share_above_1"] == pytest.approx(0.25, abs=0.01)
    ((cause, line),) = round_findings(out)
    assert cause == "rounds" and line.startswith("round 2:") and "re-tokenised" in line
    # the same tails in round 1 too: nothing points at later rounds (the whole-batch doctor names the tails)
    first = (index == 1).nonzero()
    pick = first[torch.arange(0, first.shape[0], 4)]
    bad[pick[:, 0], pick[:, 1]] -= 2.0
    assert round_findings(round_metrics(bad, rollout, mask)) == []


def test_the_doctor_logs_rounds_and_says_the_round_cause_instead_of_tails():
    train, rollout, mask = _batch([[30, 30]] * 8)
    second = (round_index(mask) == 2).nonzero()
    bad_train, bad_rollout = train.clone(), rollout.clone()
    down, up = second[0::4], second[2::4]  # a quarter of round 2 scored 2 nats lower, a quarter 2 nats higher
    bad_train[down[:, 0], down[:, 1]] -= 2.0
    bad_rollout[up[:, 0], up[:, 1]] -= 2.0
    sig, lines = Doctor().step(1, bad_train, bad_rollout, mask)
    assert sig["mismatch/round_2/share_above_1"] == 0.5 and sig["mismatch/doctor/findings"] == 1.0
    assert (
        sig["mismatch/doctor/share_above_1"] == 0.25
    )  # the whole batch has heavy tails: said as the round cause
    assert len(lines) == 1 and lines[0].startswith("step 1: round 2:")
    sig, lines = Doctor().step(1, train, rollout, mask)
    assert lines == [] and sig["mismatch/doctor/findings"] == 0.0 and "mismatch/round_1/kl_k3" in sig


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"trainer_ids": torch.zeros(1, 4, dtype=torch.long)}, "together"),
        ({"trainer_ids": torch.zeros(1, 4), "rollout_ids": torch.zeros(1, 4)}, "not log-probs"),
        ({"trainer_ids": torch.zeros(1, 3, dtype=torch.long), "rollout_ids": torch.zeros(1, 4, dtype=torch.long)},
         "token-id tensor"),
        ({"max_rounds": 1}, "max_rounds"),
        ({"mask_width": 3}, r"one \[batch, response_len\] shape, got \(1, 4\), \(1, 4\) and \(1, 3\)"),
    ],
)  # fmt: skip
def test_bad_inputs_fail_in_one_line(kwargs, needle):
    train, rollout, mask = _batch([[1, 1]])
    mask = mask[:, : kwargs.pop("mask_width", 4)]
    with pytest.raises(MetricsInputError, match=needle) as err:
        round_metrics(train[:, :4], rollout[:, :4], mask, **kwargs)
    assert "\n" not in str(err.value)


def test_the_docs_name_every_round_key():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "reading-a-mismatch.md").read_text()
    section = doc.split("## Multi-turn: the gap per round, and token identity", 1)[1].split("\n## ", 1)[0]
    train, rollout, mask = _batch([[30, 20], [25, 15]])
    ids = torch.zeros(mask.shape, dtype=torch.long)
    keys = round_metrics(train, rollout, mask, trainer_ids=ids, rollout_ids=ids)
    names = {k.replace("round_1/", "round_{k}/").replace("round_2/", "round_{k}/") for k in keys}
    assert len(names) == 3 + len(ROUND_KEYS) + 2  # identity, rounds per sequence (2), per-round keys
    missing = [n for n in names if f"`{n}`" not in section and f"`{n.rsplit('/', 1)[1]}`" not in section]
    assert missing == []


def test_a_bias_in_round_1_is_still_named_beside_a_re_tokenised_round_2():
    train, rollout, mask = _batch([[30, 30]] * 8)
    second = (round_index(mask) == 2).nonzero()
    biased = (train - 0.18).clamp(max=0.0)  # top-p's log(kept mass) on every token of both rounds
    biased[second[0::4, 0], second[0::4, 1]] -= 2.0  # and round 2 scored in another history
    rollout2 = rollout.clone()
    rollout2[second[2::4, 0], second[2::4, 1]] -= 2.0
    sig, lines = Doctor({"top_p": 0.8}).step(1, biased, rollout2, mask)
    causes = sorted(line.split(":")[1].strip().split(" ")[0] for line in lines)
    assert causes == ["round", "systematic"], lines  # the round cause and round 1's bias, each once
    bias_line = next(line for line in lines if "systematic bias" in line)
    assert "top_p=0.8" in bias_line and "-0.18" in bias_line  # judged on round 1 alone: the whole offset
    # without the offset, round 1 is rounding: only the round cause
    sig, lines = Doctor({"top_p": 0.8}).step(
        1,
        train.clone().index_put_(
            (second[0::4, 0], second[0::4, 1]), train[second[0::4, 0], second[0::4, 1]] - 2.0
        ),
        rollout2,
        mask,
    )
    assert len(lines) == 1 and lines[0].startswith("step 1: round 2:"), lines


def test_unexplained_tokens_are_round_1_up_to_the_first_differing_id():
    mask = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 1, 1]])
    ids = torch.arange(12).reshape(2, 6)
    other = ids.clone()
    other[0, 1] = -5  # row 0 differs at its second token
    want_rounds = [[True, True, True, False, False, False]] * 2
    assert unexplained_mask(mask, ["rounds"]).tolist() == want_rounds
    assert unexplained_mask(mask, ["token_ids"], ids, other).tolist() == [
        [True, False, False, False, False, False],
        [True, True, True, False, False, False],
    ]
    assert unexplained_mask(mask, []).tolist() == (mask != 0).tolist()
