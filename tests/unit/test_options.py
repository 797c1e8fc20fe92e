"""Every option is written once (engine/config.py), a Trainer user meets at most 25, and the
0.2 spellings still reach the same effective config, with a FutureWarning naming the new one."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest

from lightning_preempt import PeerReplica, PreemptionCallback, ShardedAsyncCheckpointIO, Tuning
from lightning_preempt.engine import config as cfg
from lightning_preempt.engine import deprecated
from lightning_preempt.fabric import Preemption
from lightning_preempt.preemption.sources import PreemptionSource

ROOT = Path(__file__).resolve().parents[2]


def _options(cls: type) -> list[str]:
    params = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]


def test_a_trainer_user_meets_at_most_25_options_each_written_once_in_the_config() -> None:
    callback, plugin, peer = _options(PreemptionCallback), _options(ShardedAsyncCheckpointIO), _options(PeerReplica)
    assert (len(callback), len(plugin), len(peer)) == (11, 5, 1)
    assert len(callback) + len(plugin) + len(peer) <= 25
    # the signatures are the configs' own fields, plus tuning; their defaults are the configs'
    assert callback == [*cfg.own_fields(cfg.PreemptionConfig), "tuning"]
    assert plugin == [*cfg.own_fields(cfg.CheckpointIOConfig), "tuning"]
    assert PreemptionCallback("ckpts").config == cfg.PreemptionConfig(dirpath="ckpts")
    assert ShardedAsyncCheckpointIO().config == cfg.CheckpointIOConfig()
    fabric = [n for n in _options(Preemption) if n not in ("fabric", "step_key")]
    assert fabric == ["dirpath", "tuning"]  # the rest by keyword: the same config's fields


def test_every_field_has_a_docstring_and_docs_options_md_is_generated_from_them() -> None:
    spec = importlib.util.spec_from_file_location("gen_options", ROOT / "scripts" / "gen_options.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for cls in (cfg.Tuning, cfg.PreemptionConfig, cfg.CheckpointIOConfig):
        assert set(gen.field_docs(cls)) >= set(cfg.own_fields(cls)), cls
    current = (ROOT / "docs" / "options.md").read_text()
    assert gen.render(current) == current, "docs/options.md is stale: run python scripts/gen_options.py"
    assert "| `retries` | `4` |" in current and "| `dirpath` | (required) |" in current


class _Source(PreemptionSource):
    name = "mine"

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def poll(self) -> Any:
        return None


OLD_FRONT: list[tuple[dict[str, Any], dict[str, Any], str]] = [  # 0.2 kwargs, new kwargs, warning
    ({"signals": ("SIGUSR1",)}, {"tuning": Tuning(signals=("SIGUSR1",))}, "use PreemptionCallback(tuning=Tuning(signals=...))"),
    ({"exit_code": 9, "requeue": False}, {"tuning": Tuning(exit_code=9, requeue=False)}, "Tuning(exit_code=...)"),
    ({"list_retries": 2, "list_backoff_s": 0.5}, {"tuning": Tuning(retries=2, backoff_s=0.5)},
     "list_retries=...) is deprecated; use PreemptionCallback(tuning=Tuning(retries=...))"),
    ({"agree_every_n_steps": 3, "overlap_agreement": False}, {"tuning": Tuning(agree_every_n_steps=3, overlap_agreement=False)},
     "Tuning(overlap_agreement=...)"),
    ({"lease": False, "lease_timeout_s": 5.0, "probe_storage": False, "ledger": False, "log_metrics": False},
     {"tuning": Tuning(lease=False, lease_timeout_s=5.0, probe_storage=False, ledger=False, log_metrics=False)}, "Tuning(lease=...)"),
    ({"on_notice": "exit", "global_batch": "keep", "save_on_train_end": False},
     {"tuning": Tuning(on_notice="exit", global_batch="keep", save_on_train_end=False)}, "Tuning(on_notice=...)"),
    ({"detect_failures": True, "heartbeat_timeout_s": 2.0, "failure_exit_code": 70},
     {"tuning": Tuning(detect_failures=True, heartbeat_timeout_s=2.0, failure_exit_code=70)}, "Tuning(heartbeat_timeout_s=...)"),
    ({"memory_dirpath": "/dev/shm/lp-x"}, {"tier0_every_n_steps": "auto", "tuning": Tuning(memory_dirpath="/dev/shm/lp-x")},
     "Tuning(memory_dirpath=...)"),  # 0.2: a tier-0 directory turned tier 0 on
    ({"notices": "aws", "sources": [_SOURCE := _Source()]}, {"notices": ["aws", _SOURCE]},
     "sources=...) is deprecated; pass the sources in notices=[...]"),
    ({"requeue_timeout_s": 3.0, "agree_interval_s": 1.0}, {}, "requeue_timeout_s=...) is deprecated and has no effect"),
]


@pytest.mark.parametrize(("old", "new", "warning"), OLD_FRONT, ids=[",".join(o) for o, _, _ in OLD_FRONT])
def test_an_old_callback_or_fabric_name_reaches_the_same_config_with_a_future_warning(
    old: dict[str, Any], new: dict[str, Any], warning: str
) -> None:
    expected = PreemptionCallback("ckpts", **new).config
    with pytest.warns(FutureWarning) as caught:
        assert PreemptionCallback("ckpts", **old).config == expected
    assert any(warning in str(w.message) for w in caught), [str(w.message) for w in caught]
    with pytest.warns(FutureWarning, match=r"Preemption\("):
        assert Preemption(None, "ckpts", **old).config == expected


OLD_PLUGIN: list[tuple[dict[str, Any], Tuning, str]] = [
    ({"thread_count": 2}, Tuning(thread_count=2), "use ShardedAsyncCheckpointIO(tuning=Tuning(thread_count=...))"),
    ({"drain_retries": 2, "drain_backoff_s": 0.01}, Tuning(retries=2, backoff_s=0.01), "Tuning(retries=...)"),
    ({"pin_memory": False}, Tuning(pinned_memory_budget=0), "Tuning(pinned_memory_budget=...)"),
    ({"pinned_memory_budget": 2**21, "overlap_staging": True}, Tuning(pinned_memory_budget=2**21, overlap_staging=True),
     "Tuning(overlap_staging=...)"),
    ({"sharded_keys": ("state_dict",), "drain_workers": 8}, Tuning(), "sharded_keys=...) is deprecated and has no effect"),
]


@pytest.mark.parametrize(("old", "tuning", "warning"), OLD_PLUGIN, ids=[",".join(o) for o, _, _ in OLD_PLUGIN])
def test_an_old_plugin_name_reaches_the_same_config_with_a_future_warning(old: dict[str, Any], tuning: Tuning, warning: str) -> None:
    with pytest.warns(FutureWarning) as caught:
        io = ShardedAsyncCheckpointIO(**old)
    assert io.config == ShardedAsyncCheckpointIO(tuning=tuning).config
    assert any(warning in str(w.message) for w in caught), [str(w.message) for w in caught]
    if old.get("pin_memory") is False:
        assert io.saver.stager.pin_memory is False


def test_the_plugins_old_local_dirpath_still_makes_two_tiers(tmp_path: Path) -> None:
    with pytest.warns(FutureWarning, match=r"use PreemptionCallback\(local_dirpath=...\)"):
        io = ShardedAsyncCheckpointIO(local_dirpath=str(tmp_path / "local"))
    assert io.saver.tiers is not None and io.saver.tiers.local_root == str(tmp_path / "local")


def test_new_spellings_warn_nothing_and_unknown_names_raise_a_type_error_with_a_hint() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb = PreemptionCallback("ckpts", 5, tuning=Tuning(signals=("SIGUSR1", "SIGTERM")), notices=["aws", _Source()])
        ShardedAsyncCheckpointIO(host_memory_budget=0.5, tuning=Tuning(thread_count=2))
    assert cb.config.signums == (signal.SIGUSR1, signal.SIGTERM) and cb.config.notice_names == ["aws"]
    assert [s.name for s in cb.engine.controller.sources] == ["signal", "mine"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'keep_last'") as info:
        PreemptionCallback("ckpts", keep_last=3)
    assert "HINT: its options are dirpath, every_n_train_steps" in str(info.value) and "tuning=Tuning" in str(info.value)
    with pytest.raises(TypeError, match="HINT: its options are storage_options, host_memory_budget"):
        ShardedAsyncCheckpointIO(verify=False)


def test_every_old_name_is_mapped_to_a_field_that_exists() -> None:
    fields = {f.name for f in dataclasses.fields(Tuning)}
    assert set(deprecated.FRONT_TO_TUNING.values()) <= fields and set(deprecated.PLUGIN_TO_TUNING.values()) <= fields
    assert not (set(deprecated.FRONT_TO_TUNING) | set(deprecated.FIXED)) & set(cfg.own_fields(cfg.PreemptionConfig))


def test_the_callback_hands_its_storage_options_and_local_tier_to_the_plugin_and_says_what_tuning_cannot_reach(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from types import SimpleNamespace

    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_preempt.lightning.strategies import ensure_plugin

    config = PreemptionCallback("ckpts", storage_options={"token": "anon"}, local_dirpath=str(tmp_path / "nvme"),
                                tuning=Tuning(thread_count=3, retries=2)).config  # fmt: skip
    installed = ensure_plugin(SimpleNamespace(checkpoint_io=TorchCheckpointIO()), config)
    assert installed.config.thread_count == 3 and installed.storage_options == {"token": "anon"}
    assert installed.loader.storage_options == installed.saver.storage_options == {"token": "anon"}
    assert installed.saver.tiers is not None and installed.saver.tiers.local_root == str(tmp_path / "nvme")
    assert installed.saver.tiers.retries == 2
    assert "does not reach" not in caplog.text
    yours = ShardedAsyncCheckpointIO({"endpoint_url": "http://x"})
    assert ensure_plugin(SimpleNamespace(checkpoint_io=yours), config) is yours
    assert yours.storage_options == {"endpoint_url": "http://x", "token": "anon"}  # the callback's win
    assert "tuning (thread_count=3) does not reach the ShardedAsyncCheckpointIO you passed" in caplog.text
