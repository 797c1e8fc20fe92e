"""Bad arguments fail at construction with a HINT (issue 10), not one interval later."""

from __future__ import annotations

import dataclasses
import math
import signal
from typing import Any

import pytest

from lightning_preempt import PreemptionCallback, ShardedAsyncCheckpointIO, Tuning
from lightning_preempt.engine.config import PreemptionConfig

BAD_CALLBACK_ARGS: list[tuple[str, Any, str]] = [  # the common options
    ("every_n_train_steps", 2.5, "every_n_train_steps must be an int"),
    ("every_n_train_steps", 0, "every_n_train_steps must be an int >= 1"),
    ("every_n_train_steps", True, "every_n_train_steps must be an int"),
    ("every_n_seconds", math.nan, "every_n_seconds must be a finite number"),
    ("every_n_seconds", math.inf, "every_n_seconds must be a finite number"),
    ("every_n_seconds", -1, "every_n_seconds must be > 0"),
    ("keep_last_n", 2.5, "keep_last_n must be an int"),
    ("keep_last_n", 0, "keep_last_n must be an int >= 1"),
    ("grace_period_s", -5, "grace_period_s must be > 0"),
    ("storage_options", "token=x", "storage_options must be a dict"),
    ("resume", "no", "resume must be True or False"),
    ("tier0_every_n_steps", 0, "tier0_every_n_steps must be an int >= 1"),
    ("notices", ["nope"], "unknown notice source 'nope'"),
]
BAD_TUNING_ARGS: list[tuple[str, Any, str]] = [
    ("exit_code", 0, "exit_code must be an int between 1 and 255"),
    ("exit_code", 300, "exit_code must be an int between 1 and 255"),
    ("signals", "SIGTERM", "signals must be a non-empty list"),
    ("signals", ("SIGKILL",), "signals must be signals that can be caught"),
    ("signals", ("SIGSEGV",), "signals must be signals that can be caught"),
    ("signals", ("SIGNOPE",), "signals must be known signal names"),
    ("signals", (), "signals must be a non-empty list"),
    ("agree_every_n_steps", 0, "agree_every_n_steps must be an int >= 1"),
    ("agree_every_n_steps", "often", "agree_every_n_steps must be an int"),
    ("requeue", "yes", "requeue must be True, False or None"),
    ("lease_timeout_s", 0, "lease_timeout_s must be > 0"),
    ("retries", 0, "retries must be an int >= 1"),
    ("backoff_s", math.nan, "backoff_s must be a finite number"),
    ("thread_count", 0, "thread_count must be an int >= 1"),
    ("thread_count", 1.5, "thread_count must be an int"),
    ("overlap_staging", 1, "overlap_staging must be True, False or None"),
    ("pinned_memory_budget", True, "pinned_memory_budget must be bytes (int), a fraction (float) or None"),
    ("on_notice", "later", "on_notice must be 'continue' or 'exit'"),
    ("memory_dirpath", "s3://b/x", "memory_dirpath must be a local directory"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD_CALLBACK_ARGS, ids=[f"{n}={v!r}" for n, v, _ in BAD_CALLBACK_ARGS])
def test_a_bad_callback_argument_fails_at_construction_with_a_hint(name: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match="HINT: ") as info:
        PreemptionCallback("ckpts", **{name: value})
    assert message in str(info.value)


@pytest.mark.parametrize(("name", "value", "message"), BAD_TUNING_ARGS, ids=[f"{n}={v!r}" for n, v, _ in BAD_TUNING_ARGS])
def test_a_bad_tuning_field_fails_at_construction_with_a_hint(name: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match="HINT: ") as info:
        Tuning(**{name: value})
    assert message in str(info.value)


def test_an_empty_dirpath_is_refused() -> None:
    with pytest.raises(ValueError, match="dirpath must be a directory or URL"):
        PreemptionCallback("")


def test_good_arguments_are_normalised() -> None:
    tuning = Tuning(signals=("USR1", 15, "SIGTERM"), exit_code=1)
    cb = PreemptionCallback("ckpts/", every_n_train_steps=5, tuning=tuning)
    assert cb.dirpath == "ckpts"
    assert cb.config.signals == (signal.SIGUSR1, signal.SIGTERM)  # resolved eagerly, duplicates dropped
    assert cb.signal_flag.signums == (signal.SIGUSR1, signal.SIGTERM)
    assert cb.config.exit_code == 1 and cb.config.tuning == tuning
    with pytest.raises(dataclasses.FrozenInstanceError):
        cb.config.keep_last_n = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.retries = 5  # type: ignore[misc]
    assert PreemptionConfig(dirpath="x").exit_code == 143


BAD_PLUGIN_ARGS: list[tuple[str, Any, str]] = [
    ("verify_on_load", None, "verify_on_load must be True or False"),
    ("trust_checkpoints", "yes", "trust_checkpoints must be True or False"),
    ("storage_options", ["token"], "storage_options must be a dict"),
    ("host_memory_budget", 0.0, "host_memory_budget as a fraction must be in (0, 1]"),
    ("host_memory_budget", 1.5, "host_memory_budget as a fraction must be in (0, 1]"),
    ("host_memory_budget", 4096, "host_memory_budget must be at least 1048576 bytes"),
    ("host_memory_budget", "8GB", "host_memory_budget must be bytes (int), a fraction (float) or None"),
    ("tuning", {"retries": 2}, "tuning must be a lightning_preempt.Tuning"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD_PLUGIN_ARGS, ids=[f"{n}={v!r}" for n, v, _ in BAD_PLUGIN_ARGS])
def test_a_bad_plugin_argument_fails_at_construction_with_a_hint(name: str, value: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match="HINT: ") as info:
        ShardedAsyncCheckpointIO(**{name: value})
    assert message in str(info.value)


# ---- storage URLs (issue 20) ---------------------------------------------------------------
def test_a_mistyped_protocol_fails_at_construction_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown protocol 'htps'") as info:
        PreemptionCallback("htps://bucket/run", every_n_train_steps=5)
    hint = str(info.value).split("HINT: ", 1)[1]
    assert "Did you mean https://" in hint and "gs, " in hint and "s3, " in hint and "memory, " in hint


def test_a_remote_local_dirpath_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="local_dirpath must be a local directory") as info:
        PreemptionCallback("ckpts", local_dirpath="gs://bucket/local")
    assert "the shared storage (gs://, s3://…) is dirpath" in str(info.value)


def test_the_fabric_front_end_takes_the_callbacks_options_with_the_same_validation() -> None:
    from lightning_preempt.fabric import Preemption

    for name, value, message in BAD_CALLBACK_ARGS:
        with pytest.raises(ValueError, match="HINT: ") as info:
            Preemption(None, "ckpts", **{name: value})
        assert message in str(info.value)
    preempt = Preemption(None, "ckpts/", every_n_train_steps=3, notices="aws", tuning=Tuning(exit_code=7))
    assert preempt.config == PreemptionCallback("ckpts", 3, notices=["aws"], tuning=Tuning(exit_code=7)).config
    with pytest.raises(ValueError, match="step_key must be a non-empty string"):
        Preemption(None, "ckpts", step_key="")
    with pytest.raises(TypeError, match="unexpected keyword argument 'every_n_steps'") as typo:
        Preemption(None, "ckpts", every_n_steps=3)
    assert "HINT: its options are dirpath, every_n_train_steps" in str(typo.value)


def test_tier0_is_on_exactly_when_tier0_every_n_steps_is_set() -> None:
    assert PreemptionConfig(dirpath="ckpts/run").memory_dirpath is None
    on = PreemptionConfig.make(Tuning(memory_dirpath="/dev/shm/x"), dirpath="ckpts/run", tier0_every_n_steps=4)
    assert (on.tier0_every_n_steps, on.memory_dirpath) == (4, "/dev/shm/x")
    with pytest.raises(ValueError, match=r"tier0_every_n_steps must be set when tuning\.memory_dirpath is"):
        PreemptionConfig.make(Tuning(memory_dirpath="/dev/shm/x"), dirpath="ckpts/run")
