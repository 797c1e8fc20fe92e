"""Cloud preemption notices (documented entry point; they live in
:mod:`lightning_preempt.preemption.notices`): ``make_sources(["aws", "gce", "azure"])`` or
``make_sources("auto")``. See docs/notices.md."""

from lightning_preempt.preemption.notices import (
    NAMES,
    AutoSource,
    AWSSpotSource,
    AzureSource,
    GCESource,
    NoopSource,
    make_sources,
    parse_names,
)

__all__ = ["NAMES", "AWSSpotSource", "AutoSource", "AzureSource", "GCESource", "NoopSource", "make_sources", "parse_names"]
