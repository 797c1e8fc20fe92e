"""benchmarks/bench_resume.py's verify_on_load table (issue 32): ``False`` against ``True``
round by round, split by which of the two loaded first, so that an order effect shows as
two rows that disagree while the "all" row and the CPU rows agree."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_resume import _verify_order_table


def _rows(lines: list[str]) -> dict[tuple[str, str], list[str]]:
    text = "\n".join(lines).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text if line.startswith("| warm")]
    return {(c[1], c[2]): c for c in cells}


def test_the_second_load_of_a_round_slower_shows_in_the_order_rows_not_in_the_cpu_rows() -> None:
    # 4 rounds, verify first in rounds 0 and 2: whichever loads second takes 1.5x the wall time
    verify_wall = [1.0, 1.5, 1.0, 1.5]
    noverify_wall = [1.5, 1.0, 1.5, 1.0]
    cpu = [0.3, 0.3, 0.3, 0.3]
    results = {("warm", "ours_verify"): verify_wall, ("warm", "ours_noverify"): noverify_wall}
    cpu_s = {("warm", "ours_verify"): cpu, ("warm", "ours_noverify"): cpu}
    rows = _rows(_verify_order_table(results, cpu_s, {"warm": [True, False, True, False]}))
    assert rows[("wall", "verify first")][6] == "1.50" and rows[("wall", "noverify first")][6] == "0.67", rows
    assert rows[("wall", "all")][3] == "4" and rows[("CPU", "all")][6] == "1.00", rows


def test_without_both_methods_there_is_no_table() -> None:
    assert _verify_order_table({("warm", "ours_verify"): [1.0]}, {}, {"warm": []}) == []
