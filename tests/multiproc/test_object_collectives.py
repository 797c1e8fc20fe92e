"""The object collectives of collective/groups.py across 2 real gloo ranks: one message a rank
for a short pickle, a second for a long one, whichever rank sent it; every rank gets every
value (``all_gather_objects``) or rank 0's (``broadcast_object``), with the HINT-carrying
outcomes of collective/agree.py among them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ranks import run_ranks

pytestmark = pytest.mark.multiproc


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from lightning_preempt.collective import groups as pdist
    from lightning_preempt.collective.agree import decide

    group = pdist.new_gloo_group(timeout_s=60)
    sent: list[str] = []
    real_all_gather, real_broadcast = dist.all_gather, dist.broadcast
    dist.all_gather = lambda *a, **k: sent.append("all_gather") or real_all_gather(*a, **k)  # type: ignore[assignment]
    dist.broadcast = lambda *a, **k: sent.append("broadcast") or real_broadcast(*a, **k)  # type: ignore[assignment]
    long = "x" * (3 * pdist.OBJECT_BLOCK_BYTES)
    room = pdist.OBJECT_BLOCK_BYTES - 8
    results = {
        "short": pdist.all_gather_objects({"rank": rank}, group),
        "one_long": pdist.all_gather_objects(long if rank == 1 else rank, group),
        "edge": pdist.all_gather_objects(b"e" * (room - 40 + rank * 80), group),  # under / over the block
        "b_short": pdist.broadcast_object(("from", rank), group),
        "b_long": pdist.broadcast_object(long + str(rank), group),
        "none": pdist.broadcast_object(None, group),
    }
    try:
        decide(lambda: (_ for _ in ()).throw(ValueError("no")), group, what="testing")
    except Exception as err:  # every rank gets rank 0's failure
        results["decided"] = type(err).__name__
    dist.all_gather, dist.broadcast = real_all_gather, real_broadcast
    results["edge"] = [len(x) for x in results["edge"]]
    results["one_long"] = [len(x) if isinstance(x, str) else x for x in results["one_long"]]
    results["b_long"] = len(results["b_long"]) if results["b_long"].endswith("0") else "wrong sender"
    results["sent"] = sent
    Path(out, f"r{rank}.json").write_text(json.dumps(results))


def test_object_collectives_send_one_message_unless_a_pickle_is_long(tmp_path: Path) -> None:
    run_ranks(_worker, 2, tmp_path, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    from lightning_preempt.collective.groups import OBJECT_BLOCK_BYTES

    room = OBJECT_BLOCK_BYTES - 8
    for r in (r0, r1):
        assert r["short"] == [{"rank": 0}, {"rank": 1}]
        assert r["one_long"] == [0, 3 * OBJECT_BLOCK_BYTES]
        assert r["edge"] == [room - 40, room + 40]
        assert r["b_short"] == ["from", 0]
        assert r["b_long"] == 3 * OBJECT_BLOCK_BYTES + 1
        assert r["none"] is None
        assert r["decided"] == "RankFailedError"  # a foreign error: the same class on every rank
        # short: 1 message; one long: 2; the edge (one rank over): 2; broadcasts 1, 2, 1; decide's 1
        assert r["sent"] == ["all_gather", "all_gather", "all_gather", "all_gather", "all_gather",
                             "broadcast", "broadcast", "broadcast", "broadcast", "broadcast"]  # fmt: skip
