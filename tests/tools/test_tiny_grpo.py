"""Inputs of the tiny CPU GRPO run: the rule reward and the prompt rows (``rlalign_verl.tools.tiny_grpo``)."""

from __future__ import annotations

import pytest

from rlalign_verl.tools.tiny_grpo import compute_score, make_rows


def test_reward_rewards_copying_and_is_dense():
    truth = "red cat dog"
    assert compute_score("s", "red cat dog", truth) == pytest.approx(1.0)
    # 2 of 3 words; characters r,e,d,c,a,t all occur in the words
    assert compute_score("s", "red cat", truth) == pytest.approx(0.5 * 2 / 3 + 0.5)
    # no word copied, but 2 of 4 characters ("d", "o") occur: the dense half still separates samples
    assert compute_score("s", "dozz", truth) == pytest.approx(0.25)
    assert compute_score("s", "xyz 123", truth) == 0.0
    assert compute_score("s", "   ", truth) == 0.0 and compute_score("s", "red", "") == 0.0


def test_rows_follow_verls_rl_dataset_layout_and_are_deterministic():
    rows = make_rows(5, seed=3)
    assert rows == make_rows(5, seed=3) and rows != make_rows(5, seed=4)
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        (msg,) = row["prompt"]
        assert msg["role"] == "user" and msg["content"] == "Repeat: " + row["reward_model"]["ground_truth"]
        assert row["extra_info"] == {"index": i}
        # a response that repeats the words exactly gets the full reward
        assert (
            compute_score(
                row["data_source"], row["reward_model"]["ground_truth"], row["reward_model"]["ground_truth"]
            )
            == 1.0
        )
