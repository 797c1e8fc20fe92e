"""What DCP sends between ranks after a save (write/dcp_exchange.py): a rank's write results
once per file layout, then a token; the coordinator's metadata never (issue 33). The 2-rank
run is tests/multiproc/test_dedupe_multirank.py (the replay scenario)."""

from __future__ import annotations

import pickle

import pytest
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from lightning_preempt.format import dcp_compat as _compat
from lightning_preempt.write.dcp_exchange import KeptMetadata, ResultsKept, SentResults, new_token, unwrap_metadata


def _results(name: str, n: int) -> list[WriteResult]:
    return [WriteResult(index=MetadataIndex(f"t{i}"), size_in_bytes=8,
                        storage_data=_compat.DcpStorageInfo(name, 8 * i, 8)) for i in range(n)]  # fmt: skip


def _travel(obj: object) -> object:  # what DCP's gather does to a rank's value
    return pickle.loads(pickle.dumps(obj))


def test_results_travel_in_full_once_then_as_a_token_and_resolve_to_one_kept_list() -> None:
    kept = ResultsKept()
    tokens = [new_token(), new_token()]
    full = [SentResults(_results(f"__{r}_0.distcp", 500), tokens[r], same=False) for r in range(2)]
    first = kept.resolve([_travel(s) for s in full])  # type: ignore[misc]
    assert [[(w.index.fqn, w.storage_data.relative_path) for w in r] for r in first] == [
        [(w.index.fqn, w.storage_data.relative_path) for w in s] for s in full
    ]
    same = [SentResults(list(s), s.token, same=True) for s in full]
    sent = [pickle.dumps(s) for s in same]
    assert all(len(b) < len(pickle.dumps(list(s))) / 50 for b, s in zip(sent, same, strict=True))  # a token, not 500
    second = kept.resolve([pickle.loads(b) for b in sent])
    third = kept.resolve([pickle.loads(b) for b in sent])
    assert all(a is b is c for a, b, c in zip(first, second, third, strict=True))  # .metadata's cache hits
    assert kept.hits == 4


def test_a_token_the_coordinator_does_not_hold_raises() -> None:
    kept = ResultsKept()
    with pytest.raises(RuntimeError, match="out of step"):
        kept.resolve([_travel(SentResults(_results("a", 2), new_token(), same=True))])  # type: ignore[list-item]
    token = new_token()
    kept.resolve([_travel(SentResults(_results("a", 2), token, same=False))])  # type: ignore[list-item]
    kept.clear()  # a failed save clears every cache
    with pytest.raises(RuntimeError, match="out of step"):
        kept.resolve([_travel(SentResults(_results("a", 2), token, same=True))])  # type: ignore[list-item]


def test_plain_lists_pass_through_and_forget_what_was_kept() -> None:
    kept = ResultsKept()
    token = new_token()
    kept.resolve([_travel(SentResults(_results("a", 2), token, same=False))])  # type: ignore[list-item]
    plain = _results("b", 3)
    assert kept.resolve([plain])[0] is plain
    with pytest.raises(RuntimeError):  # the plain list replaced what rank 0 had sent
        kept.resolve([_travel(SentResults([], token, same=True))])  # type: ignore[list-item]


def test_the_metadata_stays_on_the_coordinator() -> None:
    metadata = Metadata(state_dict_metadata={})
    wrapped = KeptMetadata(metadata)
    assert unwrap_metadata(wrapped) is metadata and unwrap_metadata(metadata) is metadata
    assert _travel(wrapped) is None  # what DCP's broadcast hands the other ranks
    assert len(pickle.dumps(wrapped)) < 100
