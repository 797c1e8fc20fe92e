"""The cost-balanced slow-test sample of tests/conftest.py and its table, tests/slow_costs.json."""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def _conftest():  # type: ignore[no-untyped-def]
    # Loaded under its own name: tests/multihost/ has a conftest.py too.
    spec = importlib.util.spec_from_file_location("lp_root_conftest", TESTS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_is_well_formed() -> None:
    table = json.loads((TESTS / "slow_costs.json").read_text())
    assert table["default_s"] > 0 and table["budget_s"] > 0
    for part in ("slow", "fast"):
        assert all("::" in nodeid and seconds > 0 for nodeid, seconds in table[part].items()), part
    assert not set(table["slow"]) & set(table["fast"])


def test_every_slow_test_of_the_table_is_in_one_slice_and_the_slices_cost_alike() -> None:
    conftest = _conftest()
    costs = conftest.SLOW_COSTS
    n = conftest.SAMPLE_EVERY
    assert 1 <= n <= conftest.MAX_PERIOD == 10
    split = conftest.balanced_slices(costs, n)
    assert set(split) == set(costs) and set(split.values()) <= set(range(n))
    load = [sum(c for t, c in costs.items() if split[t] == k) for k in range(n)]
    # Longest first onto the cheapest slice: no two slices differ by more than one test.
    assert max(load) - min(load) <= max(costs.values())
    assert math.isclose(sum(load), sum(costs.values()))  # float costs, summed in another order


def test_the_split_depends_on_the_costs_only_not_on_their_order() -> None:
    conftest = _conftest()
    costs = {f"tests/x.py::t{i}": float(random.Random(i).randint(5, 90)) for i in range(40)}
    shuffled = dict(random.Random(1).sample(sorted(costs.items()), len(costs)))
    assert conftest.balanced_slices(costs, 5) == conftest.balanced_slices(shuffled, 5)
    load = [0.0] * 5
    for t, k in conftest.balanced_slices(costs, 5).items():
        load[k] += costs[t]
    assert max(load) - min(load) <= 90


def test_a_slow_test_missing_from_the_table_still_gets_a_slice() -> None:
    conftest = _conftest()
    k = conftest.slice_of("tests/e2e/test_new.py::test_not_measured_yet")
    assert 0 <= k < conftest.SAMPLE_EVERY
    assert k == conftest.slice_of("tests/e2e/test_new.py::test_not_measured_yet")
