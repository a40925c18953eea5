"""Timing helpers of ltmp.bench: interleaved rounds and time ratios paired round by round."""

import platform

import pytest
import torch

from ltmp.bench import GLIBC_MALLOC_ENV, allocator, compare_models, paired_ratio


class Recorder(torch.nn.Module):
    def __init__(self, name: str, log: list):
        super().__init__()
        self.name, self.log = name, log

    def forward(self, x):
        self.log.append(self.name)
        return x


def test_compare_models_starts_each_round_one_model_later():
    log = []
    models = {k: Recorder(k, log) for k in "abc"}
    t = compare_models(models, torch.zeros(1), warmup=0, reps=1, rounds=4)
    assert log == list("abcbcacababc")  # no model always runs first
    assert all(len(v["times"]) == v["reps"] == 4 for v in t.values())


def test_compare_models_keeps_repetitions_of_one_round_at_the_same_positions():
    log = []
    models = {k: Recorder(k, log) for k in "ab"}
    t = compare_models(models, torch.zeros(1), warmup=0, reps=2, rounds=2)
    assert log == list("aabbbbaa")  # times[i] of every model: round i // reps, so paired_ratio pairs in-round
    assert [len(v["times"]) for v in t.values()] == [4, 4]


def test_paired_ratio_is_the_median_of_each_rounds_ratio():
    # a slow spell in round 3 (4 s dense) slowed the reduced model alike (2 s): its ratio is 0.5 like round 1's;
    # a ratio of the two medians (1.5 / 2) would mix rounds
    timed = {"dense": {"times": [1.0, 2.0, 4.0]}, "reduced": {"times": [0.5, 1.5, 2.0]}}
    r = paired_ratio(timed, "reduced", "dense")
    assert r["median"] == 0.5 and r["p25"] <= 0.5 <= r["p75"] == pytest.approx(0.75)
    single = paired_ratio({"a": {"times": [3.0]}, "b": {"times": [2.0]}}, "a", "b")
    assert single == {"median": 1.5, "p25": 1.5, "p75": 1.5}


@pytest.fixture
def plain_env(monkeypatch):
    """No allocator settings in the environment."""
    for k in ("LD_PRELOAD", "GLIBC_TUNABLES", *GLIBC_MALLOC_ENV):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_allocator_names_a_preloaded_one(plain_env):
    plain_env.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert allocator() == "jemalloc"
    plain_env.setenv("LD_PRELOAD", "/opt/lib/libtcmalloc_minimal.so.4:/opt/lib/other.so")
    assert allocator() == "tcmalloc"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")
def test_allocator_names_glibc_malloc_settings(plain_env):
    assert allocator() == "glibc malloc (defaults)"
    plain_env.setenv("MALLOC_MMAP_THRESHOLD_", "4294967296")
    plain_env.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1:glibc.pthread.rseq=0")
    assert allocator() == "glibc malloc (MALLOC_MMAP_THRESHOLD_=4294967296, glibc.malloc.trim_threshold=1)"
