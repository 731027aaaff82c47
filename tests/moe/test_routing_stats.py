"""RoutingStats accumulation, its JSON file, and --gpu-experts selection from it."""

from __future__ import annotations

import json

import pytest
import torch

from hetserve.errors import InvalidInputError
from hetserve.moe.placement import RoutingStats, choose_gpu_experts


def test_accumulate_save_load_round_trip(tmp_path):
    stats = RoutingStats()
    stats.add(3, torch.tensor([[0, 2], [2, 5]]), num_experts=8)
    stats.add(3, torch.tensor([[2, 7]]))
    stats.add(4, torch.tensor([[1, 1]]), num_experts=4)
    assert stats.counts(3) == [1, 0, 3, 0, 0, 1, 0, 1]
    path = tmp_path / "stats.json"
    stats.save(path)
    data = json.loads(path.read_text())
    assert data["layers"]["3"] == [1, 0, 3, 0, 0, 1, 0, 1] and data["tokens"] == {"3": 3, "4": 1}
    again = RoutingStats.load(path)
    assert again.to_dict() == stats.to_dict()


def test_counts_grow_when_a_higher_expert_appears():
    stats = RoutingStats()
    stats.add(0, torch.tensor([[1]]))
    stats.add(0, torch.tensor([[4]]))
    assert stats.counts(0) == [0, 1, 0, 0, 1]


def test_choose_gpu_experts_from_a_stats_file(tmp_path):
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"layers": {"1": [5, 9, 0, 9, 1], "2": [0, 0, 3, 0, 7]}}))
    stats = RoutingStats.load(path)
    # Ties (experts 1 and 3 with 9) are kept by count then id; the result is sorted by id.
    assert choose_gpu_experts(stats, 2) == {1: [1, 3], 2: [2, 4]}
    assert choose_gpu_experts(stats, 3) == {1: [0, 1, 3], 2: [0, 2, 4]}
    assert choose_gpu_experts(stats, 0) == {1: [], 2: []}
    assert choose_gpu_experts(stats, 99)[1] == [0, 1, 2, 3, 4]
    with pytest.raises(InvalidInputError):
        choose_gpu_experts(stats, -1)


@pytest.mark.parametrize(
    "content",
    [
        "{",
        json.dumps({"experts": {}}),
        json.dumps({"layers": {"x": [1]}}),
        json.dumps({"layers": {"1": [1, -2]}}),
    ],
)
def test_malformed_stats_files_are_typed_errors(tmp_path, content):
    path = tmp_path / "stats.json"
    path.write_text(content)
    with pytest.raises(InvalidInputError, match="stats"):
        RoutingStats.load(path)
